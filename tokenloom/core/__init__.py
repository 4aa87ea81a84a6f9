"""The scheduling brain, pure Python: Request, BlockPool, KVCacheManager, Scheduler, SchedulerOutput,
step replay (replay.py, `tokenloom replay`). Shared by the engine, the simulator and the explorer.

May import: tokenloom.config, tokenloom.sampling_params. Never torch, and nothing above it (model,
engine, ...): the scheduler must run, replay and be tested without a model.
"""
