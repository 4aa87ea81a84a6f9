"""Speculative decoding: the config, the n-gram proposer, acceptance statistics, the adaptive policy.

Pure Python + numpy (numba when installed): the scheduler (tokenloom/core) reads the config and
counts the statistics; the runner (tokenloom/model) runs the proposer after sampling and verifies
drafts with tokenloom/model/rejection_sampler.py. See docs/speculative.md.
"""
