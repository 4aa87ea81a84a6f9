"""benchmarks/spec_decode: see benchmarks/README.md."""
