"""What vLLM keeps under `vllm/v1/sample/` and code written for vLLM imports from there: the custom logits
processors' interface (logits_processor/), so that such code runs with only its import changed
(`vllm.v1.sample.logits_processor` -> `tokenloom.sample.logits_processor`).

The sampler itself is the model room's (tokenloom/model/sampler.py), which calls the processors; this room
sits below it (torch, SamplingParams), so that the engine's front end can load a processor's class and run its
`validate_params` without importing the model. Design and limits: docs/logits_processors.md.
"""
