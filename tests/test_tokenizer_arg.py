"""vLLM's `tokenizer` / `--tokenizer` (and `tokenizer_mode`): a tokenizer other than the model's, as vLLM users
serve a GGUF with the original model's tokenizer. The model here is a tiny GGUF (its own tokenizer embedded);
the other tokenizer is a Hugging Face directory with the same vocabulary and another chat template, so which one
an engine uses shows in the chat prompt's token ids while the model's tokens stay the same."""

from __future__ import annotations

import asyncio

import pytest

from tests.tiny_models import make_tiny_hf_model, make_tiny_tokenizer, write_gguf_from_hf
from tokenloom import LLM, SamplingParams
from tokenloom.cli import build_parser, parse_args
from tokenloom.config import ConfigError, engine_config_from_kwargs
from tokenloom.engine.args import engine_config_from_args

OTHER_TEMPLATE = ("{% for message in messages %}{{ 'OTHER ' + message['role'] + ': ' + message['content'] + '\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ 'OTHER assistant: ' }}{% endif %}")
CONV = [{"role": "user", "content": "Hello, world!"}]
KW = dict(dtype="float32", max_model_len=128, num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    hf_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)
    gguf = write_gguf_from_hf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    other = tmp_path_factory.mktemp("other-tokenizer")
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = OTHER_TEMPLATE
    tokenizer.save_pretrained(other)
    return str(gguf), str(other), tokenizer


def test_the_engine_renders_and_encodes_with_the_given_tokenizer(model_and_tokenizer) -> None:
    gguf, other, tokenizer = model_and_tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    own = LLM(gguf, **KW)
    try:
        own_out = own.chat(CONV, params, use_tqdm=False)[0]
        ids = own_out.prompt_token_ids
    finally:
        own.shutdown()
    llm = LLM(gguf, tokenizer=other, tokenizer_mode="hf", **KW)
    try:
        assert llm.get_tokenizer().chat_template == OTHER_TEMPLATE
        out = llm.chat(CONV, params, use_tqdm=False)[0]
        text = tokenizer.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
        assert text.startswith("OTHER user: Hello, world!")
        assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False) != ids
        # The model is the same: the same ids give the same tokens.
        same = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        assert same.token_ids == own_out.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_async_llm_and_the_command_line_take_it(model_and_tokenizer) -> None:
    from tokenloom.engine.args import AsyncEngineArgs
    from tokenloom.engine.async_llm import AsyncLLM

    gguf, other, _ = model_and_tokenizer
    args = parse_args(build_parser(), ["serve", gguf, "--tokenizer", other, "--tokenizer-mode", "hf"])
    config = engine_config_from_args(args)
    assert (config.tokenizer, config.tokenizer_mode, config.tokenizer_source) == (other, "hf", other)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=gguf, tokenizer=other, **KW))
    try:
        assert asyncio.run(engine.get_tokenizer()).chat_template == OTHER_TEMPLATE
    finally:
        engine.shutdown()


def test_modes_tokenloom_does_not_run_are_refused_by_name() -> None:
    for mode in ("slow", "mistral", "custom"):
        with pytest.raises(ConfigError, match=f"tokenizer_mode '{mode}' is vLLM's"):
            engine_config_from_kwargs(tokenizer_mode=mode)
    with pytest.raises(ConfigError, match="tokenizer_mode"):
        engine_config_from_kwargs(tokenizer_mode="fast")
    assert engine_config_from_kwargs().tokenizer_source is None  # the default model's own


def test_a_missing_tokenizer_path_is_a_clear_error(model_and_tokenizer, tmp_path) -> None:
    gguf, _, _ = model_and_tokenizer
    with pytest.raises(Exception, match="nowhere") as info:
        LLM(gguf, tokenizer=str(tmp_path / "nowhere"), **KW)
    assert "Traceback" not in str(info.value)


def test_the_servers_chat_template_replaces_the_tokenizers(model_and_tokenizer, tmp_path) -> None:
    """vLLM's --chat-template: a file or the Jinja text itself, read once at start-up, then every chat the
    server's tokenizer renders uses it (the GGUF's own template, and a transformers-loaded one alike); a
    path-like value naming no file is vLLM's refusal."""
    from tokenloom.model.tokenizer import load_tokenizer
    from tokenloom.server.config import ServerConfig, load_chat_template

    gguf, other, _ = model_and_tokenizer
    template_file = tmp_path / "t.jinja"
    template_file.write_text(OTHER_TEMPLATE)
    assert ServerConfig(chat_template=str(template_file)).chat_template == OTHER_TEMPLATE
    assert load_chat_template(OTHER_TEMPLATE) == OTHER_TEMPLATE
    with pytest.raises(ConfigError, match="appears path-like, but doesn't exist"):
        load_chat_template("no-such-template.jinja")
    for source in (gguf, other):
        tokenizer = load_tokenizer(source)
        tokenizer.chat_template = "{% for m in messages %}{{ 'T: ' + m['content'] }}{% endfor %}"
        assert tokenizer.apply_chat_template(CONV, tokenize=False) == "T: Hello, world!"
        assert tokenizer.hf.apply_chat_template(CONV, tokenize=False) == "T: Hello, world!"
