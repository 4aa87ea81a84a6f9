"""benchmarks/kernels: see benchmarks/README.md."""
