"""benchmarks/quant: see benchmarks/README.md."""
