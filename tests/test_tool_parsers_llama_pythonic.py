"""The llama3_json and pythonic tool parsers and the JSON forms of forced calls beyond vLLM 0.32's own
parser tests (vendored and run as they are in tests/peer/tool_parsers/): streamed pieces that must
concatenate to the whole response, malformed output that must stay content, the start-up tokenizer check
with vLLM's words, the structural tags that force llama calls, and vLLM's required-call cases
(tests/tool_use/test_tool_choice_required.py) on tokenloom's JSON forms."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest

from tokenloom.server.errors import APIError
from tokenloom.server.structured import structured_outputs_of
from tokenloom.server.tool_calls import StreamingToolParser, parse_output
from tokenloom.server.tool_parsers import ToolParserTokenizerError, check_tokenizer
from tokenloom.server.tool_parsers.json_calls import json_schema_from_tools, required_call_deltas
from tokenloom.server.tool_parsers.llama import Llama3JsonToolParser
from tokenloom.server.tool_parsers.messages import delta_dict
from tokenloom.server.tool_parsers.pythonic import PythonicToolParser
from tokenloom.server.tools import tool_setup


class Vocab:
    """A tokenizer as far as a parser's constructor reads it."""

    def __init__(self, *tokens: str) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


LLAMA_VOCAB = Vocab("<|python_tag|>")


class Reconstructor:
    """vLLM's StreamingToolReconstructor (tests/tool_parsers/utils.py): its checks on every delta."""

    def __init__(self, one_tool_per_delta: bool = True) -> None:
        self.calls: list[dict] = []
        self.content = ""
        self.one_tool_per_delta = one_tool_per_delta

    def append(self, delta: dict) -> None:
        if delta.get("content") is not None:
            self.content += delta["content"]
        else:
            assert delta.get("tool_calls"), "a delta has content or tool calls (or both)"
        tool_calls = delta.get("tool_calls") or []
        if self.one_tool_per_delta:
            assert len(tool_calls) < 2, "one tool call per update"
        for tc in tool_calls:
            assert tc.get("type") in (None, "function")
            fn = tc.get("function") or {}
            if tc["index"] < len(self.calls):
                assert not fn.get("name") and not tc.get("id"), "name and id only once"
                assert tc["index"] == len(self.calls) - 1, "arguments of an earlier call"
                self.calls[tc["index"]]["arguments"] += fn.get("arguments") or ""
            else:
                assert tc.get("id") and fn.get("name"), "id and name on first appearance"
                assert tc["index"] == len(self.calls)
                self.calls.append({"name": fn["name"], "arguments": fn.get("arguments") or ""})


def run_streaming(parser, deltas: list[str], one_tool_per_delta: bool = True) -> Reconstructor:
    """The parser alone, as vLLM's run_tool_extraction_streaming drives it."""
    rec = Reconstructor(one_tool_per_delta)
    previous = ""
    for delta in deltas:
        current = previous + delta
        message = parser.extract_tool_calls_streaming(previous, current, delta, [], [], [], None)
        if message is not None:
            rec.append(delta_dict(message))
        previous = current
    return rec


def run_served(parser_name: str, deltas: list[str], one_tool_per_delta: bool = True) -> Reconstructor:
    """As the server streams: the last delta is final, and gets what the parser parsed but did not send
    (vLLM's finalize_generation: get_remaining_unstreamed_args)."""
    setup = tool_setup([{"type": "function", "function": {"name": "f"}}], "auto", None, parser_name)
    setup.tokenizer = LLAMA_VOCAB
    parser = StreamingToolParser(setup)
    rec = Reconstructor(one_tool_per_delta)
    for i, delta in enumerate(deltas):
        message = parser.feed(delta, i == len(deltas) - 1)
        if message is not None:
            rec.append(message)
    return rec


