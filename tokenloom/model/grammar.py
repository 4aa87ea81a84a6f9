"""The grammar library behind structured outputs: xgrammar (vLLM's default backend).

- `XgrammarBackend`: compiles a (kind, spec) against the tokenizer's vocabulary, builds per-request
  matchers and bitmasks; the StructuredOutputManager (tokenloom/core/structured_output.py) drives it.
- `validate_structured_outputs`: what the API process checks before a request is queued, without the
  tokenizer (an invalid schema, an unsupported feature, a bad regex or grammar → ValueError, which
  the server answers with 400). vLLM: `vllm/v1/structured_output/backend_xgrammar.py`.

Why xgrammar and not llguidance: see docs/structured_outputs.md (per-step cost and coverage).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from tokenloom.config import StructuredOutputsConfig
from tokenloom.core.structured_output import compile_regex_with_timeout
from tokenloom.exceptions import ValidationError
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams, check_json_nesting

# JSON Schema string formats xgrammar generates (vLLM's list); others are refused up front.
_STRING_FORMATS = {
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
}


# How a choice is spelled inside an EBNF string literal: the literal's own escapes, and every other control
# character (C0 and DEL) as \uXXXX, so the grammar matches the choice's characters themselves. Every other
# character stays as it is (JSON's \u escapes would split a character outside the BMP into two surrogates).
_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_literal_char(ch: str) -> str:
    if ch in _EBNF_ESCAPES:
        return _EBNF_ESCAPES[ch]
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\u{ord(ch):04x}"
    return ch


def choice_as_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices`, each matched as written (vLLM's name and escaping)."""
    return "root ::= " + " | ".join('"' + "".join(map(_ebnf_literal_char, c)) + '"' for c in choices)


class XgrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XgrammarBackend:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, max_threads: int | None = None,
                 disable_any_whitespace: bool = False) -> None:
        # vocab_size is the model's (its logits' width), which may pad past the tokenizer's.
        self.vocab_size = vocab_size
        # The engine's structured_outputs_config.disable_any_whitespace (vLLM's XgrammarBackend reads it from
        # there): compact JSON for every request; a request's own flag turns it on for that request alone.
        self.disable_any_whitespace = disable_any_whitespace
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        if max_threads is None:
            # vLLM gives xgrammar 8 threads. On a small CPU that many compile threads take the cores
            # from the decode kernels' OpenMP team, whose barriers then wait on a descheduled thread:
            # on 2 cores a running stream stalled up to 0.6 s between tokens while a large schema
            # compiled. Half the cores (the compile pool's share too): no gap above ~0.2 s there.
            max_threads = min(8, max(1, (os.cpu_count() or 2) // 2))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        if kind in ("json", "json_object"):
            # The key's spec carries the whitespace choice as a prefix (see grammar_key).
            any_ws, _, schema = spec.partition("|")
            schema = schema if kind == "json" else '{"type": "object"}'
            compact = any_ws == "compact" or self.disable_any_whitespace
            return self.compiler.compile_json_schema(
                schema, any_whitespace=not compact, separators=(",", ":") if compact else None
            )
        if kind == "regex":
            return compile_regex_with_timeout(self.compiler.compile_regex, spec)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_as_grammar(json.loads(spec)))
        if kind == "grammar":
            # vLLM's rule: a grammar with no `::=` rule is Lark (xgrammar converts it), else EBNF (GBNF).
            if grammar_is_likely_lark(spec):
                return self.compiler.compile_lark(spec)
            return self.compiler.compile_grammar(spec)
        if kind == "structural_tag":
            legacy = _legacy_structural_tag(spec)
            if legacy is not None:
                return self.compiler.compile_structural_tag(*legacy)
            return self.compiler.compile_structural_tag(spec)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]) -> XgrammarMatcher:
        # Rollback (for rejected drafts) is unlimited in this xgrammar: no max_rollback_tokens.
        return XgrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_all_allowed(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].fill_(-1)

    def copy_row(self, bitmask: torch.Tensor, src: int, dst: int) -> None:
        bitmask[dst].copy_(bitmask[src])

    def allowed_token_ids(self, bitmask: torch.Tensor, index: int) -> list[int]:
        """The token ids a row allows (beam search sends them as a step's allowed_token_ids): bit i % 32 of
        int32 word i // 32 is token i, as vLLM's _bitmask_to_token_ids reads it."""
        ids = torch.arange(self.vocab_size)
        bits = (bitmask[index][ids >> 5] >> (ids & 31)) & 1
        return ids[bits.bool()].tolist()


def make_xgrammar_backend(tokenizer: Any, vocab_size: int,
                          structured_outputs_config: StructuredOutputsConfig | None = None) -> XgrammarBackend:
    """From tokenloom's Tokenizer (its Hugging Face tokenizer is `.hf`), with the engine's structured-output
    options (vLLM's engine-wide disable_any_whitespace: every JSON grammar compiles compact)."""
    compact = structured_outputs_config is not None and structured_outputs_config.disable_any_whitespace
    return XgrammarBackend(getattr(tokenizer, "hf", tokenizer), vocab_size, disable_any_whitespace=compact)


