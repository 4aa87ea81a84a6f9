"""`tokenloom explore`: a local page over the real scheduler.

server.py (the HTTP page and its API), scenario.py (a scenario run step by step on the Scheduler with
the simulator's runner), presets.py (worked examples), index.html, cli.py (registers the command).

May import: everything below it (config, core, engine, workload, sim). Nothing imports explore but
tokenloom/cli.py, by name.
"""
