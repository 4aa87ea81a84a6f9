"""Custom logits processors (vLLM V1's, tokenloom/sample/logits_processor; docs/logits_processors.md): the
persistent batch's rows and BatchUpdates as vLLM's InputBatch makes them, where the sampler runs them relative to
its built-in steps, and end to end on a tiny model: a processor changes only the requests that ask for it, across
rows added, removed and moved, chunked prompts and preemption, with async scheduling, a grammar in the batch,
two data-parallel engines, two tensor-parallel ranks and the server's --logits-processors; the refusals in vLLM's
words. vLLM's own tests are vendored in tests/peer/offline/test_vllm_custom_logitsprocs.py."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams
from tokenloom.config import ConfigError
from tokenloom.exceptions import VLLMValidationError
from tokenloom.model.input_batch import InputBatch
from tokenloom.model.sampler import BatchProcessors, Sampler, SamplingRow
from tokenloom.sample.logits_processor import (
    STR_POOLING_REJECTS_LOGITSPROCS,
    STR_SPEC_DEC_REJECTS_LOGITSPROCS,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    fqcn_for_another_process,
    process_dict_updates,
)
from tokenloom.sampling_params import StructuredOutputsParams

UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
FQCN = "tests.test_logits_processors:CountingForce"


class CountingForce(LogitsProcessor):
    """A request with extra_args {"base": b} must sample b, b + 1, b + 2, ...: the token b + (its outputs so far).
    A request in the wrong row gets another's tokens, one whose output list is not the engine's live list repeats
    a token, and one whose processor state follows the wrong row forces a request that did not ask."""

    instances: list[CountingForce] = []  # the ones built in this process (an in-process engine's)

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.vllm_config = vllm_config
        self.rows: dict[int, tuple[int, list[int]]] = {}
        self.updates: list[BatchUpdate] = []
        self.zero_rows = 0  # rows of requests that sample nothing in the step (a prompt's earlier chunks)
        CountingForce.instances.append(self)

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        base = (params.extra_args or {}).get("base")
        if base is not None and (isinstance(base, bool) or not isinstance(base, int)):
            raise ValueError(f"base must be an integer, got {base!r}")  # a plain ValueError: vLLM converts it

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self.updates.append(batch_update)
        process_dict_updates(self.rows, batch_update, lambda params, _, outputs: (
            (params.extra_args["base"], outputs) if (params.extra_args or {}).get("base") is not None else None))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.zero_rows += int((logits == 0).all(dim=1).sum())
        for row, (base, outputs) in self.rows.items():
            logits[row] = float("-inf")
            logits[row, base + len(outputs)] = 0.0
        return logits


class InvariantForce(LogitsProcessor):
    """Says it never changes the argmax (as vLLM's min_p processor) but forces extra_args["target"]: vLLM runs
    such a processor only when some request samples randomly, after temperature, and greedy requests keep the
    argmax taken before it."""

    calls = 0

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update, lambda p, _, __: (p.extra_args or {}).get("target"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        InvariantForce.calls += 1
        for row, target in self.targets.items():
            logits[row] = float("-inf")
            logits[row, target] = 0.0
        return logits


class Recorder(LogitsProcessor):
    """Keeps a copy of every logits tensor it is given."""

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant
        self.seen: list[torch.Tensor] = []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(logits.clone())
        if self.invariant:  # force token 5 everywhere: only the random rows may take it
            logits[:] = float("-inf")
            logits[:, 5] = 0.0
        return logits


# ------------------------------------------------------------------------------ the persistent batch


def _state(req_id: str, outputs: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, params=SamplingParams(), token_ids=[1, 2, 3] + list(outputs or []),
                           num_prompt_tokens=3, output_token_ids=outputs if outputs is not None else [])


def _view(update: BatchUpdate | None):
    if update is None:
        return None
    return (update.batch_size, list(update.removed), [(a[0], a[2]) for a in update.added], list(update.moved))


def test_batch_updates_follow_vllms_input_batch() -> None:
    """Rows as vLLM's InputBatch gives them: an added request takes the lowest free row, a removed row nobody
    refills is reported and the last rows slide down into it (condense), no change gives None, a request whose
    state was replaced (preempted and resumed) is removed and added again with its new output list."""
    rec = Recorder()
    batch = InputBatch(LogitsProcessors([rec]))
    got: list = []
    rec.update_state = lambda u: got.append(_view(u))  # type: ignore[method-assign]
    a, b, c, d = (_state(x) for x in "abcd")
    batch.update([], [a, b, c], ["a", "b", "c"])
    batch.update(["b"], [a, c, d], ["d", "a", "c"])  # b finished: d takes its row
    batch.update([], [d], ["d"])  # a and c unscheduled: d moves down from row 1 to row 0
    batch.update([], [d], ["d"])
    d2 = _state("d", [7, 8])  # d preempted and resumed: a new state with the outputs it had
    batch.update([], [d2], ["d"])
    assert got == [
        (3, [], [(0, [1, 2, 3]), (1, [1, 2, 3]), (2, [1, 2, 3])], []),
        (3, [], [(1, [1, 2, 3])], []),
        (1, [2], [], [(1, 0, UNI)]),
        None,
        (1, [], [(0, [1, 2, 3])], []),
    ]
    assert batch.req_ids == ["d"] and batch.output_list("d") is d2.output_token_ids
    batch.remove_all()  # a fresh scheduler: the next step reports the row empty
    batch.update([], [], [])
    assert got[-1] == (0, [0], [], [])


def test_process_dict_updates_follows_adds_removes_moves_and_swaps() -> None:
    state: dict[int, str] = {0: "x", 2: "z"}
    params = SamplingParams(extra_args={"v": "y"})
    update = BatchUpdate(batch_size=3, removed=[0], added=[(1, params, None, [])],
                         moved=[(2, 0, UNI), (1, 2, SWAP)])
    assert process_dict_updates(state, update, lambda p, _, __: p.extra_args["v"])
    assert state == {0: "z", 2: "y"}
    assert not process_dict_updates(state, None, lambda *_: None)
    # An added request that wants no entry clears what the row's previous request left.
    assert process_dict_updates(state, BatchUpdate(3, [], [(0, SamplingParams(), None, [])], []), lambda *_: None)
    assert state == {2: "y"}


# ------------------------------------------------------------------------------ the sampler's order


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), token_ids=[1, 2, 3], num_prompt_tokens=2)


def test_non_argmax_invariant_processors_run_after_logit_bias_and_min_tokens_before_penalties() -> None:
    rec = Recorder()
    logits = torch.arange(8, dtype=torch.float32).repeat(2, 1) + 1.0
    rows = [_row(temperature=0.0, logit_bias={0: 50.0}, repetition_penalty=2.0),
            _row(temperature=0.0, min_tokens=5, stop_token_ids=[7])]
    out = Sampler()(logits.clone(), rows, processors=BatchProcessors([], [rec], batch_size=2))
    seen = rec.seen[0]
    assert seen[0, 0] == 51.0 and seen[0, 3] == 4.0  # biased, not yet penalized (token 3 was output)
    assert seen[1, 7] == float("-inf")  # min_tokens' stop token masked first
    assert out.token_ids == [0, 6]


def test_argmax_invariant_processors_run_after_temperature_and_only_with_random_rows() -> None:
    rec = Recorder(invariant=True)
    logits = torch.arange(8, dtype=torch.float32).repeat(2, 1)
    procs = BatchProcessors([rec], [], batch_size=2)
    assert Sampler()(logits.clone(), [_row(temperature=0.0), _row(temperature=0.0)], processors=procs).token_ids \
        == [7, 7]
    assert rec.seen == []  # all greedy: never called (vLLM's rule)
    out = Sampler()(logits.clone(), [_row(temperature=0.0), _row(temperature=2.0, seed=1)], processors=procs)
    assert out.token_ids == [7, 5]  # the greedy row keeps the argmax taken before the processor
    assert torch.equal(rec.seen[0][0], logits[0]) and torch.allclose(rec.seen[0][1], logits[1] / 2.0)


def test_processors_see_the_whole_batch_with_zero_rows_for_requests_that_sample_nothing() -> None:
    rec = Recorder()
    logits = torch.arange(16, dtype=torch.float32).view(2, 8)
    Sampler()(logits.clone(), [_row(temperature=0.0), _row(temperature=0.0)],
              processors=BatchProcessors([], [rec], batch_size=3, rows=torch.tensor([2, 0])))
    seen = rec.seen[0]
    assert torch.equal(seen[2], logits[0]) and torch.equal(seen[0], logits[1]) and not seen[1].any()


# ------------------------------------------------------------------------------ end to end, tiny model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


KW = dict(dtype="float32", block_size=4, enable_prefix_caching=False)
# A small budget chunks the prompts, a small pool preempts: rows come and go, move down, and come back.
BUSY = dict(KW, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)


def _mixed(n: int = 8) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of growing length, every other one forced from its own base; different lengths, so requests
    finish at different steps; one unforced request samples randomly (seeded)."""
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(12 + 3 * i)]} for i in range(n)]
    params = [SamplingParams(temperature=0.8 if i == 3 else 0.0, seed=11 if i == 3 else None, max_tokens=6 + 2 * i,
                             ignore_eos=True, extra_args={"base": 20 * i} if i % 2 == 0 else None)
              for i in range(n)]  # fmt: skip
    return prompts, params


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_forced(got: list[list[int]], want: list[list[int]], params: list[SamplingParams]) -> None:
    for tokens, ref, p in zip(got, want, params):
        if p.extra_args:
            base = p.extra_args["base"]
            assert tokens == list(range(base, base + p.max_tokens))
        else:
            assert tokens == ref


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The mixed batch's tokens without processors."""
    prompts, params = _mixed()
    llm = LLM(str(tiny_dir), **BUSY)
    try:
        return _tokens(llm, prompts, params)
    finally:
        llm.shutdown()


