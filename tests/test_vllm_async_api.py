"""vLLM's public engine API beyond `LLM`: EngineArgs / AsyncEngineArgs, LLMEngine.from_engine_args and
AsyncLLM.from_engine_args with `async for out in engine.generate(prompt, params, request_id)`, `abort`,
`check_health` — what code written against `vllm.AsyncLLM` (a custom asyncio server) calls. Tiny model."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, AsyncEngineArgs, AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from tokenloom.config import ConfigError
from tokenloom.engine.exceptions import EngineDeadError, EngineGenerateError
from tokenloom.exceptions import VLLMValidationError
from tokenloom.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def tiny_args(tmp_path_factory) -> dict:
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)
    return {"model": str(model), "dtype": "float32", "num_blocks": 128, "block_size": 4, "max_model_len": 64}


def test_engine_args_are_vllms(tiny_args) -> None:
    args = EngineArgs(**tiny_args, max_num_seqs=3, enforce_eager=True)
    config = args.create_engine_config()
    assert config.scheduler.max_num_seqs == 3 and config.cache.block_size == 4 and config.model == tiny_args["model"]
    assert issubclass(AsyncEngineArgs, EngineArgs)
    with pytest.raises(TypeError, match="bogus"):
        EngineArgs(bogus=1)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0).create_engine_config()
    # vLLM's command-line round trip, and its examples' LLM(**asdict(engine_args)).
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", "m.gguf", "--max-num-seqs", "4"]))
    assert parsed.model == "m.gguf" and parsed.max_num_seqs == 4 and parsed.block_size is None
    llm = LLM(**dataclasses.asdict(args))
    try:
        assert llm.llm_engine.scheduler_config.max_num_seqs == 3
    finally:
        llm.shutdown()
    engine = LLMEngine.from_engine_args(args)
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            outs = engine.step()
        assert len(outs[0].outputs[0].token_ids) == 3
    finally:
        engine.close()


async def _collect(engine: AsyncLLM, request_id: str, params: SamplingParams, prompt="Hello, my name is") -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_async_llm_generate_abort_and_cancel(tiny_args) -> None:
    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**tiny_args))
        try:
            # Concurrent requests, each output kind: DELTA pieces add up, FINAL_ONLY is one output.
            kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
            runs = await asyncio.gather(*[
                _collect(engine, f"r{i}", SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.5, seed=33,
                                                          output_kind=kinds[i % 3], n=1 + i % 2))
                for i in range(9)])  # fmt: skip
            for i, outs in enumerate(runs):
                assert outs[-1].finished and len(outs[-1].outputs) == 1 + i % 2
                kind = kinds[i % 3]
                if kind is RequestOutputKind.FINAL_ONLY:
                    assert len(outs) == 1 and all(len(c.token_ids) == 6 for c in outs[0].outputs)
                elif kind is RequestOutputKind.DELTA:
                    for idx in range(1 + i % 2):
                        assert sum(len(c.token_ids) for o in outs for c in o.outputs if c.index == idx) == 6
                else:
                    assert all(len(c.token_ids) == 6 for c in outs[-1].outputs)
            assert not engine.output_processor.has_unfinished_requests()

            # abort(): the request's generate ends with a final output, finish_reason "abort" (vLLM's), holding
            # what was generated; several ids at once too.
            long = SamplingParams(max_tokens=50, ignore_eos=True)
            outs = []
            async for out in engine.generate("Hello", long, "long"):
                outs.append(out)
                if len(outs) == 1:
                    await engine.abort("long")
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            assert 0 < len(outs[-1].outputs[0].token_ids) < 50
            firsts = {"a": asyncio.Event(), "b": asyncio.Event()}

            async def until_aborted(rid: str) -> list:
                seen = []
                async for out in engine.generate("Hello", long, rid):
                    seen.append(out)
                    firsts[rid].set()
                return seen

            tasks = [asyncio.create_task(until_aborted(rid)) for rid in firsts]
            for event in firsts.values():
                await event.wait()
            await engine.abort(["a", "b", "never-seen"])
            for seen in await asyncio.gather(*tasks):
                assert seen[-1].outputs[0].finish_reason == "abort" and len(seen[-1].outputs[0].token_ids) > 0
            # Cancelling the consumer aborts the request in the engine (its KV blocks are freed).
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("Hello", long, "gone"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not engine.output_processor.has_unfinished_requests() and engine.num_unfinished == 0
            # A bad request raises before any output, as vLLM's; the engine keeps serving.
            with pytest.raises(VLLMValidationError, match="decoder prompt cannot be empty"):
                await _collect(engine, "bad", long, prompt="")
            outs = await _collect(engine, "after", SamplingParams(max_tokens=2, ignore_eos=True), prompt=[5, 6])
            assert len(outs[-1].outputs[0].token_ids) == 2
            # vLLM's tests/v1/shutdown/test_processor_error.py rule: an unexpected failure in generate is
            # EngineGenerateError (the cause chained), the request dropped, the engine not errored.
            real_tokenize = engine.input_processor.tokenize
            engine.input_processor.tokenize = lambda prompt: (_ for _ in ()).throw(RuntimeError("tokenizer broke"))
            try:
                with pytest.raises(EngineGenerateError, match="RuntimeError: tokenizer broke"):
                    await _collect(engine, "broken", long)
            finally:
                engine.input_processor.tokenize = real_tokenize
            assert not engine.errored and engine.num_unfinished == 0
            # vLLM's stream interval: a DELTA stream's outputs carry 4 tokens or more (the first 1, the last what is
            # left; more only when the consumer fell behind and the stream merged two).
            interval = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                                      stream_interval=4)
            sizes = [len(o.outputs[0].token_ids) for o in await _collect(engine, "interval", interval, prompt=[5, 6])]
            assert sizes[0] == 1 and sum(sizes) == 10 and all(size >= 4 for size in sizes[1:-1]) and len(sizes) > 2
            # A max_tokens past the context stops at max_model_len (64), as vLLM's engine (its server refuses it).
            outs = await _collect(engine, "past", SamplingParams(max_tokens=50_000, ignore_eos=True), prompt=[5, 6])
            assert len(outs[-1].outputs[0].token_ids) == 62 and outs[-1].outputs[0].finish_reason == "length"
            await engine.check_health()
            assert engine.is_running and not engine.errored
        finally:
            engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(run())


def test_async_llm_generate_with_data_parallel_async_scheduling_drafts_and_a_grammar(tiny_args) -> None:
    """The new API over the engine's other features at once: two engine processes, async scheduling, n-gram
    drafts, a regex constraint; every request's text follows the regex."""
    from tokenloom import StructuredOutputsParams

    pattern = r"[0-9]{3}-[a-z]{2}"

    async def run() -> list[str]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            **tiny_args, data_parallel_size=2, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}))
        try:
            params = SamplingParams(max_tokens=16, temperature=0.0,
                                    structured_outputs=StructuredOutputsParams(regex=pattern))
            runs = await asyncio.gather(*[_collect(engine, f"g{i}", params, prompt=[5 + i, 6, 7]) for i in range(4)])
            return [outs[-1].outputs[0].text for outs in runs]
        finally:
            engine.shutdown()

    texts = asyncio.run(run())
    assert len(texts) == 4 and all(re.fullmatch(pattern, t) for t in texts), texts


