"""The simulator: tokenloom's own scheduler and EngineCore with a cost model in place of the model.

runner.py (SimulatedRunner), executor.py (SimulatedExecutor: the engine core's executor over it),
clock.py (virtual and wall clocks), cost_model.py (step time from the step's shape, least-squares
fit), profiler.py (timing the real ModelRunner), quiet.py (waiting for an idle CPU before timing),
profile.py (profile JSON), simulate.py (the workload driver), sweep.py,
cli.py (`tokenloom profile | simulate | explore`), profiles/ (the shipped profile).
"""
