"""vLLM's structured-output options and refusals, as vLLM 0.32's own test (tests/peer/offline/
test_vllm_struct_output_generate.py) uses them: the engine-wide `structured_outputs_config`, the
StructuredOutputsParams fields for vLLM's other backends, Lark grammars, the older structural-tag form, and
VLLMValidationError with vLLM's sentences. Grammar-level checks on SmolLM2's tokenizer (no model), one engine
run on a tiny random model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenloom import SamplingParams, StructuredOutputsParams
from tokenloom.config import ConfigError, StructuredOutputsConfig, engine_config_from_kwargs
from tokenloom.exceptions import VLLMValidationError
from tokenloom.model.grammar import XgrammarBackend, grammar_is_likely_lark, validate_structured_outputs

VOCAB = 49152  # SmolLM2's
SQL_LARK = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
# vLLM's older structural tag (its test_structured_output, "Test 11"): structures + triggers.
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [{
    "begin": "<function=get_weather>", "end": "</function>",
    "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": False}}]}


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(None).hf


def _accepts(backend: XgrammarBackend, kind: str, spec: str, text: str, hf_tokenizer: Any) -> bool:
    """Whether the grammar takes `text` (as SmolLM2 tokenizes it) and may end there."""
    matcher = backend.matcher(backend.compile(kind, spec), [hf_tokenizer.eos_token_id])
    return all(matcher.accept_token(t) for t in hf_tokenizer.encode(text)) and matcher.accept_token(
        hf_tokenizer.eos_token_id)


# --- structured_outputs_config (engine argument) ----------------------------------------------------------
@pytest.mark.parametrize("value", [{"backend": "xgrammar", "disable_any_whitespace": True},
                                   StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
                                   '{"backend": "xgrammar", "disable_any_whitespace": true}'])
def test_structured_outputs_config_is_an_engine_argument(value: Any) -> None:
    config = engine_config_from_kwargs(structured_outputs_config=value)
    assert config.structured_outputs_config == StructuredOutputsConfig("xgrammar", disable_any_whitespace=True)
    assert engine_config_from_kwargs().structured_outputs_config == StructuredOutputsConfig()  # backend auto


@pytest.mark.parametrize("value, message", [
    ({"backend": "guidance"}, "'guidance' is a vLLM backend tokenloom does not have"),
    ({"backend": "outlines"}, "'outlines' is a vLLM backend"),
    ({"backend": "lm-format-enforcer"}, "'lm-format-enforcer' is a vLLM backend"),
    ({"backend": "xgrammer"}, "backend must be one of auto, xgrammar"),
    # vLLM's own checks, in its words.
    ({"backend": "auto", "disable_any_whitespace": True}, "only supported for xgrammar and guidance backends"),
    ({"backend": "xgrammar", "disable_additional_properties": True}, "only supported for the guidance backend"),
    ({"backend": "xgrammar", "reasoning_parser": "nope"},
     r"Reasoning parser 'nope' not found. Available parsers: deepseek_r1, qwen3"),
    ({"backend": "xgrammar", "reasoning_parser": 3}, "reasoning_parser must be a string"),
    ({"backend": "xgrammar", "enable_in_reasoning": "yes"}, "enable_in_reasoning must be true or false"),
    ({"backend": "xgrammar", "max_threads": 2}, "unknown field"),
])
def test_structured_outputs_config_refuses_what_tokenloom_does_not_have(value: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_config_from_kwargs(structured_outputs_config=value)


def test_engine_wide_disable_any_whitespace_makes_every_json_grammar_compact(hf_tokenizer: Any) -> None:
    # vLLM reads it in its xgrammar backend: a request without its own flag ("any|") compiles compact too.
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    loose = XgrammarBackend(hf_tokenizer, VOCAB)
    compact = XgrammarBackend(hf_tokenizer, VOCAB, disable_any_whitespace=True)
    for kind, spec in (("json", "any|" + schema), ("json_object", "any|")):
        assert _accepts(loose, kind, spec, '{"a": 1}', hf_tokenizer)
        assert not _accepts(compact, kind, spec, '{"a": 1}', hf_tokenizer)
        assert _accepts(compact, kind, spec, '{"a":1}', hf_tokenizer)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.tiny_models import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def test_the_engine_takes_structured_outputs_config(tiny_dir: Any) -> None:
    from tokenloom import LLM

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
        "type": "integer"}}}, "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    for compact in (False, True):
        llm = LLM(str(tiny_dir), quantization="none", dtype="float32", max_model_len=256, kv_cache_memory=64 << 20,
                  structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": compact})
        try:
            [out] = llm.generate(["x"], params, use_tqdm=False)
            # Made without complaint (as vLLM's), refused when the request is added, before it is queued.
            degenerate = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json_object=False))
            with pytest.raises(VLLMValidationError, match="json_object must be True"):
                llm.generate(["x"], degenerate, use_tqdm=False)
        finally:
            llm.shutdown()
        texts = [o.text for o in out.outputs]
        # No strings in the schema: compact output has no whitespace at all; the random model's any-whitespace
        # output has some (so the flag is what made the difference).
        assert any(any(c.isspace() for c in t) for t in texts) is not compact, texts


# --- StructuredOutputsParams: vLLM's fields ----------------------------------------------------------------
def test_vllm_backend_options_construct_and_whitespace_pattern_is_refused() -> None:
    so = StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True)
    validate_structured_outputs(so)  # xgrammar's JSON never has properties the schema does not name
    assert so.key == StructuredOutputsParams(json={"type": "object"}).key
    with pytest.raises(VLLMValidationError, match="whitespace_pattern is not supported by the xgrammar backend"):
        validate_structured_outputs(StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=r"[ ]?"))


# --- refusals in vLLM's words ---------------------------------------------------------------------------
@pytest.mark.parametrize("so, vllm_words", [
    (StructuredOutputsParams(json={"type": "integer", "multipleOf": 5}),
     "The provided JSON schema contains features not supported by xgrammar."),
    (StructuredOutputsParams(grammar="not a grammar"), "Invalid grammar specification"),  # read as Lark, as vLLM
    (StructuredOutputsParams(grammar="root ::= ("), "Invalid grammar specification"),
    (StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'), "Invalid structural tag specification"),
])
def test_refusals_are_vllm_validation_errors_in_vllm_words(so: StructuredOutputsParams, vllm_words: str) -> None:
    with pytest.raises(VLLMValidationError, match=vllm_words):
        validate_structured_outputs(so)


@pytest.mark.parametrize("fields, vllm_words", [
    # vLLM 0.32's request checks (its tests/v1/structured_output/test_validation.py, vendored in
    # tests/peer/structured): the params are made, the request is refused when it is checked, in vLLM's words
    ({"json_object": False}, "json_object must be True"),
    ({"json": ""}, "json cannot be an empty string"),
    ({"structural_tag": ""}, "structural_tag cannot be an empty string"),
    ({"grammar": " "}, "grammar cannot be an empty string"),
    ({"choice": []}, r"Choice '\[\]' cannot be an empty list"),
    ({"regex": "\x00"}, "NUL"),
    ({"regex": "[0-9]\x00"}, "NUL"),
])
def test_degenerate_constraints_are_refused_in_vllm_words(fields: dict, vllm_words: str) -> None:
    so = StructuredOutputsParams(**fields)
    with pytest.raises(VLLMValidationError, match=vllm_words):
        validate_structured_outputs(so)


@pytest.mark.parametrize("fields, vllm_words", [
    ({}, "You must use one kind of structured outputs constraint but none are specified"),
    ({"regex": "a", "choice": ["a"]}, "You can only use one kind of structured outputs constraint but multiple"),
])
def test_not_exactly_one_constraint_is_refused_when_made(fields: dict, vllm_words: str) -> None:
    with pytest.raises(VLLMValidationError, match=vllm_words):
        StructuredOutputsParams(**fields)


def test_an_empty_regex_is_a_constraint_as_in_vllm() -> None:
    """vLLM accepts an empty or whitespace regex (each compiles: the empty text, a space): only the end may follow."""
    for regex in ("", " ", "\n"):
        validate_structured_outputs(StructuredOutputsParams(regex=regex))


# --- Lark grammars and the older structural tag ------------------------------------------------------------
def test_lark_is_told_from_ebnf_as_vllm_does() -> None:
    assert grammar_is_likely_lark(SQL_LARK) and grammar_is_likely_lark("not a grammar")
    assert not grammar_is_likely_lark('root ::= "a"') and not grammar_is_likely_lark('# a: "b"\nroot ::= "a"')


def test_lark_grammars_are_compiled(hf_tokenizer: Any) -> None:
    validate_structured_outputs(StructuredOutputsParams(grammar=SQL_LARK))  # was refused ("EBNF only")
    backend = XgrammarBackend(hf_tokenizer, VOCAB)
    assert _accepts(backend, "grammar", SQL_LARK, "SELECTcol_1fromtable_1wherecol_1=1", hf_tokenizer)
    assert not _accepts(backend, "grammar", SQL_LARK, "SELECTcol_3fromtable_1wherecol_1=1", hf_tokenizer)


def test_the_older_structural_tag_form_is_compiled(hf_tokenizer: Any) -> None:
    spec = json.dumps(LEGACY_TAG)
    validate_structured_outputs(StructuredOutputsParams(structural_tag=spec))  # was "must have a format field"
    backend = XgrammarBackend(hf_tokenizer, VOCAB)
    assert _accepts(backend, "structural_tag", spec, 'It is <function=get_weather>{"city": "Paris"}</function>',
                    hf_tokenizer)
    assert not _accepts(backend, "structural_tag", spec, '<function=get_weather>{"town": "Paris"}</function>',
                        hf_tokenizer)
