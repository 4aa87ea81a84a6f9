"""Benchmarks and figure scripts (benchmarks/README.md); a package so that scripts share code as
benchmarks.<area>.<module>."""
