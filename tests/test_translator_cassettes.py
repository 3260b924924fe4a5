"""The translator and accumulator on every recorded and synthesized /v1/responses stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.protocol.events import ClientEvent, UpstreamEvent
from gateway.protocol.sse import SseParser, encode_events
from gateway.runtime import new_id
from gateway.translate.restore import build_request_state, restore_output, restore_response
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import CASSETTES, sse_events

SHIM_PROPS = {"input"}


def client_request_for(upstream: dict[str, Any] | None) -> dict[str, Any]:
    """The client request that the gateway would have turned into this upstream request."""
    upstream = upstream or {}
    tools = []
    for t in upstream.get("tools") or ():
        if set((t.get("parameters") or {}).get("properties", {})) == SHIM_PROPS:
            tools.append({"type": "custom", "name": t["name"], "description": "Apply a patch."})
        else:
            tools.append(t)
    req: dict[str, Any] = {"model": "tiny", "input": "x", "tools": tools, "metadata": {"trace": "t1"}}
    return req


def _fn(name: str, prop: str) -> dict[str, Any]:
    return {"type": "function", "name": name,
            "parameters": {"type": "object", "properties": {prop: {"type": "string"}}}}


DEFAULT_TOOLS = [
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch."},
    _fn("get_weather", "city"),
    _fn("get_time", "tz"),
]
NAMESPACE = {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
    {"type": "function", "name": "get_customer_profile", "parameters": {"type": "object"}},
    {"type": "custom", "name": "crm_query"}]}


def translate(body: bytes, request: dict[str, Any], chunk: int | None = None) -> tuple[list[dict[str, Any]], Any]:
    state = build_request_state(request, resolve_tool_context(request), response_id="resp_test", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    parser = SseParser()
    out: list[ClientEvent] = []
    chunks = [body] if chunk is None else [body[i : i + chunk] for i in range(0, len(body), chunk)]
    for c in chunks:
        for event, data in parser.feed(c):
            out += tr.feed(UpstreamEvent(event, data))
    for event, data in parser.close():
        out += tr.feed(UpstreamEvent(event, data))
    out += tr.finish()
    return sse_events(encode_events(out)), tr


def stream_cassettes() -> list[Path]:
    paths = [*sorted((CASSETTES / "vllm").glob("*_stream.yaml")),
             *sorted((CASSETTES / "synthesized").glob("*_stream.yaml"))]
    keep = []
    for p in paths:
        inter = load_cassette(p).interactions[0]
        if inter.path == "/v1/responses" and inter.status == 200:
            keep.append(p)
    return keep


@pytest.mark.parametrize("path", stream_cassettes(), ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk", [None, 1, 7, 4096])
def test_every_stream_cassette_meets_the_contract(path: Path, chunk: int | None) -> None:
    cassette = load_cassette(path)
    inter = cassette.interactions[0]
    request = client_request_for(inter.request_body)
    if cassette.synthesized:
        request["tools"] = [*DEFAULT_TOOLS, NAMESPACE]
    events, tr = translate(inter.body, request, chunk)
    summary = check_stream(events, request)
    # Every upstream call of a client custom tool became a custom_tool_call; no function events for it.
    custom_names = {t["name"] for t in request["tools"] if t["type"] == "custom"} | {"crm_query"}
    for item in summary["items"]:
        if item["type"] == "function_call":
            assert item["name"] not in custom_names
        if item["type"] == "custom_tool_call":
            assert item["id"].startswith("ctc_")
    assert tr.finished


def test_custom_call_ids_are_stable_and_match_the_nonstream_body() -> None:
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]], "tool_choice": "required"}
    body = load_cassette(CASSETTES / "synthesized/interleaved_two_calls_stream.yaml").interactions[0].body
    first, _ = translate(body, request)
    again, _ = translate(body, request, chunk=3)
    ids = [e["item"]["id"] for e in first if e["type"] == "response.output_item.done"]
    assert ids == [e["item"]["id"] for e in again if e["type"] == "response.output_item.done"]
    assert "ctc_0000000000000104" in ids  # ctc_ + the upstream fc_ item's suffix
    nonstream = json.loads(load_cassette(CASSETTES / "synthesized/interleaved_two_calls_nonstream.yaml")
                           .interactions[0].body)
    state = build_request_state(request, resolve_tool_context(request), response_id="r", created_at=1)
    out = restore_output(nonstream["output"], state)
    assert [i["id"] for i in out] == ids
    assert out == [e["item"] for e in first if e["type"] == "response.output_item.done"]


def test_recorded_custom_call_becomes_custom_tool_call_with_raw_input() -> None:
    inter = load_cassette(CASSETTES / "vllm/custom_tool_call_strict_stream.yaml").interactions[0]
    request = client_request_for(inter.request_body)
    request["tool_choice"] = {"type": "custom", "name": "apply_patch"}
    events, _ = translate(inter.body, request)
    summary = check_stream(events, request)
    [item] = summary["items"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch"
    upstream_args = json.loads(next(json.loads(f.split("data: ", 1)[1]) for f in inter.body.decode().split("\n\n")
                                    if "function_call_arguments.done" in f)["arguments"])
    assert item["input"] == upstream_args["input"]
    types = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" not in types
    assert types.count("response.custom_tool_call_input.delta") >= 2  # incremental, not one lump at the end
    assert summary["response"]["tool_choice"] == {"type": "custom", "name": "apply_patch"}
    assert summary["response"]["tools"] == request["tools"]


def test_unnamed_call_is_held_then_released_in_order() -> None:
    inter = load_cassette(CASSETTES / "synthesized/unnamed_call_stream.yaml").interactions[0]
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]]}
    events, tr = translate(inter.body, request)
    summary = check_stream(events, request)
    assert [i["type"] for i in summary["items"]] == ["message", "custom_tool_call"]
    assert summary["custom_inputs"][0].startswith("*** Begin Patch\n*** Add File: caf\u00e9.txt")
    assert "\U0001f600" in summary["custom_inputs"][0]
    assert tr.stats.held_bytes_peak > 0


def test_done_only_items_get_a_full_lifecycle_after_reasoning() -> None:
    inter = load_cassette(CASSETTES / "synthesized/done_only_stream.yaml").interactions[0]
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]]}
    events, _ = translate(inter.body, request)
    summary = check_stream(events, request)
    assert [i["type"] for i in summary["items"]] == ["reasoning", "custom_tool_call", "message"]
    assert summary["items"][2]["content"][0]["text"] == "done"
    types = [e["type"] for e in events]
    assert "response.content_part.added" in types and "response.output_text.delta" in types


def test_malformed_envelope_fails_the_response_cleanly() -> None:
    inter = load_cassette(CASSETTES / "synthesized/malformed_envelope_stream.yaml").interactions[0]
    events, _ = translate(inter.body, {"model": "tiny", "input": "x", "tools": DEFAULT_TOOLS[1:2]})
    check_stream(events)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "upstream_malformed_event"
    assert "error" not in events[-1]  # openai-python raises on a truthy top-level error


def test_truncated_upstream_ends_with_failed_and_closes_open_items() -> None:
    inter = load_cassette(CASSETTES / "synthesized/truncated_stream.yaml").interactions[0]
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]]}
    events, _ = translate(inter.body, request)
    summary = check_stream(events, request)
    assert summary["terminal"] == "response.failed"
    assert summary["response"]["error"]["code"] == "upstream_stream_incomplete"
    assert summary["items"][0]["type"] == "custom_tool_call"
    assert summary["items"][0]["input"] == "*** Begin Patch\n"


def test_length_cutoff_is_reported_as_incomplete() -> None:
    inter = load_cassette(CASSETTES / "vllm/length_cutoff_stream.yaml").interactions[0]
    events, _ = translate(inter.body, {"model": "tiny", "input": "x"})
    summary = check_stream(events)
    assert summary["terminal"] == "response.incomplete"
    assert summary["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_unnamed_call_buffer_is_bounded() -> None:
    from tests.vllm_frames import VllmStream

    s = VllmStream().start()
    s.call("fc_1", "call_1", "apply_patch", ['{"input": "'] + ["x" * 1000] * 400 + ['"}'], name_in_added=False)
    s.complete()
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]]}
    state = build_request_state(request, resolve_tool_context(request), response_id="r", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    parser = SseParser()
    out: list[ClientEvent] = []
    fed = 0
    for event, data in parser.feed(s.body()):
        fed += 1
        out += tr.feed(UpstreamEvent(event, data))
        if tr.finished:
            break
    events = sse_events(encode_events(out))
    check_stream(events)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "unnamed_call_buffer_overflow"
    assert tr.stats.overflowed and tr.stats.held_bytes_peak <= 256 * 1024 + 2000
    assert fed < 300  # it stopped reading long before the end of the upstream stream


def test_restore_response_echoes_the_client_request() -> None:
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]], "metadata": {"a": "b"},
               "tool_choice": {"type": "custom", "name": "apply_patch"}}
    state = build_request_state(request, resolve_tool_context(request), response_id="resp_x", created_at=5)
    upstream = {"id": "resp_up", "tools": [{"type": "function", "name": "apply_patch"}], "metadata": None,
                "tool_choice": {"type": "function", "name": "apply_patch"}, "input_messages": ["secret prompt"]}
    r = restore_response(upstream, state, output=[], status="completed")
    assert r["id"] == "resp_x" and r["tools"] == request["tools"] and r["metadata"] == {"a": "b"}
    assert r["tool_choice"] == request["tool_choice"] and r["error"] is None and "input_messages" not in r


def test_items_only_in_the_terminal_output_are_shown_before_it() -> None:
    from tests.vllm_frames import VllmStream

    s = VllmStream().start().message("msg_1", ["hi"])
    s.output.append({"arguments": '{"input": "late"}', "call_id": "call_late", "name": "apply_patch",
                     "type": "function_call", "id": "fc_late", "status": "completed"})
    s.complete()
    request = {"model": "tiny", "input": "x", "tools": [DEFAULT_TOOLS[0]]}
    events, _ = translate(s.body(), request)
    summary = check_stream(events, request)
    assert [i["type"] for i in summary["items"]] == ["message", "custom_tool_call"]
    assert summary["items"][1]["id"] == "ctc_late" and summary["custom_inputs"] == ["late"]


def test_in_progress_before_created_still_starts_with_created() -> None:
    from tests.vllm_frames import VllmStream

    s = VllmStream().start().message("msg_1", ["hi"]).complete()
    body = s.body().split(b"\n\n", 1)[1]  # drop response.created
    events, _ = translate(body, {"model": "tiny", "input": "x"})
    check_stream(events)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
