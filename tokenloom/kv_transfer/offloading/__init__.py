"""The OffloadingConnector (vLLM's `--kv-offloading-size` / `--kv-offloading-backend native`) with a disk tier.

    tiers.py      the scheduler side's bookkeeping: host slots (bounded, LRU) and disk entries (bounded, LRU)
    disk.py       the disk tier's files: one per block hash, atomic writes, a checksum, a fingerprinted index
    connector.py  OffloadingConnector, both roles, and its per-step metadata
"""