def test_forcing_changes_only_the_requests_that_ask_across_rows_chunks_and_preemption(tiny_dir, reference):
    prompts, params = _mixed()
    CountingForce.instances.clear()
    llm = LLM(str(tiny_dir), logits_processors=[CountingForce], **BUSY)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        _check_forced([list(o.outputs[0].token_ids) for o in outs], reference, params)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        (proc,) = CountingForce.instances
        assert proc.vllm_config.scheduler_config.max_num_seqs == 6
        assert proc.vllm_config.model_config.get_vocab_size() == 320
        updates = proc.updates
        assert any(u.moved for u in updates) and any(u.removed for u in updates)
        assert all(m[2] is UNI for u in updates for m in u.moved)
        assert any(a[3] for u in updates for a in u.added)  # a resumed request comes back with its outputs
        assert proc.zero_rows > 0  # prompts in chunks sit in the batch and sample nothing
        # A request the processor refuses is refused alone, in vLLM's error type; the engine goes on.
        with pytest.raises(VLLMValidationError, match="base must be an integer"):
            llm.generate(prompts[:1], SamplingParams(max_tokens=2, extra_args={"base": "x"}), use_tqdm=False)
        assert _tokens(llm, prompts[:1], params[:1]) == [list(range(0, params[0].max_tokens))]
        twice = llm.generate(prompts[:1], SamplingParams(n=2, temperature=0.5, max_tokens=3, extra_args={"base": 9}),
                             use_tqdm=False)[0]  # fmt: skip
        assert [list(c.token_ids) for c in twice.outputs] == [[9, 10, 11]] * 2
    finally:
        llm.shutdown()


