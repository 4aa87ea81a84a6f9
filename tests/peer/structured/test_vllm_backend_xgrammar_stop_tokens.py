# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/structured_output/test_backend_xgrammar_stop_tokens.py, the test body
# unchanged, on tokenloom's xgrammar backend (tokenloom/model/grammar.py; vLLM's constructor and compile_grammar:
# tests/peer/structured/vllm_shim.py), whose matchers take a request's stop tokens as xgrammar's
# override_stop_tokens, as vLLM's do. Plumbing: the imports; gpt2's tokenizer (the Hugging Face Hub) is the default
# model's, SmolLM2's, so VOCAB_SIZE and the three token ids are SmolLM2's: its EOS (<|im_end|>), the standalone `"`
# and `X`, which play the parts of gpt2's 50256, 1 and 55.
"""Regression tests for issue #42403.

A request's stop-token set (the generation_config eos list plus any
user-supplied ``stop_token_ids``) is invisible to xgrammar, which only knows
the tokenizer's single eos. Such tokens can therefore escape the grammar
bitmask while the FSM is still mid-object and truncate structured output.
``compile_grammar`` now forwards ``all_stop_token_ids`` to the matcher as
``override_stop_tokens`` so xgrammar masks them until the grammar completes.
"""

import pytest

from tests.peer.structured.vllm_shim import (
    AutoTokenizer,
    StructuredOutputOptions,
    StructuredOutputsConfig,
    VllmConfig,
    XgrammarBackend,
)

TOKENIZER = "openai-community/gpt2"
VOCAB_SIZE = 49152

# gpt2 token ids used to drive a `{"type": "string"}` grammar deterministically.
EOS = 2  # <|endoftext|> -- the tokenizer's only default stop token
QUOTE = 18  # standalone `"`; opens then closes the JSON string
LETTER = 72  # `X`: valid string content, not a special/stop token by default


def _token_allowed(row, token_id: int) -> bool:
    word = int(row[token_id // 32].item()) & 0xFFFFFFFF
    return bool(word & (1 << (token_id % 32)))


@pytest.fixture(scope="module")
def backend() -> XgrammarBackend:
    vllm_config = VllmConfig(
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar")
    )
    return XgrammarBackend(
        vllm_config,
        tokenizer=AutoTokenizer.from_pretrained(TOKENIZER),
        vocab_size=VOCAB_SIZE,
    )


def test_request_stop_tokens_gated_to_grammar_terminal(backend: XgrammarBackend):
    schema = '{"type": "string"}'
    default = backend.compile_grammar(StructuredOutputOptions.JSON, schema)
    override = backend.compile_grammar(
        StructuredOutputOptions.JSON, schema, stop_token_ids={EOS, LETTER}
    )

    # Open the string: both grammars are now in a non-terminal state.
    for grammar in (default, override):
        assert grammar.accept_tokens("req", [QUOTE])

    bm_default = backend.allocate_token_bitmask(1)
    bm_override = backend.allocate_token_bitmask(1)
    default.fill_bitmask(bm_default, 0)
    override.fill_bitmask(bm_override, 0)

    # Mid-string, the plain token is valid content, so the default grammar
    # leaves it samplable -- this is the leak. Registering it as a stop token
    # masks it until the grammar can terminate.
    assert _token_allowed(bm_default[0], LETTER)
    assert not _token_allowed(bm_override[0], LETTER)

    # Close the string -> accepting state (grammar complete, not yet terminated).
    for grammar in (default, override):
        assert grammar.accept_tokens("req", [QUOTE])
        assert not grammar.is_terminated()

    default.fill_bitmask(bm_default, 0)
    override.fill_bitmask(bm_override, 0)

    # The extra stop token may now terminate under the override, never under
    # the default grammar -- and the tokenizer's own eos still terminates both,
    # so default termination is preserved.
    assert not _token_allowed(bm_default[0], LETTER)
    assert _token_allowed(bm_override[0], LETTER)
    assert _token_allowed(bm_default[0], EOS)
    assert _token_allowed(bm_override[0], EOS)
