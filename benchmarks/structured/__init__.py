"""benchmarks/structured: see benchmarks/README.md."""
