"""The models a server answers to (vLLM's `serving_models.py`): the base model's names and its LoRA adapters.

`--lora-modules name=path` (or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`)
registers adapters at start-up; with VLLM_ALLOW_RUNTIME_LORA_UPDATING set, POST /v1/load_lora_adapter
and /v1/unload_lora_adapter add and remove them while the server runs (`load_inplace: true` replaces an
adapter under its name, as vLLM's). A request whose `model` names an adapter runs with it; /v1/models
lists each adapter with its `parent` (the base model). Refusals are vLLM 0.32's, in its words: a path
with no adapter is its 404 ("Loading lora X failed: No adapter found for P"); an adapter that cannot run
here is a 400 saying why (vLLM answers those with a 500).

Each adapter is read and checked against the base model here, when it is registered (its rank, targets
and shapes: tokenloom/lora/peft_loader.py, with the limits the engine reported), so a bad one is a 400
at load time, not a failed request later. Every (re)load gets a fresh lora_int_id, as vLLM's counter:
the prefix cache keys blocks by that id, so an adapter reloaded under its name never hits blocks of
its old weights (vLLM keeps the id of an adapter loaded in place, and warns that its old blocks may be
reused).
"""

from __future__ import annotations

import itertools
from typing import Any

from tokenloom.lora.request import LoRARequest
from tokenloom.server.errors import APIError
from tokenloom.server.lora_modules import LoRAModulePath


class ServingModels:
    """The base model names and the LoRA adapters served. `lora_info`: EngineReady.lora (None: the
    engine runs without --enable-lora, and any adapter is refused)."""

    def __init__(self, base_model_names: list[str], lora_info: dict[str, Any] | None,
                 lora_modules: list[LoRAModulePath] | None = None) -> None:
        self.base_model_names = base_model_names
        self.lora_info = lora_info
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        if lora_modules and lora_info is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in lora_modules or []:
            try:
                self.load_lora_adapter(module.name, module.path, module.base_model_name)
            except APIError as exc:
                raise ValueError(f"--lora-modules {module.name}: {exc.message}") from None

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, or None for the base model."""
        return self.lora_requests.get(model) if model is not None else None

    def is_served(self, model: str) -> bool:
        return model in self.base_model_names or model in self.lora_requests

    def load_lora_adapter(self, name: str, path: str, base_model_name: str | None = None,
                          load_inplace: bool = False) -> LoRARequest:
        """Check the adapter and serve it under `name` (`load_inplace`: in place of the adapter of that name,
        if there is one); APIError 404 when there is no adapter at `path`, 400 saying why it cannot be."""
        from tokenloom.lora.peft_loader import LoRAError, LoRANotFoundError, load_peft_adapter

        if self.lora_info is None:
            raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)", "lora_name")
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in self.base_model_names:
            raise APIError(400, f"The lora adapter '{name}' conflicts with a served base model.", "lora_name")
        if name in self.lora_requests and not load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                           "adapter in place, set 'load_inplace' to True.", "lora_name")
        lora_id = next(self._ids)
        try:
            load_peft_adapter(path, lora_id, name, num_layers=self.lora_info["num_layers"],
                              target_shapes={k: tuple(v) for k, v in self.lora_info["target_shapes"].items()},
                              max_lora_rank=self.lora_info["max_lora_rank"])
        except LoRANotFoundError:
            raise APIError(404, f"Loading lora {name} failed: No adapter found for {path}", "lora_path") from None
        except LoRAError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        request = LoRARequest(name, lora_id, path, base_model_name or self.base_model_names[0])
        self.lora_requests[name] = request
        return request

    def unload_lora_adapter(self, name: str) -> LoRARequest:
        if name not in self.lora_requests:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return self.lora_requests.pop(name)
