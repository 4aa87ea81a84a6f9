"""benchmarks/scheduler: see benchmarks/README.md."""
