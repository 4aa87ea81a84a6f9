"""Workloads and their measurement, shared by the benchmarks (bench/) and the simulator (sim/).

datasets.py (BenchRequest; random, ShareGPT and JSONL workloads; arrival times), build.py
(`build_workload` from vLLM's dataset options, `engine_workload` for the in-process benchmarks),
options.py (the shared --dataset-* / --random-* / --request-rate flags; argparse only),
metrics.py (TTFT/TPOT/ITL/E2E percentiles and throughput, vLLM's definitions), result.py (the
vLLM-shaped result file), clock.py (virtual and wall clocks), driver.py (`run_workload`: requests
into an EngineCore at their arrival times, timed per token), sweep.py (`--sweep KNOB=v1,v2`).

May import: tokenloom.config, tokenloom.sampling_params, tokenloom.core, tokenloom.engine (types
only). Never bench, sim or explore: they build on this room, not the other way round.
"""
