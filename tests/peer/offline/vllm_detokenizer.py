# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for the vLLM classes its detokenizer tests (tests/detokenizer) drive directly:
`vllm.v1.engine.EngineCoreRequest` and `vllm.v1.engine.detokenizer`'s BaseIncrementalDetokenizer /
FastIncrementalDetokenizer, over tokenloom's equivalent, the OutputProcessor (tokenloom/engine/output_processor.py):
it detokenizes a request's tokens and applies its stop strings, min_tokens and include_stop_str_in_output, as
vLLM's detokenizer does. Plumbing only: `update()` hands the tokens to the OutputProcessor as one engine-core
output (one step), and every figure the tests read comes back from the RequestOutput it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.engine.output_processor import OutputProcessor
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
    output so far. A subclass's `decode_next(id)` gives each token's text, unless a tokenizer is given."""

    def __init__(self, request: EngineCoreRequest, tokenizer: Any = None) -> None:
        assert request.sampling_params is not None
        # CUMULATIVE: every step's RequestOutput carries the whole text and token ids so far.
        params = replace(request.sampling_params, output_kind=RequestOutputKind.CUMULATIVE)
        prompt = list(request.prompt_token_ids or [])
        self._request_id = request.request_id or "request"
        self._processor = OutputProcessor(tokenizer if tokenizer is not None else _DecodeNextTokenizer(self))
        core = Request(self._request_id, prompt, params, arrival_time=request.arrival_time)
        self._processor.add_request(self._request_id, None, prompt, [core], request.arrival_time)
        self.output_text = ""
        self.output_token_ids: list[int] = []

    def decode_next(self, next_token_id: int) -> str:
        raise NotImplementedError

    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        if not new_token_ids:
            return None
        # stop_terminated: the engine core ended the request at its last token (EOS or a stop token id).
        out = EngineCoreOutput(self._request_id, list(new_token_ids), finish_reason="stop" if stop_terminated else None)
        results, _ = self._processor.process_outputs([out])
        if not results:
            return None
        completion = results[0].outputs[0]
        self.output_text, self.output_token_ids = completion.text, list(completion.token_ids)
        stop = completion.stop_reason
        return stop if isinstance(stop, str) else None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        if not finished or delta:
            raise NotImplementedError("the stand-in reads only the finished output's whole text")
        return self.output_text


class FastIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """vLLM's detokenizer over a Hugging Face tokenizer: tokenloom's IncrementalDetokenizer over the same one."""

    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        super().__init__(request, tokenizer=tokenizer)
