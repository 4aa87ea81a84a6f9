"""The engine: the step loop (EngineCore), the offline LLM, the front end that detokenizes.

core_host.py (EngineCoreHost: an engine core built from an EngineConfig: model, KV cache, scheduler),
llm_engine.py (LLMEngine: an EngineCoreHost stepped in this process, with the text side), llm.py (LLM,
vLLM's offline API, over LLMEngine or dp_llm.py's DataParallelLLMEngine), core.py (EngineCore.step),
core_proc.py + core_client.py + dp_client.py + core_messages.py (the engine-core processes and the
EngineCoreClient that make_client picks for them), async_llm.py (AsyncLLM for the server),
input_processor.py (tokenize and check a prompt, for every front end), output_processor.py, outputs.py,
trace.py (the step trace), iteration_stats.py, args.py (CLI flags derived from tokenloom/config.py),
cli.py (`tokenloom generate | chat`).

May import: tokenloom.config, tokenloom.sampling_params, tokenloom.core, tokenloom.model. Never
server, workload, bench, sim or explore.
"""
