"""The simulator: tokenloom's own scheduler and EngineCore with a cost model in place of the model.

runner.py (SimulatedRunner), executor.py (SimulatedExecutor: the engine core's executor over it),
cost_model.py (the least-squares fit of the step-time model in tokenloom/core/cost_model.py),
profiler.py (timing the real ModelRunner), quiet.py (waiting for an idle CPU before timing),
profile.py (profile JSON), simulate.py (a simulation: the workload driver over a SimulatedRunner on a
virtual clock), cli.py (`tokenloom profile | simulate`), profiles/ (the shipped profiles). The
driver, clocks, workloads, metrics and sweeps it shares with bench live in tokenloom/workload.

May import: everything below it (config, core, model, engine, workload). Never bench or explore.
"""