def test_argmax_invariant_processors_leave_greedy_requests_alone(tiny_dir):
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 17]} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, extra_args={"target": 42}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=5, ignore_eos=True, extra_args={"target": 42}),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    ref = LLM(str(tiny_dir), num_blocks=64, **KW)
    want = _tokens(ref, prompts, params)
    ref.shutdown()
    llm = LLM(str(tiny_dir), num_blocks=64, logits_processors=[InvariantForce], **KW)
    try:
        InvariantForce.calls = 0
        assert _tokens(llm, [prompts[0], prompts[2]], [params[0], params[2]]) == [want[0], want[2]]
        assert InvariantForce.calls == 0  # all greedy: never applied
        got = _tokens(llm, prompts, params)
        assert got[0] == want[0] and got[2] == want[2] and got[1] == [42] * 5
    finally:
        llm.shutdown()


def test_async_scheduling_with_a_grammar_in_the_batch_gives_the_sync_tokens(tiny_dir, reference):
    prompts, params = _mixed(6)
    regex = StructuredOutputsParams(regex="[ab]{3}c")
    grammar = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=regex)
    prompts, params = prompts + [{"prompt_token_ids": [40, 41, 42]}], params + [grammar]
    got = {}
    for mode in (False, True):
        llm = LLM(str(tiny_dir), logits_processors=[FQCN], async_scheduling=mode, **BUSY)
        try:
            got[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert [list(c.token_ids) for c in got[True]] == [list(c.token_ids) for c in got[False]]
    _check_forced([list(c.token_ids) for c in got[True][:6]], reference[:6], params[:6])
    assert len(got[True][6].text) == 4 and got[True][6].text.endswith("c")


def test_two_data_parallel_engines_give_one_engines_tokens(tiny_dir, reference):
    prompts, params = _mixed()
    with pytest.raises(ConfigError, match="cannot reach the engine processes"):
        class Local(CountingForce):
            pass

        LLM(str(tiny_dir), data_parallel_size=2, logits_processors=[Local], **BUSY)
    llm = LLM(str(tiny_dir), data_parallel_size=2, logits_processors=[CountingForce], **BUSY)
    try:
        _check_forced(_tokens(llm, prompts, params), reference, params)
    finally:
        llm.shutdown()


@pytest.mark.timeout(600)
def test_two_tensor_parallel_ranks_apply_them_alike(tiny_dir, reference):
    prompts, params = _mixed(4)
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, logits_processors=[FQCN], device="cpu", **BUSY)
    try:
        _check_forced(_tokens(llm, prompts, params), reference[:4], params)
    finally:
        llm.shutdown()


