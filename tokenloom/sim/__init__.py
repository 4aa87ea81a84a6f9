"""The simulator: tokenloom's own scheduler and EngineCore with a cost model in place of the model.

runner.py (SimulatedRunner), cost_model.py (step time from step shape, least-squares fit),
profiler.py (timing the real ModelRunner), profile.py (profile JSON), simulate.py (the workload
driver), sweep.py, cli.py (`tokenloom profile | simulate | explore`), profiles/ (shipped profiles).
"""
