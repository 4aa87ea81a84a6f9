"""Speculative decoding's pure-Python parts: the proposers — n-gram (numpy, compiled with numba when
installed) and suffix decoding (arctic-inference's suffix trees, an optional extra) — and the opt-in
adaptive drafting policy. Imports only tokenloom.config; the model runner
(tokenloom/model/spec_runner.py) and the engine core use it. The config (SpeculativeConfig) lives in
tokenloom/config.py, the acceptance statistics in tokenloom/core/spec_decode_stats.py. See
docs/speculative.md.
"""
