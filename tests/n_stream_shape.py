"""Checks of vLLM 0.32's streamed shape for n > 1 (ParentRequest.get_outputs), shared by the LLMEngine.step and
AsyncLLM.generate tests: each streamed output carries only children that progressed, a finished child is never
sent again, `finished` is True on the last output only; FINAL_ONLY is one output holding all n."""

from __future__ import annotations

from tests.tiny_models import TINY_VOCAB
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

N = 4


def staggered_params(kind: RequestOutputKind) -> SamplingParams:
    """n=4 children that stop at different steps: a quarter of the vocabulary stops them (seeded)."""
    return SamplingParams(n=N, temperature=1.0, seed=21, max_tokens=10, logprobs=1, output_kind=kind,
                          stop_token_ids=list(range(3, TINY_VOCAB // 4)))


def check_streamed(outs: list, kind: RequestOutputKind, one_child_each: bool) -> dict[int, list[int]]:
    """Assert the shape; return each child's token ids (concatenated deltas, or the last cumulative)."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    done: set[int] = set()
    tokens: dict[int, list[int]] = {}
    for out in outs:
        indexes = [c.index for c in out.outputs]
        assert indexes and len(set(indexes)) == len(indexes)
        assert not one_child_each or len(indexes) == 1, indexes
        for comp in out.outputs:
            assert comp.index not in done, f"child {comp.index} sent again after it finished"
            if kind is RequestOutputKind.DELTA:
                tokens.setdefault(comp.index, []).extend(comp.token_ids)
                assert comp.delta_token_ids == comp.token_ids
            else:
                assert comp.token_ids[: len(tokens.get(comp.index, []))] == tokens.get(comp.index, [])
                tokens[comp.index] = list(comp.token_ids)
            if comp.finish_reason is not None:
                done.add(comp.index)
    assert done == set(range(N))
    return tokens


def check_final_only(outs: list) -> dict[int, list[int]]:
    assert len(outs) == 1 and outs[0].finished
    assert [c.index for c in outs[0].outputs] == list(range(N))
    assert all(c.finish_reason is not None for c in outs[0].outputs)
    return {c.index: list(c.token_ids) for c in outs[0].outputs}


def check_staggered(finals: dict[int, list[int]]) -> None:
    """The seeded children really end at different lengths (else the test would not see an early finisher)."""
    assert len({len(t) for t in finals.values()}) > 1, finals