@pytest.fixture(scope="module")
def token_deltas():
    """vLLM's split_string_into_token_deltas, on the default model's tokenizer."""
    from tokenloom.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)

    def split(text: str) -> list[str]:
        ids = tok.encode(text, add_special_tokens=False)
        out, prev = [], ""
        for i in range(1, len(ids) + 1):
            cur = tok.decode(ids[:i])
            out.append(cur[len(prev):])
            prev = cur
        return out

    return split


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def small_pieces(text: str, rng: random.Random, most: int = 8) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def whole(parser_cls, text: str):
    info = parser_cls(LLAMA_VOCAB).extract_tool_calls(text, None)
    assert info.tools_called == bool(info.tool_calls)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


# llama3_json ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "This is just some text without any tool calls",
    '{"name": "invalidTool", "parameters": {invalid json}',
    '{"parameters": {}}',  # no name
    '{"name": "toolWithoutParams"}',  # neither parameters nor arguments
    'Sure: {"name": "a", "parameters": {}}; {"oops": 1}',  # one bad object: all of it is content
    '{"name": 5, "parameters": {}}',  # a name that is not a string
])
def test_llama_malformed_output_is_content(text: str) -> None:
    assert whole(Llama3JsonToolParser, text) == (text, [])


LLAMA_STREAMS = [
    '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}',
    '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "searchTool", "parameters": {"query": "a {b} \\"c\\"", "n": [1, 2.5, null, true]}}; '
    '{"name": "getOpenIncidentsTool", "parameters": {}}; '
    '{"name": "searchTool", "parameters": {"query": "test2", "deep": {"x": {"y": [{"z": "w"}]}}}}',
]


@pytest.mark.parametrize("text", LLAMA_STREAMS)
def test_llama_streamed_pieces_concatenate_to_the_whole(text: str, token_deltas) -> None:
    content, calls = whole(Llama3JsonToolParser, text)
    assert content is None and calls
    rng = random.Random(1)
    # <|python_tag|> is one special token in a Llama vocabulary: it arrives whole, never in pieces.
    bot = "<|python_tag|>" if text.startswith("<|python_tag|>") else ""
    rest = text[len(bot):]
    # Deltas of a few tokens at most: vLLM's llama streaming moves one call at a time, so a delta that
    # holds a whole call and the start of the next skips that call's announcement (as in vLLM).
    for pieces in [token_deltas(rest), list(rest), *(small_pieces(rest, rng) for _ in range(20))]:
        pieces = [bot, *pieces] if bot else pieces
        rec = run_served("llama3_json", pieces, one_tool_per_delta=True)
        assert rec.content == ""
        # json.dumps of the parsed arguments, exactly what the whole response gives; except that vLLM
        # never streams an empty arguments object of a call that is not the last (`if cur_arguments:`).
        assert [(c["name"], c["arguments"] or "{}") for c in rec.calls] == calls, pieces


def test_llama_streaming_plain_text_is_content_and_names_are_sent_whole(token_deltas) -> None:
    text = "Paris is sunny today."
    assert run_streaming(Llama3JsonToolParser(LLAMA_VOCAB), token_deltas(text)).content == text
    parser = Llama3JsonToolParser(LLAMA_VOCAB)
    previous, names = "", []
    for piece in list('{"name": "get_weather", "parameters": {"city": "Paris"}}'):
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(previous, current, piece, [], [], [], None)
        names += [tc.function.name for tc in (delta.tool_calls if delta else []) if tc.function.name]
        previous = current
    assert names == ["get_weather"]  # never "get_w", "get_wea", ...


def test_llama_malformed_stream_sends_no_arguments() -> None:
    # vLLM's streaming announces the name as soon as it is complete; the arguments that never parse
    # are never sent (each chunk is skipped), and nothing crashes. The whole response is content.
    text = '{"name": "invalidTool", "parameters": {invalid json}'
    rec = run_streaming(Llama3JsonToolParser(LLAMA_VOCAB), list(text))
    assert [(c["name"], c["arguments"]) for c in rec.calls] == [("invalidTool", "")]
    assert rec.content == ""


