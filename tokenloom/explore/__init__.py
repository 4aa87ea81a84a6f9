"""`tokenloom explore`: a local page over the real scheduler (server.py, scenario.py, presets.py, index.html)."""
