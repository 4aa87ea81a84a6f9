"""The engine: the step loop (EngineCore), the offline LLM, the front end that detokenizes.

core_host.py (EngineCoreHost: an engine core built from an EngineConfig: model, KV cache, scheduler),
llm_engine.py (LLMEngine: the text side over a client it steps), llm.py (LLM, vLLM's offline API, over
LLMEngine), core.py (EngineCore.step), core_client.py (the client protocols; MPClient) + inproc_client.py
(InprocClient: the core in this process) + sync_mp_client.py (SyncMPClient: engine processes, stepped) +
dp_client.py + core_proc.py + core_messages.py + request_mirrors.py (the engine-core processes), clients.py
(make_client: which client a front end gets), async_llm.py (AsyncLLM for the server),
input_processor.py (tokenize and check a prompt, for every front end), output_processor.py, outputs.py,
trace.py (the step trace), iteration_stats.py, stat_logging.py (the server's periodic stats line), args.py
(CLI flags derived from tokenloom/config.py), cli.py (`tokenloom generate | chat`).

May import: tokenloom.config, tokenloom.sampling_params, tokenloom.core, tokenloom.model. Never
server, workload, bench, sim or explore.
"""
