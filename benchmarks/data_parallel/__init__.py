"""benchmarks/data_parallel: see benchmarks/README.md."""
