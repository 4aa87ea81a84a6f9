"""Start-up stays fast (issue 32 item 9): what `tokenloom serve` must not import before it needs it.

The API process parses the command line and starts the engine process before importing torch,
FastAPI, uvicorn or transformers, and loads a cached GGUF tokenizer without torch (2 s) and without
AutoTokenizer's registry (1 to 4 s); the engine's runner does not import numba (0.5 s) unless n-gram
drafts are on. One subprocess checks them all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.tiny_models import make_tiny_hf_model, write_gguf_from_hf
from tokenloom.model.fast_tokenizer import direct_tokenizer
from tokenloom.model.tokenizer import Tokenizer, load_tokenizer, saved_tokenizer_class

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello, world!", "<|im_start|>user\nhi<|im_end|>", "naïve café 日本語"]

_CHILD = r"""
import json, sys
from tokenloom.cli import build_parser
from tokenloom.cli import parse_args
parse_args(build_parser(), ["serve", "--port", "1"])
heavy = [m for m in ("torch", "fastapi", "uvicorn", "transformers") if m in sys.modules]
assert not heavy, f"parsing the command line imported {heavy}"

import tokenloom.server.launcher as launcher
from tokenloom.config import EngineConfig
from tokenloom.server.config import ServerConfig
class Spawned(Exception):
    pass
def spawn(config, log_level, **_):
    heavy = [m for m in ("torch", "fastapi", "uvicorn", "transformers") if m in sys.modules]
    raise Spawned(heavy)
launcher.make_client = spawn
try:
    launcher.run_server(EngineConfig(), ServerConfig(port=0))
except Spawned as exc:
    assert not exc.args[0], f"the server imported {exc.args[0]} before it started the engine"

from tokenloom.model.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1], cache_dir=sys.argv[2])
assert "torch" not in sys.modules, "loading the tokenizer imported torch"
assert "transformers.models.auto.tokenization_auto" not in sys.modules, "the tokenizer went through AutoTokenizer"
texts = json.loads(sys.argv[3])
out = {"ids": [tok.encode(t) for t in texts], "eos": tok.eos_token_id, "special": sorted(tok.all_special_ids),
       "chat": tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True),
       "class": type(tok.hf).__name__}

import tokenloom.model.runner  # noqa: F401
assert "numba" not in sys.modules, "the runner imported numba without n-gram drafts"
print(json.dumps(out))
"""


def test_serve_start_up_imports_only_what_it_needs(tmp_path: Path) -> None:
    gguf = write_gguf_from_hf(make_tiny_hf_model(tmp_path, "llama"), tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    load_tokenizer(gguf, cache_dir=cache)  # the first load converts (AutoTokenizer) and caches
    entry = next((cache / "tokenizers").iterdir())
    assert saved_tokenizer_class(entry) is not None  # the cached conversion names a directly loadable class
    reference = Tokenizer(AutoTokenizer.from_pretrained(str(entry), local_files_only=True))  # the old way
    out = subprocess.run([sys.executable, "-c", _CHILD, str(gguf), str(cache), json.dumps(TEXTS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.splitlines()[-1])
    # The direct load is the tokenizer AutoTokenizer gave.
    assert child["ids"] == [reference.encode(t) for t in TEXTS]
    assert child["eos"] == reference.eos_token_id
    assert child["special"] == sorted(reference.all_special_ids)
    assert child["chat"] == reference.apply_chat_template([{"role": "user", "content": "hi"}],
                                                          add_generation_prompt=True)
    assert child["class"] == type(reference.hf).__name__


_ENGINE_CHILD = r"""
import json, sys
from tokenloom.model.tokenizer import load_tokenizer
tok = load_tokenizer(None if sys.argv[1] == "default" else sys.argv[1], cache_dir=sys.argv[2],
                     lazy_transformers=sys.argv[4] == "lazy")
auto = "transformers.models.auto.tokenization_auto" in sys.modules
texts = json.loads(sys.argv[3])
out = {"ids": [tok.encode(t) for t in texts], "plain": [tok.encode(t, add_special_tokens=False) for t in texts],
       "eos": tok.eos_token_id, "bos": tok.bos_token_id, "special": sorted(tok.all_special_ids),
       "vocab": tok.vocab_size, "decoded": [tok.decode(tok.encode(t), skip_special_tokens=s) for t in texts
                                            for s in (True, False)],
       "pieces": tok.convert_ids_to_tokens(tok.encode(texts[-1])), "template": tok.chat_template,
       "direct": tok._direct is not None, "transformers": "transformers" in sys.modules, "auto": auto}
