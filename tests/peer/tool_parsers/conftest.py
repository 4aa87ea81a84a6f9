"""tests/peer/tool_parsers: vLLM 0.32's tool-parser and tool-request tests on tokenloom's parsers and request
checks (vllm_shim.py is the plumbing; docs/vllm_peer.md, "Tool parsers", lists what is vendored and why).

vLLM's conftest gives the tests gpt2's tokenizer from the Hugging Face Hub; `default_tokenizer` here is the
default model's (SmolLM2-135M-Instruct's, a byte-level BPE as gpt2's), which is on disk.
"""

from __future__ import annotations

import pytest

from tests.peer.tool_parsers.vllm_shim import TokenizerLike, local_tokenizer


@pytest.fixture(scope="module")
def default_tokenizer() -> TokenizerLike:
    return local_tokenizer()