# Validation (API side, no tokenizer) -------------------------------------------------------------
def validate_structured_outputs(params: StructuredOutputsParams,
                                structured_outputs_config: StructuredOutputsConfig | None = None) -> None:
    """What a request's constraint must pass before it is queued, on an engine whose structured-output backend is
    `structured_outputs_config`'s (default auto): vLLM's SamplingParams._validate_structured_outputs, that is its
    request checks (StructuredOutputsParams.check_request), then xgrammar's (validate_xgrammar_grammar; "auto" is
    xgrammar here, with no fallback to vLLM's other backends). Raises ValidationError (a ValueError; vLLM's
    VLLMValidationError), its first words vLLM's; cheap (no vocabulary pass). A `choice` becomes the grammar it
    stands for, as in vLLM."""
    backend = structured_outputs_config.backend if structured_outputs_config is not None else "auto"
    params.check_request(backend)
    if params.whitespace_pattern is not None:
        # vLLM's field for its outlines/guidance backends; xgrammar has no whitespace regex to give it to.
        raise ValidationError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                              "(use disable_any_whitespace for compact JSON)", parameter="structured_outputs")
    _validate_for_xgrammar(params)
    if backend == "auto":
        params._backend, params._backend_was_auto = "xgrammar", True
    params.__post_init__()  # the rewritten params still hold exactly one constraint (vLLM checks it again too)


def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """vLLM's name (its backend_xgrammar.py): xgrammar's checks of a request's constraint, which request parsing
    and tool parsers run on their own, so the nesting bound is checked here too. ValidationError saying what is
    wrong; a `choice` is rewritten as its grammar."""
    if sampling_params.structured_outputs is not None:
        _validate_for_xgrammar(sampling_params.structured_outputs)


def _validate_for_xgrammar(so: StructuredOutputsParams) -> None:
    if so.regex:
        if "\x00" in so.regex:  # before xgrammar's native regex converter sees it (which does not handle it)
            raise ValidationError("structured_outputs.regex must not contain a NUL character ('\\x00')",
                                  parameter="structured_outputs")
        _validate_spec("regex", so.regex)
    if so.choice:
        grammar = choice_as_grammar(so.choice)
        try:
            xgr.Grammar.from_ebnf(grammar)
        except Exception as exc:
            raise ValidationError(f"Failed to transform choices into a grammar: {_short(exc)}") from None
        so.choice, so.grammar = None, grammar  # vLLM's: compiled (and cached) as the grammar it is
        return
    if so.json is not None:
        check_json_nesting(so.json)
        _validate_spec("json", so.json if isinstance(so.json, str) else json.dumps(so.json))
    elif so.grammar:
        _validate_spec("grammar", so.grammar)
    elif so.structural_tag:
        check_json_nesting(so.structural_tag, structural_tag=True)
        _validate_spec("structural_tag", so.structural_tag)


# Clients send the same tool or response schema with every request; checking a large schema costs
# ~0.5 ms a property (jsonschema's meta-validation), so a checked (kind, spec) is not checked again.
# Failures are not cached (lru_cache keeps no exceptions): a bad schema gets its reason every time.
@functools.lru_cache(maxsize=256)
def _validate_spec(kind: str, spec: str) -> None:
    if kind == "json":
        schema = _parse_schema(spec)
        _check_json_schema(schema)
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema))
        except Exception as exc:
            raise ValidationError(f"Failed to transform json schema into a grammar: {_short(exc)}") from None
    elif kind == "regex":
        try:
            compile_regex_with_timeout(xgr.Grammar.from_regex, spec)
        except Exception as exc:
            raise ValidationError(f"Failed to transform regex into a grammar: {_short(exc)}") from None
    elif kind == "grammar":
        lark = grammar_is_likely_lark(spec)
        try:
            grammar = xgr.Grammar.from_lark(spec) if lark else xgr.Grammar.from_ebnf(spec)
        except Exception as exc:
            syntax = "Lark (it has no '::=' rule)" if lark else "EBNF"
            raise ValidationError(f"{INVALID_GRAMMAR} (the grammar does not parse as {syntax}: {_short(exc)})"
                                  ) from None
        if _matches_nothing(grammar):
            # Compiled against the model's vocabulary it would allow no first token either: the request's
            # first sample would be refused by its own grammar (a 500 after the queue, not a 400 here).
            raise ValidationError("the grammar matches no text: its root rule never reaches a terminal (a rule "
                                  "that only refers to itself?)")
    elif kind == "structural_tag":
        try:
            legacy = _legacy_structural_tag(spec)
            if legacy is not None:
                xgr.Grammar.from_structural_tag(*legacy)
            else:
                xgr.Grammar.from_structural_tag(spec)
        except Exception as exc:
            raise ValidationError(f"{INVALID_STRUCTURAL_TAG} (invalid structural_tag: {_short(exc)})") from None


