"""Custom logits processors, vLLM V1's (vllm/v1/sample/logits_processor/): the interface, how an engine loads
them, and the adapter that runs per-request callables as one batch-level processor.

An engine gets them from its `logits_processors` argument (LLM(logits_processors=[...]), EngineArgs, the
server's --logits-processors): classes, or "module:Class" names (Class may be dotted: "module:Outer.Inner"),
plus every class installed under the entry-point group `vllm.logits_processors`. Each engine-core process
builds its own instances (`build_logitsprocs`), and the front end loads the same classes to run their
`validate_params` on each request it takes (`validate_logits_processors_parameters`).

Refused as in vLLM, in vLLM's words: custom processors with a pooling model (STR_POOLING_REJECTS_LOGITSPROCS)
and with speculative decoding (STR_SPEC_DEC_REJECTS_LOGITSPROCS); installed entry points are then left
unloaded instead. docs/logits_processors.md says where they run in the sampler and what differs from vLLM.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import Any, TypeAlias

import torch

from tokenloom.config import STR_POOLING_REJECTS_LOGITSPROCS, STR_SPEC_DEC_REJECTS_LOGITSPROCS, ConfigError
from tokenloom.exceptions import VLLMValidationError
from tokenloom.sample.logits_processor.builtin import process_dict_updates
from tokenloom.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
    ProcessorModelConfig,
)
from tokenloom.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The entry-point group installed packages register processors under (vLLM's name: a package written for
# vLLM is found as it is).
LOGITSPROCS_GROUP = "vllm.logits_processors"

# vLLM's per-request logits processor (vllm.logits_process.LogitsProcessor): a callable of the request's output
# token ids (and, with three parameters, its prompt's first) and its logits row, returning the row.
RequestLogitsProcessor: TypeAlias = (Callable[[list[int], torch.Tensor], torch.Tensor]
                                     | Callable[[list[int], list[int], torch.Tensor], torch.Tensor])


def _load_logitsprocs_plugins() -> list[type[LogitsProcessor]]:
    """The classes installed under LOGITSPROCS_GROUP (a RuntimeError naming the one that fails to load)."""
    from importlib.metadata import entry_points  # looked up at call time: tests replace it

    installed = entry_points(group=LOGITSPROCS_GROUP)
    classes: list[type[LogitsProcessor]] = []
    for entrypoint in installed:
        logger.debug("loading logits processor entry point %s = %s", entrypoint.name, entrypoint.value)
        try:
            classes.append(entrypoint.load())
        except Exception as exc:
            raise RuntimeError(f"Failed to load LogitsProcessor plugin {entrypoint}") from exc
    return classes


def _load_logitsprocs_by_fqcns(logits_processors: Sequence[str | type[LogitsProcessor]] | None,
                               ) -> list[type[LogitsProcessor]]:  # fmt: skip
    """Classes given as classes or by fully-qualified name, "<module>:<qualname>", as classes (vLLM's rules and
    words: ValueError for a malformed name or a class that is no LogitsProcessor, RuntimeError for a module
    that does not import)."""
    classes: list[type[LogitsProcessor]] = []
    for ldx, logitproc in enumerate(logits_processors or ()):
        if isinstance(logitproc, type):
            if not issubclass(logitproc, LogitsProcessor):
                raise ValueError(f"{logitproc.__name__} is not a subclass of LogitsProcessor")
            classes.append(logitproc)
            continue
        parts = logitproc.split(":")
        if len(parts) != 2:
            raise ValueError(f"Invalid logits processor FQCN {logitproc!r}. Expected format: '<module>:<type>'")
        module_path, qualname = parts
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise RuntimeError(f"Failed to load {ldx}th LogitsProcessor plugin {logitproc}") from exc
        obj: Any = module
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
        if not isinstance(obj, type):
            raise ValueError("Loaded logit processor must be a type.")
        if not issubclass(obj, LogitsProcessor):
            raise ValueError(f"{obj.__name__} must be a subclass of LogitsProcessor")
        classes.append(obj)
    return classes


def _load_custom_logitsprocs(logits_processors: Sequence[str | type[LogitsProcessor]] | None,
                             ) -> list[type[LogitsProcessor]]:  # fmt: skip
    """The installed entry points' classes, then the ones given."""
    return _load_logitsprocs_plugins() + _load_logitsprocs_by_fqcns(logits_processors)


def build_logitsprocs(
    vllm_config: LogitsProcessorConfig,
    device: torch.device,
    is_pin_memory: bool,
    is_pooling_model: bool,
    custom_logitsprocs: Sequence[str | type[LogitsProcessor]] = (),
) -> LogitsProcessors:
    """The processors one engine runs, one instance per class (vLLM's; its built-in processors are the
    sampler's own here). Pooling models and speculative decoding refuse processors given explicitly and
    leave installed entry points unloaded."""
    if is_pooling_model:
        if custom_logitsprocs:
            raise ValueError(STR_POOLING_REJECTS_LOGITSPROCS)
        return LogitsProcessors()
    if vllm_config.speculative_config:
        if custom_logitsprocs:
            raise ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
        return LogitsProcessors()
    classes = _load_custom_logitsprocs(custom_logitsprocs)
    return LogitsProcessors(cls(vllm_config, device, is_pin_memory) for cls in classes)


