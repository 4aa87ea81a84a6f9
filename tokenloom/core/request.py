"""Request: one ledger per request, no phase field.

`num_computed_tokens` chases `num_tokens_with_spec` (prompt + outputs + draft tokens). Prefill,
chunked prefill, decode, recompute after preemption and prefix-cache hits are all just "how far
behind is this request".
"""

from __future__ import annotations

import enum
from typing import Any

# hash_block_tokens: re-exported (the router and tests import it from here, beside the Request that uses it).
from tokenloom.core.block_hash import DEFAULT_HASH_ALGO, BlockHash, hash_block_tokens
from tokenloom.core.structured_output import StructuredOutputRequest
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """vLLM's RequestStatus, by its names (those of vLLM-only features left out: streaming-input requests'
    WAITING_FOR_STREAMING_REQ, FINISHED_IGNORED for prompts tokenloom refuses before they are added)."""

    WAITING = enum.auto()
    # Waiting for its grammar to compile: skipped by admission until ready. WAITING_FOR_FSM is vLLM's
    # earlier name, kept as an alias.
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_FSM = WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    # Holds its blocks while a KV connector loads them in the background (vLLM's WAITING_FOR_REMOTE_KVS):
    # skipped by admission until the worker side reports the load finished (core/scheduler.py).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    # The output repeated itself as the request's repetition_detection says (tokenloom/core/repetition.py).
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:  # vLLM's: the name, where an IntEnum would print its number
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASON.get(status)


_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",
}


def lora_extra_hash_keys(lora_request: Any) -> tuple[int, ...] | None:
    """vLLM's `_gen_lora_extra_hash_keys`: a block computed under an adapter is keyed by the adapter's
    id, so prefix caching never shares KV between adapters (nor with the base model). The id, not the
    name: an adapter unloaded and loaded again under its name gets a new id (the server's counter, as
    vLLM's), so blocks of its old weights are never hit."""
    return (lora_request.lora_int_id,) if lora_request is not None else None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        block_size: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """`reasoning_ended` / `reasoning_parser_kwargs` (vLLM's, for a constrained request on an engine with a
        reasoning parser): whether the prompt already ended the reasoning (None: the engine's parser decides),
        and what the request's parser is built with (its chat_template_kwargs)."""
        self.request_id = request_id
        # The LoRA adapter (tokenloom.lora.request.LoRARequest; duck-typed here: the core imports no
        # model code): the scheduler's max_loras limit reads lora_int_id, block hashes lora_name.
        self.lora_request = lora_request
        self.prompt_token_ids = list(prompt_token_ids)
        # A pooling request (vLLM's Request.pooling_params): prefill only, it finishes when its prompt
        # is computed and pooled; it samples nothing (its SamplingParams are the defaults, max_tokens 1).
        self.pooling_params = pooling_params
        if pooling_params is not None and sampling_params is None:
            sampling_params = SamplingParams(max_tokens=1)
        self.sampling_params = sampling_params or SamplingParams()
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = self.sampling_params.effective_max_tokens
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Draft tokens proposed for verification in the next step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Tokens whose sampling is in flight under async scheduling (see docs/scheduler.md).
        self.num_output_placeholders = 0
        # True while the last scheduled chunk stopped short of the sequence (vLLM's flag, set at
        # schedule time): such a step samples nothing and its drafts are dropped.
        self.is_prefill_chunk = False
        # Speculative decoding figures: verified drafts, draft tokens, accepted tokens.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Async scheduling: tokens scheduled whose step output has not been processed yet, and how
        # many of them belong to steps scheduled before a preemption (their output is stale: it is
        # appended but must not touch the counters the preemption reset). vLLM's names.
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        # The stale output is dropped, not delivered (vLLM's drop_stale_output): set when the request was
        # preempted to resume at once (reset_prefix_cache), whose resumed steps resample those positions.
        self.drop_stale_output = False

        self.num_computed_tokens = 0
        # Prefix-cache hit in tokens at first admission; -1 until then (vLLM's convention).
        self.num_cached_tokens = -1
        # vLLM's kv_transfer_params: what a KV connector returns for the request when it finishes
        # (request_finished), for the response; None without a connector.
        self.kv_transfer_params: dict | None = (self.sampling_params.extra_args or {}).get("kv_transfer_params")
        # Prompt tokens this request wrote to the prefix cache (vLLM's PrefillStats.num_cache_creation_tokens):
        # set once, at its first output; None until then.
        self.num_cache_creation_tokens: int | None = None
        self.num_preemptions = 0

        # Full-block hashes of all_token_ids, extended as tokens are appended.
        self.block_size = block_size
        # The engine's prefix_caching_hash_algo (set with the block size by the scheduler).
        self.hash_algo = DEFAULT_HASH_ALGO
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

        # Timestamps for per-request metrics, stamped by the scheduler's clock.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.error: str | None = None
        # The grammar of a constrained request (structured outputs, forced tool calls); None otherwise.
        so = self.sampling_params.structured_outputs
        self.structured_output_request = (
            StructuredOutputRequest(so.key, reasoning_ended=reasoning_ended,
                                    reasoning_parser_kwargs=reasoning_parser_kwargs) if so is not None else None)
        # Free-form slot for the front end (e.g. the detokenizer state).
        self.extra: dict[str, Any] = {}

    # The ledger ---------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def set_block_size(self, block_size: int, hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        """Hash the full blocks at the scheduler's block size and with its prefix_caching_hash_algo (a request
        may be built without either)."""
        if block_size != self.block_size or hash_algo != self.hash_algo:
            self.block_size = block_size
            self.hash_algo = hash_algo
            self.block_hashes = []
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if not self.block_size:
            return
        bs = self.block_size
        n_full = len(self._all_token_ids) // bs
        parent = self.block_hashes[-1] if self.block_hashes else None
        extra = lora_extra_hash_keys(self.lora_request)
        for i in range(len(self.block_hashes), n_full):
            parent = hash_block_tokens(parent, tuple(self._all_token_ids[i * bs : (i + 1) * bs]), extra,
                                       self.hash_algo)
            self.block_hashes.append(parent)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    # Status -------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    @property
    def is_prefill(self) -> bool:
        """Derived, never stored: the request still has more than the last sampled token to compute."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens_with_spec}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens})"
        )