# pythonic -----------------------------------------------------------------------------------
SIMPLE = ("get_weather(city='San Francisco', metric='celsius')",
          ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'))
MORE_TYPES = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
              "role=None, passed_test=True, aliases=['John', 'Johnny'])",
              ("register_user", '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", '
                                '"state": "CA"}, "role": null, "passed_test": true, "aliases": ["John", "Johnny"]}'))
PARAMETERLESS = ("get_weather()", ("get_weather", "{}"))
EMPTY_DICT = ("do_something_cool(additional_data={})", ("do_something_cool", '{"additional_data": {}}'))
EMPTY_LIST = ("do_something_cool(steps=[])", ("do_something_cool", '{"steps": []}'))
ESCAPED = (r"get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')",
           ("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}'))


def test_pythonic_streamed_pieces_concatenate_to_the_whole() -> None:
    text = f"[{SIMPLE[0]}, {MORE_TYPES[0]}, {ESCAPED[0]}, weather.get(lat=-12.5, tags={{'a', 'b'}})]"
    content, calls = whole(PythonicToolParser, text)
    assert content is None and calls[-1] == ("weather.get", '{"lat": -12.5, "tags": ["a", "b"]}')
    rng = random.Random(2)
    for pieces in [list(text), *(random_pieces(text, rng) for _ in range(30))]:
        rec = run_served("pythonic", pieces, one_tool_per_delta=False)
        assert [(c["name"], c["arguments"]) for c in rec.calls] == calls, pieces


@pytest.mark.parametrize("text", [
    "Sure! [get_weather(city='Paris')]",  # text before the list: content (vLLM)
    "[get_weather('Paris')]",  # a positional argument
    "[get_weather(city=paris)]",  # a variable
    "[get_weather(city='Paris'), 42]",
    "[get_weather(city='Paris'",  # cut off
    "[]",
])
def test_pythonic_malformed_output_is_content(text: str) -> None:
    assert whole(PythonicToolParser, text) == (text, [])


# The start-up check ---------------------------------------------------------------------------------
def test_start_up_refuses_a_parser_whose_token_the_tokenizer_lacks() -> None:
    from tokenloom.model.tokenizer import load_tokenizer

    smol = load_tokenizer(None)
    with pytest.raises(ToolParserTokenizerError) as err:
        check_tokenizer("llama3_json", smol, "SmolLM2-135M-Instruct")
    assert str(err.value) == ("--tool-call-parser llama3_json cannot be used with the tokenizer of "
                              "'SmolLM2-135M-Instruct': Llama3JsonToolParser could not locate the bot token "
                              "'<|python_tag|>' in the tokenizer.")
    with pytest.raises(ToolParserTokenizerError, match=r"^--tool-call-parser mistral cannot be used with the "
                       r"tokenizer of 'm': Mistral parser could not locate the tool call token in the tokenizer!$"):
        check_tokenizer("mistral", smol, "m")
    for name in ("hermes", "qwen3_json", "pythonic"):
        check_tokenizer(name, smol, "m")
    check_tokenizer("llama4_json", Vocab("<|python_tag|>", "a"), "m")  # a Llama vocabulary passes
    check_tokenizer("mistral", Vocab("[TOOL_CALLS]"), "m")  # a Mistral vocabulary passes


# Forced calls: llama's structural tag ---------------------------------------------------------------
from tests.test_tool_parsers import NAMED, TIME, WEATHER  # noqa: E402  (the parser tests' tools)


def _accepts(so, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(so.structural_tag), text)


def test_llama_required_and_named_are_forced_with_xgrammars_llama_tag() -> None:
    setup = tool_setup([WEATHER, TIME], "required", None, "llama3_json")
    setup.tokenizer = LLAMA_VOCAB
    so = structured_outputs_of({}, setup)
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = one + '{"name": "get_time", "parameters": {"tz": "CET"}}'
    assert _accepts(so, one) and _accepts(so, two) and not _accepts(so, "Sure.")
    assert not _accepts(so, one.replace("get_weather", "get_wether"))
    assert not _accepts(so, '{"name": "get_time", "parameters": {"zone": 1}}')  # strict tool: its schema
    # A forced call fits the tool's schema, strict or not (issue 35).
    assert not _accepts(so, '{"name": "get_weather", "parameters": [1]}')
    # What the grammar lets through, the parser reads back: calls, content "". Calls written back to back
    # stay content, as in vLLM (its raw_decode loop skips a `{` right at the previous object's end).
    assert _accepts(so, one + "; " + two[len(one):])
    assert parse_output(two, setup) == (two, [])
    content, calls = parse_output(one + "; " + two[len(one):], setup)
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    single = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", False, "llama3_json"))
    assert _accepts(single, one) and not _accepts(single, two)
    named = structured_outputs_of({"response_format": {"type": "json_object"}},
                                  tool_setup([WEATHER, TIME], NAMED, None, "llama3_json"))
    assert _accepts(named, one) and not _accepts(named, two) and not _accepts(named, '{"a": 1}')
    assert not _accepts(named, '{"name": "get_time", "parameters": {"tz": "CET"}}')
    # auto: free unless a tool is strict (then free text, and a call after `{"name": ` is held to it).
    assert structured_outputs_of({}, tool_setup([WEATHER], "auto", None, "llama3_json")) is None
    auto = structured_outputs_of({}, tool_setup([WEATHER, TIME], "auto", None, "llama3_json"))
    assert _accepts(auto, "Just text.") and not _accepts(auto, 'x {"name": "get_time", "parameters": {}}')


def test_llama_forced_call_streams_as_the_whole_response() -> None:
    setup = tool_setup([WEATHER, TIME], "required", None, "llama3_json")
    setup.tokenizer = LLAMA_VOCAB
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}'
    _, calls = parse_output(text, setup)
    parser = StreamingToolParser(setup)
    deltas = [d for i, ch in enumerate(text) if (d := parser.feed(ch, i == len(text) - 1))]
    rec = Reconstructor(one_tool_per_delta=True)
    for d in deltas:
        rec.append(d)
    assert [(c["name"], c["arguments"]) for c in rec.calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert parser.finish_reason("stop") == "tool_calls"


# Forced calls: vLLM's JSON forms (pythonic) ---------------------------------------------------------
EXAMPLE_TOOLS = [
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Get the weather forecast for a given location",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city", "days"], "additionalProperties": False}}},
]
VALID = [
    [{"name": "get_current_weather", "parameters": {"city": "Vienna"}}],
    [{"name": "get_current_weather", "parameters": {"city": "Vienna"}},
     {"name": "get_current_weather", "parameters": {"city": "Berlin"}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}},
     {"name": "get_current_weather", "parameters": {"city": "Vienna"}},
     {"name": "get_forecast", "parameters": {"city": "Berlin", "days": 7}}],
]
INVALID = [None, [], {}, [{}], [{"name": "get_current_weather"}],
           [{"name": "get_current_weather", "parameters": {}}],
           [{"name": "get_current_weather", "parameters": None}],
           {"name": "get_current_weather", "parameters": {"city": "Vienna"}},
           [{"name": "get_current_weather", "parameters": {"city": "Vienna", "extra": "value"}}],
           [{"name": "get_forecast", "parameters": {"city": "Vienna"}}],
           [{"name": "get_weather", "parameters": {"city": "Vienna", "days": 7}}],
           [{"name": "get_current_weather", "parameters": {"city": "Vienna"}}, {}]]


