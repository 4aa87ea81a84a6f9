"""The OpenAI-compatible HTTP server (`tokenloom serve`): FastAPI + uvicorn over AsyncLLM.

May import: tokenloom.config, tokenloom.sampling_params, tokenloom.core, tokenloom.model,
tokenloom.engine. Never workload, bench, sim or explore.
"""
