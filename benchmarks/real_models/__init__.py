"""benchmarks/real_models: see benchmarks/README.md."""
