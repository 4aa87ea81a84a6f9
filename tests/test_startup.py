"""Start-up stays fast (issue 32 item 9): what `tokenloom serve` must not import before it needs it.

The API process parses the command line and starts the engine process before importing torch,
FastAPI, uvicorn or transformers, and loads a cached GGUF tokenizer without torch (2 s) and without
AutoTokenizer's registry (1 to 4 s); the engine's runner does not import numba (0.5 s) unless n-gram
drafts are on. One subprocess checks them all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from tests.tiny_models import make_tiny_hf_model, write_gguf_from_hf
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
def spawn(config, log_level):
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