out["chat"] = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
print(json.dumps(out))
"""


def _lazy_load_in_a_child(model: str, cache: Path, mode: str = "lazy") -> dict:
    out = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, model, str(cache), json.dumps(TEXTS), mode], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _assert_same_answers(child: dict, reference: Tokenizer) -> None:
    assert child["ids"] == [reference.encode(t) for t in TEXTS]
    assert child["plain"] == [reference.encode(t, add_special_tokens=False) for t in TEXTS]
    assert (child["eos"], child["bos"]) == (reference.eos_token_id, reference.bos_token_id)
    assert child["special"] == sorted(reference.all_special_ids) and child["vocab"] == reference.vocab_size
    assert child["decoded"] == [reference.decode(reference.encode(t), skip_special_tokens=s) for t in TEXTS
                                for s in (True, False)]
    assert child["pieces"] == reference.convert_ids_to_tokens(reference.encode(TEXTS[-1]))
    assert child["template"] == reference.chat_template
    assert child["chat"] == reference.apply_chat_template([{"role": "user", "content": "hi"}],
                                                          add_generation_prompt=True)


@pytest.fixture(scope="module")
def default_conversion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer cache holding the default GGUF's conversion (AutoTokenizer's, ~8 s on 2 cores), made once;
    each test takes a copy of it."""
    cache = tmp_path_factory.mktemp("default-tokenizer")
    load_tokenizer(None, cache_dir=cache)
    return cache


def test_engine_tokenizer_loads_without_transformers_and_equals_it(tmp_path: Path, default_conversion: Path) -> None:
    """The engine process's tokenizer (load_tokenizer(lazy_transformers=True)) reads a cached GGUF conversion
    through `tokenizers` alone: no transformers import until a chat template is rendered, and every answer
    the same as the transformers tokenizer's (the default model's, where it must be direct)."""
    cache = tmp_path / "cache"
    shutil.copytree(default_conversion, cache)
    for model in ("default", str(write_gguf_from_hf(make_tiny_hf_model(tmp_path, "llama"), tmp_path / "m.gguf"))):
        reference = load_tokenizer(None if model == "default" else model, cache_dir=cache)  # converts and caches
        child = _lazy_load_in_a_child(model, cache)
        if model == "default":
            assert child["direct"] and not child["transformers"], "the default model's tokenizer loaded transformers"
        _assert_same_answers(child, reference)


def test_a_model_directory_is_read_directly_once_autotokenizer_chose_the_plain_class(tmp_path: Path) -> None:
    """A Hugging Face directory: the first load goes through AutoTokenizer (which may choose a model-specific
    class) and records its choice; once that was the plain fast tokenizer, later loads of the unchanged
    directory skip AutoTokenizer (the API process's) or transformers (the engine process's), with the same
    answers. A changed tokenizer file, or a model type
    transformers gives its own class (Qwen2: Qwen2Tokenizer over the declared TokenizersBackend), does not."""
    cache = tmp_path / "cache"
    llama = make_tiny_hf_model(tmp_path, "llama")
    reference = Tokenizer(AutoTokenizer.from_pretrained(str(llama), local_files_only=True))
    first = load_tokenizer(llama, cache_dir=cache, lazy_transformers=True)
    assert first._direct is None  # nothing recorded yet: AutoTokenizer decided, and its pick is recorded
    again = _lazy_load_in_a_child(str(llama), cache)
    assert again["direct"] and not again["transformers"]
    _assert_same_answers(again, reference)
    eager = _lazy_load_in_a_child(str(llama), cache, "eager")
    assert not eager["direct"] and not eager["auto"]
    _assert_same_answers(eager, reference)

    config = json.loads((llama / "tokenizer_config.json").read_text())
    (llama / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    edited = load_tokenizer(llama, cache_dir=cache, lazy_transformers=True)
    assert edited._direct is None and edited.eos_token_id == reference.hf.convert_tokens_to_ids("<|endoftext|>")

    qwen2 = make_tiny_hf_model(tmp_path, "qwen2")
    for _ in range(2):
        loaded = load_tokenizer(qwen2, cache_dir=cache, lazy_transformers=True)
        assert loaded._direct is None, "transformers loads this Qwen2 as its own class: it must keep deciding"
        assert type(loaded.hf).__name__ not in ("TokenizersBackend", "PreTrainedTokenizerFast")


def test_direct_tokenizer_leaves_what_transformers_would_change_to_transformers(tmp_path: Path,
                                                                              default_conversion: Path) -> None:
    shutil.copytree(default_conversion, tmp_path / "cache")
    entry = next((tmp_path / "cache" / "tokenizers").iterdir())
    assert direct_tokenizer(entry) is not None
    # A post-processor that adds a BOS (as Llama's tokenizer.json does): the direct encode adds it where
    # transformers does, and only there.
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.processors import TemplateProcessing

    bos_dir = tmp_path / "with-bos"
    shutil.copytree(entry, bos_dir)
    backend = RustTokenizer.from_file(str(bos_dir / "tokenizer.json"))
    bos_id = backend.token_to_id("<|im_start|>")
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_id)])
    backend.save(str(bos_dir / "tokenizer.json"))
    direct, reference = Tokenizer(direct=direct_tokenizer(bos_dir)), Tokenizer(saved_tokenizer_class(bos_dir)
                                                                               .from_pretrained(str(bos_dir)))
    for add in (True, False):
        assert [direct.encode(t, add_special_tokens=add) for t in TEXTS] == \
            [reference.encode(t, add_special_tokens=add) for t in TEXTS]
    assert direct.encode("hi")[0] == bos_id
    config = json.loads((entry / "tokenizer_config.json").read_text())
    for change in ({"add_bos_token": True}, {"eos_token": "<|not-in-the-vocabulary|>"},
                   {"added_tokens_decoder": {"3": {"content": "<|im_start|>"}}}):
        (entry / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert direct_tokenizer(entry) is None, change
