# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/entrypoints/openai/responses/test_streaming_events.py. Plumbing changed, test
# bodies as they are: the vLLM names come from tests/peer/responses/vllm_shim.py (tokenloom's split_delta and
# DeltaMessage; vLLM's SimpleStreamingEventProcessor in front of tokenloom's ItemStream,
# tokenloom/server/responses_events.py, whose JSON events are read back as the openai SDK's event types). Left out:
# the Harmony (gpt-oss) cases (test_browser_find_uses_responses_action_type, the "harmony" parameter of
# test_reasoning_content_parts_use_sdk_events) and test_done_reported_authoritative_payload_on_mismatch, which sets
# vLLM's processor state by hand (its rule, a correcting whole resend, is checked on ItemStream in
# tests/test_responses_api.py::test_custom_tool_input_resent_whole_when_the_end_disagrees).

import pytest
from openai.types.responses import (
    CustomTool,
    ResponseCustomToolCall,
    ResponseStreamEvent,
)
from pydantic import TypeAdapter

from tests.peer.responses.vllm_shim import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    SimpleStreamingEventProcessor,
    StreamingState,
    _StateType,
    decode_custom_tool_input,
    emit_reasoning_delta_events,
    emit_reasoning_done_events,
    split_delta,
)


@pytest.mark.parametrize("harmony", [False], ids=["simple"])
def test_reasoning_content_parts_use_sdk_events(harmony):
    text = "Let me think."
    if harmony:
        state = StreamingState()
        events = emit_reasoning_delta_events(text, state)
        events.extend(emit_reasoning_done_events(text, state))
    else:
        processor = SimpleStreamingEventProcessor()
        events = _run_through_processor(processor, DeltaMessage(reasoning=text))
        events.extend(processor.close_current())

    assert [event.type for event in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    added, part_added, delta, text_done, part_done, done = events
    assert part_added.part.type == part_done.part.type == "reasoning_text"
    assert part_added.part.text == ""
    assert delta.delta == text_done.text == part_done.part.text == text
    assert done.item.content[0].text == text
    assert done.item.id == added.item.id
    for event in events[1:-1]:
        assert event.item_id == added.item.id
        assert event.content_index == part_added.content_index
    validator = TypeAdapter(ResponseStreamEvent)
    for event in events:
        assert event.output_index == added.output_index
        validator.validate_python(event.model_dump())


def _make_tool_call(
    index: int, name: str | None = None, arguments: str | None = None
) -> DeltaToolCall:
    fn = DeltaFunctionCall(name=name, arguments=arguments)
    return DeltaToolCall(index=index, function=fn)


class TestSplitDelta:
    def test_all_three_fields(self):
        tc = _make_tool_call(0, name="f")
        delta = DeltaMessage(reasoning="r", content="c", tool_calls=[tc])
        result = split_delta(delta)

        assert len(result) == 3
        assert result[0].reasoning == "r" and result[0].content is None
        assert result[1].content == "c" and result[1].reasoning is None
        assert len(result[2].tool_calls) == 1 and result[2].content is None

    def test_tool_calls_grouped_by_index(self):
        tc0 = _make_tool_call(0, name="f1")
        tc1 = _make_tool_call(1, name="f2")
        tc0b = _make_tool_call(0, arguments='{"a":1}')

        # Different indices → split
        result = split_delta(DeltaMessage(tool_calls=[tc0, tc1]))
        assert len(result) == 2
        assert result[0].tool_calls == [tc0]
        assert result[1].tool_calls == [tc1]

        # Same index → stays together
        delta = DeltaMessage(tool_calls=[tc0, tc0b])
        result = split_delta(delta)
        assert len(result) == 1
        assert result[0] is delta


def _run_through_processor(
    processor: SimpleStreamingEventProcessor,
    delta_message: DeltaMessage,
) -> list:
    """Simulate the streaming loop from serving.py for a single delta."""
    events = []
    for dm in split_delta(delta_message):
        target_state, tool_call = processor.resolve_target_state(dm)
        if target_state == _StateType.NONE:
            continue
        if processor.needs_transition(target_state, tool_call):
            events.extend(processor.close_current())
            events.extend(processor.open(target_state, tool_call))
        events.extend(processor.emit_delta(dm, None))
    return events


class TestProcessorCompoundDeltas:
    def test_all_three_states(self):
        tc = _make_tool_call(0, name="f", arguments="{}")
        delta = DeltaMessage(reasoning="r", content="c", tool_calls=[tc])

        processor = SimpleStreamingEventProcessor()
        events = _run_through_processor(processor, delta)

        types = [e.type for e in events]
        r_idx = types.index("response.reasoning_text.delta")
        c_idx = types.index("response.output_text.delta")
        fc_idx = types.index("response.function_call_arguments.delta")
        assert r_idx < c_idx < fc_idx

    def test_parallel_tool_calls(self):
        tc0 = _make_tool_call(0, name="f1", arguments='{"a":1}')
        tc1 = _make_tool_call(1, name="f2", arguments='{"b":2}')
        delta = DeltaMessage(tool_calls=[tc0, tc1])

        processor = SimpleStreamingEventProcessor()
        events = _run_through_processor(processor, delta)

        added = [e for e in events if e.type == "response.output_item.added"]
        deltas = [
            e for e in events if e.type == "response.function_call_arguments.delta"
        ]
        assert len(added) == 2
        assert len(deltas) == 2

    def test_split_name_and_args_same_index(self):
        """Regression: parsers like KimiK2 emit name and args as separate
        DeltaToolCalls at the same index within one DeltaMessage."""
        tc_name = _make_tool_call(0, name="get_weather")
        tc_args = _make_tool_call(0, arguments='{"city":"SF"}')
        delta = DeltaMessage(tool_calls=[tc_name, tc_args])

        processor = SimpleStreamingEventProcessor()
        events = _run_through_processor(processor, delta)

        deltas = [
            e for e in events if e.type == "response.function_call_arguments.delta"
        ]
        assert len(deltas) == 1
        assert deltas[0].delta == '{"city":"SF"}'

    def test_reasoning_to_content_transition(self):
        """Regression: the old special case in emit_delta handled this;
        now split_delta handles it generically."""
        processor = SimpleStreamingEventProcessor()
        _run_through_processor(processor, DeltaMessage(reasoning="think"))
        assert processor.state.current_state == _StateType.REASONING

        events = _run_through_processor(
            processor, DeltaMessage(reasoning="more", content="answer")
        )
        types = [e.type for e in events]
        assert "response.reasoning_text.delta" in types
        assert "response.output_text.delta" in types


class TestSimpleToolCallShapes:
    def test_arguments_done_emitted_without_deltas(self):
        processor = SimpleStreamingEventProcessor()
        events = _run_through_processor(
            processor, DeltaMessage(tool_calls=[_make_tool_call(0, name="noop")])
        )
        events += processor.close_current()
        assert [e.type for e in events] == [
            "response.output_item.added",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]


class TestCustomToolStreaming:
    def test_custom_tool_input_events(self):
        processor = SimpleStreamingEventProcessor(
            tools=[CustomTool(type="custom", name="emit_command")]
        )
        events = _run_through_processor(
            processor,
            DeltaMessage(
                tool_calls=[
                    _make_tool_call(0, name="emit_command", arguments='{"input": "ls ')
                ]
            ),
        )
        events += _run_through_processor(
            processor,
            DeltaMessage(tool_calls=[_make_tool_call(0, arguments='-la \\"x\\""}')]),
        )
        events += processor.close_current()

        assert [e.type for e in events] == [
            "response.output_item.added",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done",
            "response.output_item.done",
        ]
        done = events[-1].item
        assert isinstance(done, ResponseCustomToolCall)
        assert done.input == 'ls -la "x"'
        assert "".join(e.delta for e in events[1:3]) == done.input
        assert events[3].input == done.input
        assert events[0].item.type == "custom_tool_call"
        assert events[0].item.id == done.id
        assert done.id.startswith("ctc_")
        assert events[0].item.call_id == done.call_id

    def test_unrelated_keys_are_not_streamed_as_payload(self):
        """Review repro: chunks of an object whose input key arrives last must
        not leak fragments of other keys into the payload."""
        processor = SimpleStreamingEventProcessor(
            tools=[CustomTool(type="custom", name="emit_command")]
        )
        events = _run_through_processor(
            processor,
            DeltaMessage(
                tool_calls=[
                    _make_tool_call(0, name="emit_command", arguments='{"a": "xy"')
                ]
            ),
        )
        events += _run_through_processor(
            processor,
            DeltaMessage(
                tool_calls=[_make_tool_call(0, arguments=', "input": "hello"}')]
            ),
        )
        events += processor.close_current()

        deltas = [
            e for e in events if e.type == "response.custom_tool_call_input.delta"
        ]
        done_input = next(
            e for e in events if e.type == "response.custom_tool_call_input.done"
        ).input
        item = events[-1].item
        assert "".join(e.delta for e in deltas) == "hello"  # "xy" never leaks
        assert done_input == "hello"
        assert item.input == "hello"
        assert decode_custom_tool_input('{"a": "xy", "input": "hello"}') == "hello"