cached_load_custom_logitsprocs = lru_cache(_load_custom_logitsprocs)


def validate_logits_processors_parameters(logits_processors: Sequence[str | type[LogitsProcessor]] | None,
                                          sampling_params: SamplingParams) -> None:  # fmt: skip
    """Run every custom processor's `validate_params` on a request's params; a ValueError becomes vLLM's
    VLLMValidationError (the request is refused alone: a 400 from the server)."""
    specs = tuple(logits_processors) if logits_processors is not None else None
    for cls in cached_load_custom_logitsprocs(specs):
        validate_with(cls, sampling_params)


def validate_with(cls: type[LogitsProcessor], sampling_params: SamplingParams) -> None:
    """One class's `validate_params`, its ValueError as a VLLMValidationError."""
    try:
        cls.validate_params(sampling_params)
    except VLLMValidationError:
        raise
    except ValueError as exc:
        raise VLLMValidationError(str(exc)) from exc


def fqcn(cls: type) -> str:
    """A class's "<module>:<qualname>", the name `_load_logitsprocs_by_fqcns` reads back."""
    return f"{cls.__module__}:{cls.__qualname__}"


def fqcn_for_another_process(spec: str | type[LogitsProcessor], allow_main: bool = True) -> str:
    """A processor as a name another process can load it by: a string as it is, a class by its module and
    qualified name, once checked that this name gives the class back here (ConfigError otherwise: a class
    defined inside a function, or in an interactive session's __main__, exists in this process only).
    `allow_main` False: the other process does not re-run this process's main script (a tensor-parallel
    worker is forked from `python -m tokenloom.engine.worker_forkserver`; a spawned engine process does re-run
    it), so a class of the script's own (__main__) cannot reach it either."""
    name = spec if isinstance(spec, str) else fqcn(spec)
    if not allow_main and name.startswith("__main__:"):
        raise ConfigError(f"logits_processors: {name.removeprefix('__main__:')} is defined in the script being run "
                          "(__main__), which tensor/pipeline-parallel workers do not run: they import each processor "
                          "by its module and name; define it in an importable module")
    if isinstance(spec, str):
        return spec
    module = spec.__module__
    found: Any = None
    if "<locals>" not in spec.__qualname__ and not (module == "__main__" and not _main_has_file()):
        try:
            found = _load_logitsprocs_by_fqcns([name])[0]
        except (ValueError, RuntimeError, AttributeError):
            found = None
    if found is not spec:
        raise ConfigError(
            f"logits_processors: {spec.__qualname__} cannot reach the engine processes, which start fresh "
            "interpreters and import each processor by its module and name: define the class at the top level of "
            "an importable module and pass it (or 'module:Class')")
    return name


def _main_has_file() -> bool:
    import sys

    return getattr(sys.modules.get("__main__"), "__file__", None) is not None


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs a per-request logits processor (vLLM's RequestLogitsProcessor, a callable) on each request's row.

    Subclass it, implement `is_argmax_invariant()` and `new_req_logits_processor(params)` (the callable for a
    request, or None to leave it alone). An overridden `__init__` must call
    `super().__init__(vllm_config, device, is_pin_memory)`."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # Row -> the request's callable with its token lists bound: the output list is the engine's own, so
        # the callable always sees the tokens so far.
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The per-request processor for a request with these params, or None if it needs none."""
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> partial[torch.Tensor] | None:  # fmt: skip
        req_lp = self.new_req_logits_processor(params)
        if not req_lp:
            return None
        if len(inspect.signature(req_lp).parameters) == 3:
            if prompt_ids is None:
                raise ValueError("Prompt token ids are required for this logits processor but were not provided.")
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for req_idx, req_lp in self.req_info.items():
            row = logits[req_idx]
            new_row = req_lp(row)
            if new_row is not row:  # a callable may return a new tensor rather than change the row
                logits[req_idx] = new_row
        return logits


def processor_names(processors: LogitsProcessors) -> list[str]:
    """The classes of an engine's processors by name (what its front end loads to validate requests)."""
    return list(dict.fromkeys(fqcn(type(p)) for p in processors.all))


__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LOGITSPROCS_GROUP",
    "LogitsProcessor",
    "LogitsProcessorConfig",
    "LogitsProcessors",
    "MoveDirectionality",
    "ProcessorModelConfig",
    "RequestLogitsProcessor",
    "STR_POOLING_REJECTS_LOGITSPROCS",
    "STR_SPEC_DEC_REJECTS_LOGITSPROCS",
    "build_logitsprocs",
    "process_dict_updates",
    "validate_logits_processors_parameters",
]
