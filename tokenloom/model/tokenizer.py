"""Tokenizers: a thin wrapper over a Hugging Face fast tokenizer, and streaming (incremental) detokenization.

Encoding, decoding and chat templates are delegated to transformers so that tokenloom renders and splits
text exactly the way the model's own tooling does.

GGUF files carry no tokenizer.json; transformers rebuilds one from the GGUF metadata. That takes ~4 s for
SmolLM2 (most of it in `gguf.GGUFReader` parsing the vocabulary), so the converted tokenizer is saved
under `<cache>/tokenizers/<file stem>-<key>/` and later loads take ~0.3 s. The key hashes the GGUF's
resolved path, size and mtime plus the transformers version, so an edited file or a transformers upgrade
converts afresh. `<cache>` is `$TOKENLOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenloom`, else
`~/.cache/tokenloom`; deleting it is always safe.

A cached conversion is loaded through the class its tokenizer_config.json names (the plain fast
tokenizer), not AutoTokenizer: AutoTokenizer's probing imports transformers' model registry, 1 to 4 s
of a server's start-up (twice: the API process and the engine process both load the tokenizer), to pick
that same class for a directory without config.json. Hugging Face model directories still go through
AutoTokenizer, which may choose a model-specific class over the one their tokenizer_config.json names;
when it picks the plain fast tokenizer, a record under `<cache>/tokenizers/hf-dir-<key>` says so for that
directory as it is (keyed like the conversions, on its tokenizer files and the transformers version), and
later loads take that class without AutoTokenizer.

The engine process goes one step further (`lazy_transformers=True`): a cached conversion, or a recorded
model directory, that transformers would load unchanged is read through `tokenizers` alone
(model/fast_tokenizer.py), and transformers is imported only if something asks for more than encoding,
decoding and the special ids (4-5 CPU s of an engine's start on a Hugging Face directory, ~0.1 s after).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tokenloom.model.fast_tokenizer import DirectTokenizer, direct_tokenizer
from tokenloom.model.paths import default_cache_dir, resolve_model_path

logger = logging.getLogger(__name__)

# Bumped when the cache layout changes, so old entries are ignored rather than misread.
_CACHE_FORMAT = 1


class Tokenizer:
    """A Hugging Face tokenizer with the handful of operations the engine needs.

    Built on a transformers tokenizer, or on a DirectTokenizer (model/fast_tokenizer.py: the same fast
    tokenizer through `tokenizers` alone), in which case `hf`, the transformers tokenizer, is loaded on
    first use: chat templates, xgrammar and vLLM's API need it, encoding and decoding do not."""

    def __init__(self, hf_tokenizer: Any = None, direct: DirectTokenizer | None = None) -> None:
        assert (hf_tokenizer is None) != (direct is None), "a transformers tokenizer or a direct one"
        self._hf = hf_tokenizer
        self._direct = direct
        # What answers encode/decode/ids: the direct tokenizer when there is one, never loading transformers.
        self._core = direct if direct is not None else hf_tokenizer
        self._backend_decode = direct.backend.decode if direct is not None else _backend_decode(hf_tokenizer)
        self._vocab: dict[str, int] | None = None
        self._chat_template_set = False

    @property
    def hf(self) -> Any:
        if self._hf is None:
            assert self._direct is not None
            self._hf = _from_saved(self._direct.directory)
            if self._chat_template_set:  # a template set before transformers loaded (--chat-template)
                self._hf.chat_template = self._direct.chat_template
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._core.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No space clean-up (" ." -> "."): it depends on neighbouring tokens, so streamed text could not
        # agree with a one-shot decode.
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._core.convert_ids_to_tokens(list(ids))

    @property
    def eos_token_id(self) -> int | None:
        return self._core.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._core.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return len(self._core)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._core.all_special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._core.all_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (what reasoning parsers look their tags up in). Built once
        (tens of ms for a 50k vocabulary; a parser is made per request) and shared: read it, never change it."""
        if self._vocab is None:
            self._vocab = self._core.get_vocab()
        return self._vocab

    @property
    def chat_template(self) -> str | None:
        return self._core.chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        """Another template for every chat this tokenizer renders (the server's --chat-template)."""
        self._core.chat_template = template
        self._chat_template_set = True
        if self._hf is not None:
            self._hf.chat_template = template

    def apply_chat_template(
        self,
        conversation: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, str]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """transformers' signature and defaults (what vLLM's `get_tokenizer()` returns): token ids unless
        `tokenize=False`; no generation prompt unless asked. `return_dict=True` gives {"input_ids": ids}
        (transformers 5 defaults to it; 4.x and vLLM's examples expect the plain list, kept here)."""
        if not (chat_template or self.chat_template):
            raise ValueError(
                "this model has no chat template (no tokenizer.chat_template in the GGUF, no chat_template in "
                "tokenizer_config.json); send a plain completion prompt instead"
            )
        extra = {k: v for k, v in (("tools", tools), ("documents", documents), ("chat_template", chat_template))
                 if v is not None}
        if continue_final_message:
            extra["continue_final_message"] = True
        text = self.hf.apply_chat_template(
            list(conversation), add_generation_prompt=add_generation_prompt, tokenize=False, **extra, **kwargs
        )
        if not tokenize:
            return text
        # The template writes any BOS itself; this is also how transformers tokenizes a rendered chat.
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    def __getattr__(self, name: str) -> Any:
        # The rest of a Hugging Face tokenizer's API (eos_token, convert_tokens_to_ids, ...), for code moved
        # from vLLM, whose get_tokenizer() returns the Hugging Face tokenizer itself.
        if name.startswith("_"):  # our own attributes, before __init__ set them (copy, pickle)
            raise AttributeError(name)
        return getattr(self.hf, name)


def _backend_decode(hf: Any) -> Any:
    """The Rust `tokenizers.Tokenizer.decode` behind a transformers fast tokenizer whose `_decode` is
    the stock one (which, without space clean-up, only calls it), else None. Streaming decodes twice
    per token; the wrapper's argument handling cost ~2 us of the ~3 us per call."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Stock
    except ImportError:
        try:
            from transformers import PreTrainedTokenizerFast as Stock
        except ImportError:
            return None
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or getattr(type(hf), "_decode", None) is not getattr(Stock, "_decode", object()):
        return None
    return getattr(backend, "decode", None)


def load_tokenizer(model: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None,
                   lazy_transformers: bool = False) -> Tokenizer:
    """The tokenizer of a model given as for `resolve_model_path` (GGUF file or Hugging Face directory).

    `lazy_transformers`: where the cached GGUF conversion is a plain fast tokenizer that transformers would
    load unchanged, load it through `tokenizers` and import transformers only when something needs it (the
    engine process: ~0.6 CPU s saved). The API process renders chat templates on every chat request and
    keeps the eager load, which it does while the engine process loads the model."""
    path = _tokenizer_path(model)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if path.is_file():
        entry = _gguf_cache_entry(path, cache)
        if lazy_transformers and (direct := _direct_from_saved(entry)) is not None:
            return Tokenizer(direct=direct)
        return Tokenizer(_gguf_tokenizer(path, entry))
    # A Hugging Face directory goes through AutoTokenizer, which may pick a model-specific class over the one
    # its tokenizer_config.json names (by model type, Hub name, auto_map: rules that change between
    # transformers releases). Its pick is recorded; where that was the plain fast tokenizer, later loads of
    # the unchanged directory take that class straight away, or in the engine process `tokenizers` alone.
    record = _hf_dir_record(path, cache)
    if record is not None and (recorded := _recorded_class_name(record)) is not None:
        if lazy_transformers and (direct := direct_tokenizer(path)) is not None:
            return Tokenizer(direct=direct)
        if (cls := _direct_class(recorded)) is not None:
            return Tokenizer(cls.from_pretrained(str(path), local_files_only=True))
    hf = _hf_dir_tokenizer(path)
    if record is not None and type(hf).__name__ in _DIRECT_CLASSES:
        _write_record(record, type(hf).__name__)
    return Tokenizer(hf)


def _tokenizer_path(source: str | os.PathLike[str] | None) -> Path:
    """A model (GGUF file or Hugging Face directory, `resolve_model_path`), or a directory holding only a
    tokenizer (vLLM's `--tokenizer`: its tokenizer.json / tokenizer_config.json without a model's config.json)."""
    if source is not None:
        path = Path(source).expanduser()
        if path.is_dir() and any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return path
    return resolve_model_path(source)


def _direct_from_saved(directory: Path) -> DirectTokenizer | None:
    """A saved plain fast tokenizer through `tokenizers` alone (None: transformers must load it)."""
    if not (directory / "tokenizer.json").is_file() or _saved_class_name(directory) not in _DIRECT_CLASSES:
        return None
    return direct_tokenizer(directory)


def _hf_dir_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# The files AutoTokenizer may read from a model directory: a record is keyed on all that exist.
_HF_TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def _hf_dir_record(path: Path, cache_dir: Path) -> Path | None:
    """`<cache>/tokenizers/hf-dir-<key>`: the class AutoTokenizer loaded this directory as, as it is now (its
    tokenizer files' sizes and mtimes) under the installed transformers. None when the directory cannot be
    read."""
    try:
        stats = [f"{name}:{st.st_size}:{st.st_mtime_ns}" for name in _HF_TOKENIZER_FILES
                 if (st := _stat_or_none(path / name)) is not None]
        ident = "|".join([str(_CACHE_FORMAT), str(path.resolve()), *stats, metadata.version("transformers")])
    except (OSError, metadata.PackageNotFoundError):
        return None
    return cache_dir / "tokenizers" / f"hf-dir-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _recorded_class_name(record: Path) -> str | None:
    """The plain fast tokenizer class a record names, or None (no record, or a name this code does not load)."""
    try:
        name = record.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name if name in _DIRECT_CLASSES else None


def _write_record(record: Path, class_name: str) -> None:
    """Write atomically (a server's two processes may load the directory at once); a cache that cannot be
    written only means the next load asks AutoTokenizer again."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.{os.getpid()}")
        tmp.write_text(class_name, encoding="utf-8")
        tmp.replace(record)
    except OSError as exc:
        logger.debug("cannot record the tokenizer class in %s (%s)", record, exc)


def _gguf_cache_entry(path: Path, cache_dir: Path) -> Path:
    return cache_dir / "tokenizers" / f"{path.stem}-{_cache_key(path)}"


def _gguf_tokenizer(path: Path, entry: Path) -> Any:
    if (entry / "tokenizer.json").is_file():
        return _from_saved(entry)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if not _save_to_cache(hf, entry):
        return hf
    # Serve the cached copy even now, so the first run behaves exactly like every later one.
    return _from_saved(entry)


# The fast-tokenizer classes a tokenizer_config.json may name that load straight from tokenizer.json,
# and their modules (transformers 5 calls the class TokenizersBackend; PreTrainedTokenizerFast is its alias).
_DIRECT_CLASSES = {
    "TokenizersBackend": "transformers.tokenization_utils_tokenizers",
    "PreTrainedTokenizerFast": "transformers.tokenization_utils_fast",
}


def _from_saved(directory: Path) -> Any:
    """A cached conversion (no config.json beside it) through the class its tokenizer_config.json names when
    that is the plain fast tokenizer (what AutoTokenizer picks there, without its probing), else AutoTokenizer."""
    cls = saved_tokenizer_class(directory)
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return cls.from_pretrained(str(directory), local_files_only=True)


def _saved_class_name(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def saved_tokenizer_class(directory: Path) -> Any:
    """The directly loadable class a saved tokenizer names, or None (another class, no tokenizer.json)."""
    if not (directory / "tokenizer.json").is_file():
        return None
    return _direct_class(_saved_class_name(directory))


def _direct_class(name: str | None) -> Any:
    """transformers' plain fast tokenizer class under `name` (imported without AutoTokenizer's registry), or
    None for any other name."""
    if name not in _DIRECT_CLASSES:
        return None
    try:
        return getattr(importlib.import_module(_DIRECT_CLASSES[name]), name)
    except (ImportError, AttributeError):
        return None


def _cache_key(path: Path) -> str:
    # The installed version from its metadata: `import transformers` alone costs more than a direct load.
    stat = path.stat()
    ident = f"{_CACHE_FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{metadata.version('transformers')}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _save_to_cache(hf: Any, entry: Path) -> bool:
    """Save atomically (concurrent processes may convert the same file); False if the cache is unusable."""
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        hf.save_pretrained(str(tmp))
        tmp.rename(entry)  # fails if another process got there first; its copy is as good as ours
    except OSError as exc:
        if not (entry / "tokenizer.json").is_file():
            logger.warning("cannot cache the converted tokenizer in %s (%s); it is rebuilt next time", entry, exc)
            return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


class IncrementalDetokenizer:
    """Turn token ids, fed a step at a time, into text deltas (the prefix/read-offset scheme of vLLM and TGI).

    Each step re-decodes a short window: tokens already emitted (`prefix`, context for decoders whose
    output depends on neighbours, e.g. sentencepiece's leading space) plus the unread ones, and emits what
    the window adds beyond the prefix. Text ending in U+FFFD is held back, because a multi-byte character
    split over byte-fallback or byte-level tokens decodes to U+FFFD until its last byte arrives.

    Without `prompt_ids`, `text` after `flush()` equals `tokenizer.decode(token_ids, skip_special_tokens)`.
    With them, the last few prompt tokens serve as context, so the first token's leading space survives.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)[-self._CONTEXT_TOKENS :]
        self._n_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """The ids fed so far (prompt context excluded)."""
        return self._ids[self._n_context :]

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Feed the ids of one step (one id or several); return the newly stable text (possibly "")."""
        # int() also accepts numpy/torch scalars, which HF decode would choke on later.
        if isinstance(new_ids, Iterable):
            self._ids.extend(int(i) for i in new_ids)
        else:
            self._ids.append(int(new_ids))
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream, release held-back text (an unfinished character becomes U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
