"""The OpenAI-compatible HTTP server (`tokenloom serve`): FastAPI + uvicorn over AsyncLLM."""
