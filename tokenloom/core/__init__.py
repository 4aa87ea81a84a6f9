"""The scheduling brain, pure Python: Request, BlockPool, KVCacheManager, Scheduler, SchedulerOutput,
step replay (replay.py, `tokenloom replay`), the opt-in policies (policies.py, slo_budget.py) and the
step-time cost model (cost_model.py; gemm_rows.py, the runner's GEMM row buckets it charges). Shared
by the engine, the simulator and the explorer.

May import: tokenloom.config, tokenloom.sampling_params. Never torch, and nothing above it (model,
engine, ...): the scheduler must run, replay and be tested without a model.
"""
