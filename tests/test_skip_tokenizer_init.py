"""skip_tokenizer_init (vLLM's engine argument and --skip-tokenizer-init): no tokenizer is loaded anywhere; token ids
go in and come out (empty text), and what needs the tokenizer is refused in vLLM's words. The model directories here
have their tokenizer files removed, so a path that still loaded one would fail."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams
from tokenloom.engine.args import AsyncEngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.sampling_params import StructuredOutputsParams

PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """(the tiny model with its tokenizer, the same model without one)."""
    with_tok = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)
    without = tmp_path_factory.mktemp("bare") / "tiny-no-tokenizer"
    shutil.copytree(with_tok, without)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (without / name).unlink()
    return str(with_tok), str(without)


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                                use_tqdm=False)]


KW = dict(dtype="float32", num_blocks=64, block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def reference(model_dirs) -> list[list[int]]:
    llm = LLM(model_dirs[0], **KW)
    try:
        return _tokens(llm)
    finally:
        llm.shutdown()


def test_token_ids_in_and_out_without_a_tokenizer(model_dirs, reference) -> None:
    llm = LLM(model_dirs[1], skip_tokenizer_init=True, **KW)
    try:
        assert _tokens(llm) == reference  # the same tokens as the engine with its tokenizer
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True, prompt_logprobs=True,
                                detokenize=True)
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
        comp = out.outputs[0]
        assert comp.text == "" and len(comp.token_ids) == 4
        # logprobs=True is vLLM's 1; no text for any of them
        assert all(len(entry) in (1, 2) and all(lp.decoded_token is None for lp in entry.values())
                   for entry in comp.logprobs)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[0])
        # What needs the tokenizer, refused by name (vLLM's words where vLLM has them)
        refusals = [
            (lambda: llm.generate("abc", GREEDY), "You cannot pass text prompts when `skip_tokenizer_init=True`"),
            (lambda: llm.generate({"prompt": "abc"}, GREEDY), "You cannot pass text prompts"),
            (lambda: llm.get_tokenizer(), "Tokenizer not available when `skip_tokenizer_init=True`"),
            (lambda: llm.chat([{"role": "user", "content": "hi"}]), "Tokenizer not available"),
            (lambda: llm.generate([PROMPTS[0]], SamplingParams(structured_outputs=StructuredOutputsParams(
                regex="[0-9]+"))), "Structured outputs requires a tokenizer"),
            (lambda: llm.generate([PROMPTS[0]], SamplingParams(stop=["."])), "give stop_token_ids instead"),
            (lambda: llm.generate([PROMPTS[0]], SamplingParams(bad_words=["a"])), "bad_words needs"),
        ]
        for call, words in refusals:
            with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
                call()
        assert _tokens(llm) == reference  # the engine goes on after the refusals
    finally:
        llm.shutdown()


def test_without_the_flag_a_model_with_no_tokenizer_does_not_load(model_dirs) -> None:
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        LLM(model_dirs[1], **KW)


def test_the_model_s_eos_still_ends_a_request(model_dirs) -> None:
    """No tokenizer, but the model's EOS id (config.json; GGUF metadata) still stops generation, as vLLM's
    generation config makes it a stop id there. The tiny model's EOS is 2: a logit bias makes it the only pick."""
    llm = LLM(model_dirs[1], skip_tokenizer_init=True, **KW)
    try:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=5,
                                                                            logit_bias={2: 100.0}), use_tqdm=False)
        comp = out[0].outputs[0]
        assert comp.finish_reason == "stop" and list(comp.token_ids) == [2]
    finally:
        llm.shutdown()


def test_data_parallel_async_and_speculating_engines_take_it(model_dirs, reference) -> None:
    llm = LLM(model_dirs[1], skip_tokenizer_init=True, data_parallel_size=2, async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, **KW)
    try:
        assert _tokens(llm) == reference
        with pytest.raises(ValueError, match="You cannot pass text prompts"):
            llm.generate("abc", GREEDY)
    finally:
        llm.shutdown()

    async def run() -> list[int]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dirs[1], skip_tokenizer_init=True, **KW))
        try:
            with pytest.raises(ValueError, match="Tokenizer not available"):
                await engine.get_tokenizer()
            last = None
            async for out in engine.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, "r0"):
                last = out
            assert last is not None and last.outputs[0].text == ""
            return list(last.outputs[0].token_ids)
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == reference[1]


@pytest.mark.slow
def test_server_with_skip_tokenizer_init(model_dirs, reference, tmp_path) -> None:
    # --return-tokens-as-token-ids: vLLM's flag, the request's field as the server's default (a request's own
    # value wins)
    args = [model_dirs[1], "--skip-tokenizer-init", "--dtype", "float32", "--num-blocks", "64", "--block-size", "4",
            "--max-model-len", "64", "--return-tokens-as-token-ids"]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as s:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(s.url + path, json=body, timeout=60)

        r = post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 6
        r = post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                     "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == reference[0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference[0]]
        r = post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                     "logprobs": 1})  # return_tokens_as_token_ids from the server's flag
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference[0]]
        # echo with return_token_ids needs no tokenizer: no prompt text (vLLM's), the ids in prompt_token_ids
        r = post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                     "echo": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and choice["prompt_token_ids"] == PROMPTS[0]
        assert choice["token_ids"] == reference[0]
        for path, body, words in [
            ("/v1/completions", {"prompt": "abc"}, "You cannot pass text prompts when `skip_tokenizer_init=True`"),
            ("/v1/completions", {"prompt": PROMPTS[0], "logprobs": 1, "return_tokens_as_token_ids": False},
             "Unable to get tokenizer because"),
            ("/v1/completions", {"prompt": PROMPTS[0], "echo": True}, "Tokenizer not available"),
            ("/v1/completions", {"prompt": PROMPTS[0], "stop": ["."]}, "give stop_token_ids instead"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "Tokenizer not available"),
            ("/tokenize", {"prompt": "abc"}, "Tokenizer not available"),
        ]:
            r = post(path, body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (path, body, r.text)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