def _json_so(tools, choice, parallel=None):
    so = structured_outputs_of({"response_format": {"type": "json_object"}},
                               tool_setup(tools, choice, parallel, "pythonic"))
    assert so is not None and so.json is not None and so.structural_tag is None
    return so.json


def test_required_json_schema_is_vllms() -> None:
    schema = _json_so(EXAMPLE_TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    for sample in VALID:
        jsonschema.validate(sample, schema)
    for sample in INVALID:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(sample, schema)
    single = _json_so(EXAMPLE_TOOLS, "required", False)
    jsonschema.validate(VALID[0], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(VALID[1], single)
    # A named function: its arguments object alone; no parameters: an empty object.
    assert _json_so(EXAMPLE_TOOLS, {"type": "function", "function": {"name": "get_forecast"}}) == \
        EXAMPLE_TOOLS[1]["function"]["parameters"]
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert _json_so(bare, {"type": "function", "function": {"name": "ping"}}) == {"type": "object", "properties": {}}
    # auto is never constrained for a parser without a structural tag.
    assert structured_outputs_of({}, tool_setup(EXAMPLE_TOOLS, "auto", None, "pythonic")) is None


def test_required_json_schema_merges_defs_and_refuses_conflicts() -> None:
    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}}}

    schema = _json_so([tool("a", {"P": {"type": "string"}}), tool("b", {"P": {"type": "string"}})], "required")
    assert schema["$defs"] == {"P": {"type": "string"}}
    jsonschema.validate([{"name": "a", "parameters": {"p": "x"}}], schema)
    with pytest.raises(APIError, match="Tool definition 'P' has multiple schemas, which is not supported.") as err:
        structured_outputs_of({}, tool_setup([tool("a", {"P": {"type": "string"}}),
                                              tool("b", {"P": {"type": "integer"}})], "required", None, "pythonic"))
    assert err.value.status == 400
    with pytest.raises(KeyError):  # the request's tools are left as they were
        json_schema_from_tools({"a": tool("a", {"P": {}})["function"]}, "required", None, True)["$defs"]["Q"]


