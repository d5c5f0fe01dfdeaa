"""Output items and their streamed events (responses_output.py): driven with hand-made chat
deltas, no model. The events, put together as the official client does, give the same items."""

from __future__ import annotations

from typing import Any

from vlmserve.api.chat_output import ChatParsing
from vlmserve.api.responses_output import OutputWriter, whole_output
from vlmserve.api.tool_calling import ChatTool, FunctionDefinition


def assembled(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items as a client builds them from the events (each delta appended)."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = dict(e["item"])
        elif e["type"] == "response.content_part.added":
            items[e["output_index"]].setdefault("content", []).append(dict(e["part"]))
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            assert e["item"]["id"] == items[e["output_index"]]["id"]
            items[e["output_index"]] |= {"status": e["item"]["status"]}
    return [items[i] for i in sorted(items)]


def test_reasoning_text_and_calls_stream_as_items_in_order() -> None:
    writer = OutputWriter()
    deltas = [
        {"reasoning_content": "Let me "},
        {"reasoning_content": "think.", "content": "Calling"},
        {"content": " now."},
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
        {
            "tool_calls": [
                {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}
            ]
        },
    ]
    events = [event for delta in deltas for event in writer.feed(delta)]
    events += writer.close("completed")
    items = writer.items
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert items[1]["content"][0]["text"] == "Calling now."
    assert [(c["call_id"], c["name"], c["arguments"]) for c in items[2:]] == [
        ("call_a", "f", '{"x": 1}'),
        ("call_b", "g", "{}"),
    ]
    assert all(item["status"] == "completed" for item in items)
    built = assembled(events)
    assert [b.get("content", b.get("arguments")) for b in built] == [
        i.get("content", i.get("arguments")) for i in items
    ]
    dones = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in dones] == items and [e["output_index"] for e in dones] == [0, 1, 2, 3]
    (arguments_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"][:1]
    assert arguments_done["arguments"] == '{"x": 1}' and arguments_done["item_id"] == items[2]["id"]


def test_an_answer_cut_short_leaves_its_last_item_incomplete_and_an_empty_one_a_message() -> None:
    writer = OutputWriter()
    writer.feed({"content": "Par"})
    writer.close("incomplete")
    assert writer.items[0]["status"] == "incomplete"
    empty = OutputWriter()
    events = empty.close("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert empty.items[0]["content"][0]["text"] == ""


def test_a_whole_answer_gives_the_items_a_stream_gives() -> None:
    tools = [ChatTool(function=FunctionDefinition(name="f"))]
    parsing = ChatParsing.for_request(tools, "auto", None, True, True, "qwen3", "hermes", True)
    text = 'Hmm</think>Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    message, _ = parsing.message(text, "stop")
    whole = whole_output(message, "completed")
    writer, stream = OutputWriter(), parsing.stream()
    for i, piece in enumerate([text[:5], text[5:30], text[30:]]):
        writer.feed(stream.feed(piece, final=i == 2))
    writer.close("completed")

    def shown(items: list[dict[str, Any]]) -> list[Any]:
        return [(i["type"], i.get("content"), i.get("name"), i.get("arguments")) for i in items]

    assert shown(whole) == shown(writer.items)
    assert shown(whole) == [
        ("reasoning", [{"type": "reasoning_text", "text": "Hmm"}], None, None),
        ("message", [{"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}], None, None),
        ("function_call", None, "f", '{"x": 1}'),
    ]