def test_async_llm_generate_streams_n_children_as_vllm(tiny_args) -> None:
    """vLLM 0.32's AsyncLLM.generate with n > 1: a streamed output carries the children that progressed since
    the consumer last read (vLLM's RequestOutputCollector merges them), a finished child is not sent again,
    `finished` only on the last output; FINAL_ONLY is one output with all n; the children's tokens are the same
    in every kind. Aborting the parent ends the unfinished children in the final output."""
    from tests.n_stream_shape import check_final_only, check_staggered, check_streamed, staggered_params

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**tiny_args))
        try:
            finals = check_final_only(await _collect(engine, "nf", staggered_params(RequestOutputKind.FINAL_ONLY),
                                                     prompt="Hello there"))
            check_staggered(finals)
            for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
                outs = await _collect(engine, f"n{kind.name}", staggered_params(kind), prompt="Hello there")
                assert check_streamed(outs, kind, one_child_each=False) == finals
                # tokenloom's delta fields add up per child, merged outputs included.
                for index, tokens in finals.items():
                    assert [t for o in outs for c in o.outputs if c.index == index for t in c.delta_token_ids] \
                        == tokens
            long = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=50, ignore_eos=True)
            outs = []
            async for out in engine.generate("Hello", long, "nabort"):
                outs.append(out)
                if len(outs) == 1:
                    await engine.abort("nabort")
            assert outs[-1].finished and len(outs) == 2
            assert [(c.index, c.finish_reason) for c in outs[-1].outputs] == [(i, "abort") for i in range(3)]
            assert not engine.output_processor.has_unfinished_requests() and engine.num_unfinished == 0
        finally:
            engine.shutdown()

    asyncio.run(run())
