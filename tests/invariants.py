"""What every client stream from the gateway must satisfy (openai-responses-contract.md §5, §8, §9)."""

from __future__ import annotations

from typing import Any

TERMINALS = ("response.completed", "response.incomplete", "response.failed")


def check_stream(events: list[dict[str, Any]], request: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assert the contract on a parsed client stream; return a summary (items, custom inputs, terminal)."""
    assert events, "empty stream"
    assert events[0]["type"] == "response.created", events[0]["type"]
    assert events[1]["type"] == "response.in_progress", events[1]["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), "sequence numbers not 0..n-1"
    terminals = [i for i, e in enumerate(events) if e["type"] in TERMINALS]
    assert terminals == [len(events) - 1], f"exactly one terminal event, last: {terminals}"
    resp_id = events[0]["response"]["id"]
    for e in (events[0], events[1], events[-1]):
        assert e["response"]["id"] == resp_id, "response id changed"
    assert events[0]["response"]["output"] == []

    added: list[dict[str, Any]] = []
    done: dict[int, dict[str, Any]] = {}
    custom_deltas: dict[int, list[str]] = {}
    custom_done: dict[int, str] = {}
    for e in events[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert e["output_index"] == len(added), f"output_index {e['output_index']} != {len(added)}"
            item = e["item"]
            assert item.get("id"), "added item without id"
            if item["type"] in ("function_call", "custom_tool_call"):
                assert item.get("call_id"), "call without call_id"
                assert item.get("name"), "call without name"
            if item["type"] == "function_call":
                assert item["arguments"] == ""
            if item["type"] == "custom_tool_call":
                assert item["input"] == ""
            added.append(item)
            continue
        idx = e.get("output_index")
        assert isinstance(idx, int) and idx < len(added), f"{t} for unknown output_index {idx}"
        item = added[idx]
        assert idx not in done, f"{t} after output_item.done for index {idx}"
        if t == "response.output_item.done":
            final = e["item"]
            assert final["type"] == item["type"] and final.get("id") == item["id"]
            assert final.get("call_id") == item.get("call_id")
            if final["type"] in ("function_call", "custom_tool_call"):
                assert final.get("name"), "done call without name"
            done[idx] = final
            continue
        assert e["item_id"] == item["id"], f"{t} item_id {e['item_id']} != {item['id']}"
        if t.startswith("response.function_call_arguments."):
            assert item["type"] == "function_call", f"{t} on a {item['type']}"
        if t.startswith("response.custom_tool_call_input."):
            assert item["type"] == "custom_tool_call", f"{t} on a {item['type']}"
            if t.endswith(".delta"):
                assert idx not in custom_done, "custom delta after done"
                custom_deltas.setdefault(idx, []).append(e["delta"])
            else:
                custom_done[idx] = e["input"]
        if t.startswith("response.output_text."):
            assert item["type"] == "message"
    final_resp = events[-1]["response"]
    assert set(done) == set(range(len(added))), "every added item needs its output_item.done"
    for idx, value in custom_done.items():
        assert "".join(custom_deltas.get(idx, [])) == value, "custom deltas do not concatenate to the done input"
        assert done[idx]["input"] == value, "output_item.done input differs from custom_tool_call_input.done"
    for idx, item in enumerate(added):
        if item["type"] == "custom_tool_call":
            assert idx in custom_done, "custom call without custom_tool_call_input.done"
    assert final_resp["output"] == [done[i] for i in range(len(added))], "terminal output != streamed items"
    for key in ("id", "object", "created_at", "error", "incomplete_details", "instructions", "model", "tools",
                "output", "parallel_tool_calls", "metadata", "tool_choice", "temperature", "top_p"):
        assert key in final_resp, f"response lacks {key}"
    if request is not None:
        assert final_resp["tools"] == request.get("tools", [])
        if "tool_choice" in request:
            assert final_resp["tool_choice"] == request["tool_choice"]
        assert final_resp["metadata"] == request.get("metadata", {})
        assert final_resp["parallel_tool_calls"] == request.get("parallel_tool_calls", True)
    return {"items": [done[i] for i in range(len(added))], "terminal": events[-1]["type"], "response": final_resp,
            "custom_inputs": [custom_done[i] for i in sorted(custom_done)]}
