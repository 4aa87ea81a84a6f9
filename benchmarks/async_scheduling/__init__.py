"""benchmarks/async_scheduling: see benchmarks/README.md."""
