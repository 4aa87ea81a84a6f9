"""Multi-LoRA serving (vLLM's `vllm/lora/`): many PEFT adapters over one base model, mixed in one batch.

    request.py      LoRARequest (vLLM's fields and positional order); torch-free, the engine and the
                    scheduler's requests carry it
    peft_loader.py  a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) read
                    and checked against the base model's linears
    punica.py       the per-step mapping of token rows to adapter slots, and the LoRA product for a
                    flattened batch: rows grouped by adapter, shrink (x @ A^T) then expand (@ B^T)
    models.py       LoRAModelManager: the adapters cached on the host (`max_cpu_loras`) and the ones
                    active in slots (`max_loras`), LRU both; attaches a LoRALinear to each target linear

The room sits between the scheduler core and the model: the model room (tokenloom/model) imports it to
hook its linears; nothing here imports the model. Design and limits: docs/lora.md.
"""