def test_json_forms_read_back_whole() -> None:
    required = tool_setup(EXAMPLE_TOOLS, "required", None, "pythonic")
    content, calls = parse_output(json.dumps(VALID[3]), required)
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(v["name"], v["parameters"]) for v in VALID[3]]
    assert parse_output("[{oops", required) == ("", [])  # vLLM: a validation error means no calls
    assert parse_output(json.dumps(VALID[1]), tool_setup(EXAMPLE_TOOLS, "required", False, "pythonic"))[1][0][
        "function"]["arguments"] == '{"city": "Vienna"}'
    named = tool_setup(EXAMPLE_TOOLS, {"type": "function", "function": {"name": "get_forecast"}}, None, "pythonic")
    content, [call] = parse_output('{"city": "Oslo",  "days": 2}', named)
    # The model's own text of the arguments (vLLM does not re-serialise a named call).
    assert content == "" and call["function"] == {"name": "get_forecast", "arguments": '{"city": "Oslo",  "days": 2}'}
    assert parse_output("  ", named) == ("", [])


def _stream_required(text: str, deltas: list[str]) -> list[dict]:
    assert "".join(deltas) == text
    rec = Reconstructor(one_tool_per_delta=False)
    previous = ""
    for d in deltas:
        current = previous + d
        msg = required_call_deltas(previous, current)
        if msg is not None:
            for tc in msg["tool_calls"]:
                assert tc.get("id") or tc["function"]["arguments"]
            # vLLM's required streaming may touch an earlier call and start a later one in one delta.
            for tc in msg["tool_calls"]:
                fn = tc["function"]
                if "id" in tc:
                    assert tc["index"] == len(rec.calls) and fn["name"]
                    rec.calls.append({"name": fn["name"], "arguments": fn["arguments"]})
                else:
                    assert tc["index"] < len(rec.calls) and "name" not in fn
                    rec.calls[tc["index"]]["arguments"] += fn["arguments"]
        previous = current
    return rec.calls


