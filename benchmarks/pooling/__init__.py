"""benchmarks/pooling: see benchmarks/README.md."""
