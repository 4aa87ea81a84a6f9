"""Parallel sampling (`n > 1`): one user request fans out into n core requests and their outputs fan back in
(vLLM's v1/engine/parallel_sampling.py). The offline LLMEngine and the server's AsyncLLM both use it.

`ParentRequest` is vLLM's object of that name: it names the children and gives each its parameters
(`get_child_info`), and decides what each child's new CompletionOutput makes the user see (`get_outputs`):
streamed (DELTA / CUMULATIVE), that child's output alone, a finished child never again, and `finished` with
the output that finishes the last child; FINAL_ONLY, nothing until every child is done, then all n at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenloom.core.request import Request
from tokenloom.engine.outputs import CompletionOutput
from tokenloom.sampling_params import RequestOutputKind, SamplingParams


def child_seed(seed: int, index: int) -> int:
    """vLLM's seed + index, wrapped into the 64-bit range a seed must stay in: a parent seeded near 2**63 - 1 (a
    seed the API accepts) would otherwise give its children seeds SamplingParams refuses, and the valid request a
    400 (vLLM's children take seed + index unchecked; the draws differ from vLLM's anyway, CPU against CUDA)."""
    return (seed + index + 2**63) % 2**64 - 2**63


class ParentRequest:
    """One n > 1 request's children: their ids and parameters, and the fan-in of their outputs."""

    def __init__(self, request_id: str, sampling_params: SamplingParams, external_req_id: str | None = None) -> None:
        """`request_id`: the id the children's ids derive from; `external_req_id`: the one the user's outputs
        carry (vLLM's; tokenloom's front ends use the same id for both)."""
        self.request_id = request_id
        self.external_req_id = external_req_id if external_req_id is not None else request_id
        self.sampling_params = sampling_params
        # Children not finished yet (or finished in the output being handed out now).
        self.child_requests: set[str] = set()
        # FINAL_ONLY: each child's final output, by index, until all n are there.
        self.output_aggregator: list[CompletionOutput | None] = (
            [None] * sampling_params.n if sampling_params.output_kind is RequestOutputKind.FINAL_ONLY else [])

    @classmethod
    def of_children(cls, request_id: str, output_kind: RequestOutputKind, child_ids: list[str]) -> ParentRequest:
        """The parent of children already made (fan_out's core requests), for the fan-in of their outputs."""
        parent = cls(request_id, SamplingParams(n=len(child_ids), output_kind=output_kind))
        parent.child_requests = set(child_ids)
        return parent

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id (`{index}_{request_id}`, vLLM's) and parameters of child `index`, which is now tracked. Each
        child samples once (n=1) with its own seed (seed + index: the n completions differ but repeat run to run);
        each has its own copy, as the engine writes per-request fields (EOS ids) into them."""
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        seed = self.sampling_params.seed
        return child_id, replace(self.sampling_params, n=1, seed=None if seed is None else child_seed(seed, index))

    def get_outputs(self, child_request_id: str,
                    completion_output: CompletionOutput) -> tuple[list[CompletionOutput], bool]:  # fmt: skip
        """What the user sees of a child's new output, and whether the request is finished with it."""
        already_returned = False  # a finished child that came back: its final output was handed out before
        if completion_output.finished():
            if child_request_id in self.child_requests:
                self.child_requests.remove(child_request_id)
            else:
                already_returned = True
        if self.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY:
            outputs = [] if already_returned else [completion_output]
        else:
            self.output_aggregator[completion_output.index] = completion_output
            outputs = [] if self.child_requests else [o for o in self.output_aggregator if o is not None]
        return outputs, not self.child_requests


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
            arrival_time: float, priority: int = 0, lora_request: Any = None, *, reasoning_ended: bool | None = None,
            reasoning_parser_kwargs: dict[str, Any] | None = None) -> list[Request]:  # fmt: skip
    """The n core requests of one user request (one, under the user's id, for n == 1), each with the model's EOS
    token and its own reasoning gate (reasoning_ended, reasoning_parser_kwargs: see Request)."""
    if params.n == 1:
        children = [(request_id, replace(params))]
    else:
        parent = ParentRequest(request_id, params)
        children = [parent.get_child_info(i) for i in range(params.n)]
    cores = []
    for core_id, child in children:
        child.eos_token_id = eos_token_id
        cores.append(Request(core_id, prompt_token_ids, child, arrival_time=arrival_time, priority=priority,
                             lora_request=lora_request, reasoning_ended=reasoning_ended,
                             reasoning_parser_kwargs=reasoning_parser_kwargs))
    return cores