def _assert_streams_to(output: list[dict], deltas: list[str]) -> None:
    calls = _stream_required(json.dumps(output), deltas)
    assert [{"name": c["name"], "parameters": json.loads(c["arguments"])} for c in calls] == output
    assert [c["arguments"] for c in calls] == [json.dumps(o["parameters"]) for o in output]


@pytest.mark.parametrize("output", VALID)
@pytest.mark.parametrize("empty_params", [False, True])
@pytest.mark.parametrize("delta_len", [1, 2, 3, 5, 8, 13])
def test_required_streaming_output_valid(output, empty_params, delta_len) -> None:
    output = copy.deepcopy(output)
    if empty_params:
        output = [{"name": o["name"], "parameters": {}} for o in output]
    text = json.dumps(output)
    _assert_streams_to(output, [text[i:i + delta_len] for i in range(0, len(text), delta_len)])


@pytest.mark.parametrize("city", ["a { b", "a } b", "a }} b", 'a " } b', r"a \ } b",
                                  '"}}, {"name": "get_forecast", "parameters": {"city": "x'])
@pytest.mark.parametrize("delta_len", [1, 2, 3, 8, 9999])
def test_required_streaming_braces_in_strings(city, delta_len) -> None:
    output = [{"name": "get_current_weather", "parameters": {"city": city}},
              {"name": "get_forecast", "parameters": {"city": city, "days": 1}}]
    text = json.dumps(output)
    _assert_streams_to(output, [text[i:i + delta_len] for i in range(0, len(text), delta_len)])


def test_required_streaming_edges() -> None:
    two = [{"name": "get_current_weather", "parameters": {"city": "Dallas"}},
           {"name": "get_forecast", "parameters": {"city": "Dallas", "days": 3}}]
    text = json.dumps(two)
    _assert_streams_to(two, [text[:1], text[1:]])  # several calls completed in one delta
    _assert_streams_to(two, [text])
    boundary = text.index("}, {") + 1
    name_end = text.index('"get_forecast"') + 6
    for cuts in ([boundary - 1, name_end], [boundary - 2, boundary + 2], [boundary + 2]):
        bounds = [0, *cuts, len(text)]
        _assert_streams_to(two, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    trailing = json.dumps(two[:1]) + "\nDONE"
    assert [c["name"] for c in _stream_required(trailing, [trailing[i:i + 3] for i in range(0, len(trailing), 3)])] \
        == ["get_current_weather"]
    bad = '[{"name": "bad\\x", "parameters": {"city": "x"}}]'
    assert _stream_required(bad, [bad[i:i + 4] for i in range(0, len(bad), 4)]) == []


def test_json_forms_through_the_streaming_parser() -> None:
    required = tool_setup(EXAMPLE_TOOLS, "required", None, "pythonic")
    text = json.dumps(VALID[1])
    parser = StreamingToolParser(required)
    deltas = [d for i, ch in enumerate(text) if (d := parser.feed(ch, i == len(text) - 1))]
    assert [(c["name"], c["arguments"]) for c in _collect(deltas)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in parse_output(text, required)[1]]
    assert parser.finish_reason("stop") == "tool_calls"
    named = tool_setup(EXAMPLE_TOOLS, {"type": "function", "function": {"name": "get_forecast"}}, None, "pythonic")
    text = '{"city": "Oslo", "days": 2}'
    parser = StreamingToolParser(named)
    deltas = [d for i, ch in enumerate(text) if (d := parser.feed(ch, i == len(text) - 1))]
    assert [(c["name"], c["arguments"]) for c in _collect(deltas)] == [("get_forecast", text)]
    assert parser.finish_reason("stop") == "stop"


def _collect(deltas: list[dict]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            fn = tc["function"]
            if "id" in tc:
                assert tc["index"] not in calls
                calls[tc["index"]] = {"name": fn["name"], "arguments": ""}
            calls[tc["index"]]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
