"""Speculative decoding's pure-Python parts: the n-gram proposer (numpy, compiled with numba when
installed) and the opt-in adaptive drafting policy. Imports only tokenloom.config; the model runner
(tokenloom/model/spec_runner.py) and the engine core use it. The config (SpeculativeConfig) lives in
tokenloom/config.py, the acceptance statistics in tokenloom/core/spec_decode_stats.py. See
docs/speculative.md.
"""