def test_refusals_in_vllms_words(tiny_dir):
    with pytest.raises(ConfigError, match=STR_SPEC_DEC_REJECTS_LOGITSPROCS):
        LLM(str(tiny_dir), logits_processors=[FQCN], speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=STR_POOLING_REJECTS_LOGITSPROCS):
        LLM(str(tiny_dir), runner="pooling", logits_processors=[FQCN], **KW)
    with pytest.raises(ValueError, match="Invalid logits processor FQCN 'tests.test_logits_processors.Recorder'"):
        LLM(str(tiny_dir), logits_processors=["tests.test_logits_processors.Recorder"], **KW)
    with pytest.raises(ValueError, match="SamplingParams is not a subclass of LogitsProcessor"):
        LLM(str(tiny_dir), logits_processors=[SamplingParams], **KW)
    with pytest.raises(RuntimeError, match="Failed to load 0th LogitsProcessor plugin no_such_module:X"):
        LLM(str(tiny_dir), logits_processors=["no_such_module:X"], **KW)
    with pytest.raises(ConfigError, match="logits_processors must be a list"):
        LLM(str(tiny_dir), logits_processors=FQCN, **KW)
    # Engine processes import processors by name; tensor-parallel workers run no script of the user's.
    assert fqcn_for_another_process(CountingForce) == FQCN
    with pytest.raises(ConfigError, match="defined in the script being run"):
        fqcn_for_another_process("__main__:Force", allow_main=False)


@pytest.mark.slow
def test_the_servers_flag_and_vllm_xargs(tiny_dir, reference, tmp_path):
    """One server with `--logits-processors module:Class`: vllm_xargs reach the processor on completions, chat and
    responses; a value its validate_params refuses is a 400 naming it; beam search refuses vllm_xargs."""
    prompts, params = _mixed(2)
    args = [str(tiny_dir), "--dtype", "float32", "--block-size", "4", "--num-blocks", "24", "--max-num-seqs", "6",
            "--max-num-batched-tokens", "16", "--no-enable-prefix-caching", "--logits-processors", FQCN]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(server.url + path, json=body, timeout=60)

        got = []
        for p, sp in zip(prompts, params):
            body = {"prompt": p["prompt_token_ids"], "max_tokens": sp.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            if sp.extra_args:
                body["vllm_xargs"] = sp.extra_args
            r = post("/v1/completions", body)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        _check_forced(got, reference[:2], params)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True,
                "vllm_xargs": {"base": 30}}
        r = post("/v1/chat/completions", {**chat, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [30, 31, 32], r.text
        r = post("/v1/responses", {"input": "hi", "max_output_tokens": 3, "vllm_xargs": {"base": 60},
                                   "enable_response_messages": True})
        assert r.status_code == 200 and r.json()["output_messages"][0]["tokens"] == [60, 61, 62], r.text
        r = post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "vllm_xargs": {"base": "x"}})
        assert r.status_code == 400 and "base must be an integer" in r.json()["error"]["message"], r.text
        r = post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True,
                                     "vllm_xargs": {"base": 3}})
        assert r.status_code == 400 and "vllm_xargs" in r.text
