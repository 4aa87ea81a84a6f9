"""LoRARequest: which adapter a request runs with (vLLM's `vllm/lora/request.py`).

Torch-free: the front end builds it, it crosses the pipe to the engine-core process inside an
EngineCoreRequest, and the scheduler reads `lora_int_id` (the max_loras limit) and `lora_name` (the
prefix-cache key) from it without importing anything of the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """vLLM's fields, in its positional order: `LoRARequest("sql", 1, "/adapters/sql")`.

    lora_name: the adapter's served name (the server's `model` field picks it);
    lora_int_id: a unique id >= 1 (0 is the base model in vLLM's slot mapping);
    lora_path: the PEFT adapter directory;
    base_model_name: the model the adapter was trained on, as the server lists it (`parent`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's directory")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    # As vLLM: two requests for the same name are the same adapter.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
