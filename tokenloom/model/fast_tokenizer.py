"""A saved fast tokenizer loaded through `tokenizers` alone, without importing transformers.

transformers' plain fast tokenizer (`TokenizersBackend`, alias `PreTrainedTokenizerFast`) loaded from a
directory with tokenizer.json is the `tokenizers.Tokenizer` of that file plus the special tokens its
tokenizer_config.json names; encoding and decoding go straight to the Rust tokenizer. Importing
transformers for it costs ~0.6 CPU s (and more on a loaded machine) in a process that needs none of the
rest: the engine process, which reads the EOS id and encodes or decodes at most. `direct_tokenizer`
gives that subset when the directory is one where transformers would change nothing on load, and None
otherwise (the caller then loads transformers as before); `Tokenizer` (model/tokenizer.py) loads the
transformers tokenizer lazily for everything else (chat templates, xgrammar, vLLM's API).

When transformers would change the backend on load, it is not replicated here; the directory falls back:
add_bos_token / add_eos_token (a rebuilt post-processor), no post-processor at all, truncation or padding
stored in tokenizer.json, split_special_tokens, add_prefix_space, a named special token or an added token
the backend does not hold (transformers adds it), or a vocabulary over 100,000 (its Mistral regex patch).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# tokenizer_config.json's names for the special tokens transformers keeps as attributes, in its order.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Config keys whose presence makes transformers rebuild or reconfigure the backend on load.
_RECONFIGURING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "split_special_tokens")
_MISTRAL_PATCH_VOCAB = 100_000


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class DirectTokenizer:
    """The subset of a transformers fast tokenizer that tokenloom's Tokenizer calls, over `tokenizers`."""

    def __init__(self, backend: Any, special: dict[str, str], extra_special: list[str], directory: Path) -> None:
        self.backend = backend
        self.directory = directory
        self._special = special
        ids = [backend.token_to_id(t) for t in [*special.values(), *extra_special]]
        self.all_special_ids = list(dict.fromkeys(ids))
        self.chat_template = _chat_template(directory)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **_: Any) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.backend.id_to_token(i) for i in self.all_special_ids]

    def _id_of(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def _chat_template(directory: Path) -> str | None:
    """Where transformers 5 saves it (chat_template.jinja), else tokenizer_config.json's string."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        template = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None


def direct_tokenizer(directory: Path) -> DirectTokenizer | None:
    """The directory's tokenizer without transformers, or None where transformers would change it on load
    (or the directory is not a plain fast tokenizer's: the caller decides that, see saved_tokenizer_class)."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        from tokenizers import Tokenizer as RustTokenizer

        backend = RustTokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception:  # unreadable, not JSON, no tokenizers, or a file tokenizers rejects: transformers decides
        return None
    if not isinstance(config, dict) or any(k in config for k in _RECONFIGURING_KEYS):
        return None
    if (backend.post_processor is None or backend.truncation is not None or backend.padding is not None
            or backend.get_vocab_size() > _MISTRAL_PATCH_VOCAB):
        return None
    special = {name: text for name in _NAMED_SPECIAL if (text := _token_text(config.get(name))) is not None}
    extra_cfg = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra_cfg, dict):  # transformers 5 may name them
        extra_cfg = list(extra_cfg.values())
    extra = [t for v in extra_cfg if (t := _token_text(v)) is not None]
    if any(backend.token_to_id(t) is None for t in [*special.values(), *extra]):
        return None  # transformers would add the token
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        if backend.token_to_id(_token_text(token) or "") != int(index):
            return None
    return DirectTokenizer(backend, special, extra, directory)
