# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for the vLLM classes its detokenizer tests (tests/detokenizer) drive directly:
`vllm.v1.engine.EngineCoreRequest` and `vllm.v1.engine.detokenizer`'s BaseIncrementalDetokenizer /
FastIncrementalDetokenizer, over tokenloom's equivalent, the OutputProcessor (tokenloom/engine/output_processor.py):
it detokenizes a request's tokens and applies its stop strings, min_tokens and include_stop_str_in_output, as
vLLM's detokenizer does. Plumbing only: `update()` hands the tokens to the OutputProcessor as one engine-core
output (one step); the figures the tests read are the OutputProcessor's state for the request (vLLM's
detokenizer state) and the RequestOutput it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.outputs import CompletionOutput
from tokenloom.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class EngineCoreRequest:
    """vLLM's engine-core request, the fields the detokenizer tests pass."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: Any
    sampling_params: SamplingParams | None
    pooling_params: Any
    arrival_time: float
    lora_request: Any
    cache_salt: str | None
    data_parallel_rank: int | None
    external_req_id: str | None = None


class _DecodeNextTokenizer:
    """A tokenizer whose text for some ids is the concatenation of a detokenizer's decode_next for each (the
    tests' dummy detokenizers map every id to a fixed string)."""

    def __init__(self, detokenizer: BaseIncrementalDetokenizer) -> None:
        self._detokenizer = detokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self._detokenizer.decode_next(i) for i in ids)


class BaseIncrementalDetokenizer:
    """vLLM's BaseIncrementalDetokenizer: `update(new_token_ids, stop_terminated)` folds one step's tokens in
    and returns the stop string that ended the output, if any; `output_text` / `output_token_ids` are the
    output so far (the OutputProcessor's own, before any text is held back for streaming), and
    `get_next_output_text` the text a RequestOutput shows. A subclass's `decode_next(id)` gives each token's
    text, unless a tokenizer is given."""

    def __init__(self, request: EngineCoreRequest, tokenizer: Any = None) -> None:
        assert request.sampling_params is not None
        # CUMULATIVE: every step's RequestOutput carries the whole text so far (less a held-back tail).
        params = replace(request.sampling_params, output_kind=RequestOutputKind.CUMULATIVE)
        prompt = list(request.prompt_token_ids or [])
        self._request_id = request.request_id or "request"
        self._processor = OutputProcessor(tokenizer if tokenizer is not None else _DecodeNextTokenizer(self))
        core = Request(self._request_id, prompt, params, arrival_time=request.arrival_time)
        self._processor.add_request(self._request_id, None, prompt, [core], request.arrival_time)
        # The request's state in the OutputProcessor: what vLLM's detokenizer holds as its own.
        _, self._completion = self._processor._by_core_id[self._request_id]
        self._last_output: CompletionOutput | None = None

    @property
    def output_text(self) -> str:
        return self._completion.text

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._completion.token_ids)

    def decode_next(self, next_token_id: int) -> str:
        raise NotImplementedError

    def num_output_tokens(self) -> int:
        return len(self._completion.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        if not new_token_ids:
            return None
        # stop_terminated: the engine core ended the request at its last token (EOS or a stop token id).
        out = EngineCoreOutput(self._request_id, list(new_token_ids), finish_reason="stop" if stop_terminated else None)
        results, _ = self._processor.process_outputs([out])
        if not results:
            return None
        self._last_output = results[0].outputs[0]
        stop = self._last_output.stop_reason
        return stop if isinstance(stop, str) else None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        last = self._last_output
        if delta or last is None or finished != last.finished():
            raise NotImplementedError("the stand-in reads the whole text of the last RequestOutput only")
        return last.text


class FastIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """vLLM's detokenizer over a Hugging Face tokenizer: tokenloom's IncrementalDetokenizer over the same one."""

    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        super().__init__(request, tokenizer=tokenizer)
