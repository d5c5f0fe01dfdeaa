"""A Responses request's conversation as chat messages and the chat request it runs as
(responses_protocol.py), and the bounded store (response_store.py): driven directly, no server."""

from __future__ import annotations

import pytest

from vlmserve.api.response_store import ResponseStore
from vlmserve.api.responses_protocol import ResponsesRequest, conversation_messages
from vlmserve.errors import APIError

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}', "id": "fc_1"}


def test_items_become_the_chat_messages_of_one_conversation() -> None:
    items = [
        {"role": "developer", "content": "Be terse."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look:"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
            ],
        },
        # An earlier answer as the output items it came as: reasoning, text, two calls.
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        CALL,
        CALL | {"call_id": "call_2", "name": "g"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"},
    ]
    assert conversation_messages(items) == [
        {"role": "system", "content": "Be terse."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Calling.",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"},
    ]


def test_a_second_assistant_text_is_a_message_of_its_own() -> None:
    items = [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert conversation_messages(items) == [
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"type": "item_reference", "id": "x"}, "input[1]: item type 'item_reference' is not served"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[1].content[0]: input_file"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "max"}]}, "detail must be"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input[1].arguments must be a string"),
        ({"role": "user", "content": 5}, "input[1].content must be a string or a list"),
    ],
)
def test_a_bad_item_is_named_by_its_index(item: dict, words: str) -> None:
    with pytest.raises(APIError) as e:
        conversation_messages([{"role": "user", "content": "hi"}, item])
    assert words in e.value.message and e.value.param == "input"


def test_the_request_runs_as_a_chat_request() -> None:
    body = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "instructions": "Be kind.",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "reasoning": {"effort": "low"},
            "top_k": 5,
        }
    )
    chat = body.chat_request(body.input_items())
    assert chat.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.reasoning_effort) == (7, 0.5, 5, "low")
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "f"  # type: ignore[union-attr]
    assert chat.parallel_tool_calls is False
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    formatted = ResponsesRequest.model_validate(
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    )
    fmt = formatted.chat_request(formatted.input_items()).response_format
    assert fmt is not None and fmt.json_schema is not None and fmt.json_schema.json_schema == schema


def test_a_chat_error_names_the_responses_field() -> None:
    body = ResponsesRequest.model_validate(
        {"input": "hi", "text": {"format": {"type": "json_object"}}, "guided_json": {}}
    )
    # guided_json is not passed on (it is not a Responses field): ignored, the format is the one asked.
    assert body.chat_request(body.input_items()).response_format.type == "json_object"  # type: ignore[union-attr]
    tools = [{"type": "function", "name": "f"}]
    bad = ResponsesRequest.model_validate(
        {"input": "hi", "tools": tools, "tool_choice": {"type": "function", "name": "g"}}
    )
    with pytest.raises(APIError) as e:
        bad.chat_request(bad.input_items())
    assert e.value.param == "tool_choice" and "'g' is not among `tools`" in e.value.message


def test_the_store_keeps_the_newest_within_count_and_bytes() -> None:
    def response(i: int, size: int = 0) -> dict:
        return {"id": f"resp_{i}", "pad": "x" * size}

    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for i in range(3):
        store.put(response(i), [{"role": "user", "content": str(i)}])
    with pytest.raises(APIError) as e:
        store.get("resp_0", "previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    assert "'resp_0' not found" in e.value.message and "2 most recent" in e.value.message
    assert store.get("resp_2", "response_id").conversation == [{"role": "user", "content": "2"}]
    assert len(store) == 2
    # Bytes: a large one evicts as many of the oldest as it needs; one over the bound is not kept.
    store.put(response(3, 6_000), [])
    assert len(store) == 2 and store.nbytes <= 10_000
    store.put(response(4, 6_000), [])
    assert [store.get(f"resp_{i}", "x").response["id"] for i in (4,)] == ["resp_4"] and len(store) == 1
    store.put(response(5, 20_000), [])
    with pytest.raises(APIError):
        store.get("resp_5", "response_id")
    assert store.get("resp_4", "response_id").nbytes == store.nbytes
