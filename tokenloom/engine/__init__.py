"""The engine: the step loop (EngineCore), the offline LLM, the front end that detokenizes.

llm_engine.py (LLMEngine: model + scheduler + runner in this process), llm.py (LLM, vLLM's offline
API), core.py (EngineCore.step), core_proc.py + core_client.py + core_messages.py (the engine-core
process and its client), async_llm.py (AsyncLLM for the server), output_processor.py, outputs.py,
trace.py (the step trace), iteration_stats.py, args.py (CLI flags derived from tokenloom/config.py),
cli.py (`tokenloom generate | chat`).

May import: tokenloom.config, tokenloom.sampling_params, tokenloom.core, tokenloom.model. Never
server, workload, bench, sim or explore.
"""
