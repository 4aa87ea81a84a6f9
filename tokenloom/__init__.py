"""tokenloom: iteration-level scheduling for LLM inference."""
