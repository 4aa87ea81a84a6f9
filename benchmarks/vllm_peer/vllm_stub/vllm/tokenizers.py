"""vllm.tokenizers.get_tokenizer, as far as the peer tests use it: the served model's tokenizer.

vLLM's returns the Hugging Face tokenizer of the named model (from the Hub); here the name is plumbing
(as in remote_server.py) and the answer is the transformers tokenizer of the model tokenloom serves
(`TOKENLOOM_PEER_MODEL`, default: the default model), so `encode`, `decode`, `convert_ids_to_tokens`
and `apply_chat_template` keep transformers' own defaults and signatures, as with vLLM's.
"""

from __future__ import annotations

import functools
import os
from typing import Any


@functools.cache
def _served_tokenizer() -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(os.environ.get("TOKENLOOM_PEER_MODEL")).hf


def get_tokenizer(tokenizer_name: str | os.PathLike[str] = "", *args: Any, **kwargs: Any) -> Any:
    return _served_tokenizer()