# vLLM's sentences (validate_xgrammar_grammar), which its tests match on; tokenloom's reason follows them.
INVALID_GRAMMAR = "Invalid grammar specification."
INVALID_STRUCTURAL_TAG = "Invalid structural tag specification."
UNSUPPORTED_JSON = "The provided JSON schema contains features not supported by xgrammar."


def grammar_is_likely_lark(text: str) -> bool:
    """vLLM's test (v1/structured_output/utils.py): Lark unless some line, comments (# or //) removed, has a
    `::=` rule definition. So text that is neither ("not a grammar") is read as Lark and refused as such."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in text.split("\n"))


def _legacy_structural_tag(spec: str) -> tuple[list[Any], list[str]] | None:
    """vLLM's older structural tag form, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, as
    xgrammar's (tags, triggers) arguments; None for the current form ({"type": "structural_tag", "format"})."""
    try:
        tag = json.loads(spec)
    except ValueError:
        return None  # xgrammar says what is wrong with it
    if not isinstance(tag, dict) or "structures" not in tag:
        return None
    tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]]
    return tags, tag["triggers"]


@functools.cache
def _byte_compiler() -> xgr.GrammarCompiler:
    """A compiler over a vocabulary of the 256 bytes and a stop token: any text is spelled in it, so a grammar
    that allows none of its tokens first matches no text at all, for any tokenizer."""
    bytes_vocab = [f"<0x{i:02X}>" for i in range(256)] + ["</s>"]
    info = xgr.TokenizerInfo(bytes_vocab, vocab_type=xgr.VocabType.BYTE_FALLBACK, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1)


def _matches_nothing(grammar: xgr.Grammar) -> bool:
    matcher = xgr.GrammarMatcher(_byte_compiler().compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def _parse_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValidationError(f"Invalid JSON grammar specification. (the JSON schema is not valid JSON: {exc})"
                              ) from None


def _check_json_schema(schema: Any) -> None:
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise ValidationError(f"the JSON schema must be an object, not {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValidationError(f"invalid JSON schema at {where}: {exc.message}") from None
    feature = unsupported_json_feature(schema)
    if feature:
        raise ValidationError(f"{UNSUPPORTED_JSON} (unsupported JSON schema feature: {feature})")


def unsupported_json_feature(schema: Any, path: str = "") -> str | None:
    """The first schema keyword xgrammar cannot enforce (vLLM's list), as 'path: keyword', or None."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            if found := unsupported_json_feature(item, f"{path}/{i}"):
                return found
        return None
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types or [])
    where = path or "(root)"
    if types & {"integer", "number"} and "multipleOf" in schema:
        return f"{where}: multipleOf"
    if "array" in types:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in schema:
                return f"{where}: {key}"
    if "string" in types and "format" in schema and schema["format"] not in _STRING_FORMATS:
        return f"{where}: format {schema['format']!r}"
    if "string" in types and _pattern_with_length(schema):
        return f"{where}: pattern/format together with minLength/maxLength"
    if "object" in types and (found := _unsupported_object_keywords(schema)):
        return f"{where}: {found}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) >= 2:
        return f"{where}: allOf with more than one schema"
    for key, value in schema.items():
        if (isinstance(value, (dict, list)) and key not in ("enum", "const", "examples", "default")
                and (found := unsupported_json_feature(value, f"{path}/{key}"))):
            return found
    return None


def has_xgrammar_unsupported_json_features(schema: Any) -> bool:
    """vLLM's name: whether the schema uses a keyword xgrammar would not enforce (unsupported_json_feature)."""
    return unsupported_json_feature(schema) is not None


def _pattern_with_length(schema: dict[str, Any]) -> bool:
    """A pattern or format with length bounds: xgrammar compiles the pattern and drops the bounds."""
    return ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema)


def _unsupported_object_keywords(schema: dict[str, Any]) -> str | None:
    """The combinations of object keywords xgrammar compiles wrongly (vLLM's list, each an xgrammar issue): it
    drops propertyNames beside patternProperties, properties or unevaluatedProperties, and a length bound on
    the names; it takes properties and patternProperties (or two overlapping patterns) as alternatives where
    JSON Schema wants a property to satisfy both."""
    if "propertyNames" in schema:
        names = schema["propertyNames"]
        if isinstance(names, dict) and _pattern_with_length(names):
            return "propertyNames with a pattern/format and minLength/maxLength"
        for key in ("patternProperties", "properties"):
            if key in schema:
                return f"propertyNames together with {key}"
        if schema.get("unevaluatedProperties", True) is not True:
            return "propertyNames together with unevaluatedProperties"
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict):
        if "properties" in schema:
            return "patternProperties together with properties"
        if len(patterns) > 1:
            return "more than one patternProperties pattern"
    return None


def _short(exc: Exception) -> str:
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: ": the reason is what follows.
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]
