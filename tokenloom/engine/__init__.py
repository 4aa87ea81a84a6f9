"""The engine: the step loop (EngineCore), the offline LLM, the front end that detokenizes."""
