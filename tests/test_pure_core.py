"""The pure core keeps no time and draws no ids of its own: handed a fixed clock and a counter id factory, the
chat converter and the translator turn the same input into the same bytes, run after run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocol.conversations import conversation_item
from gateway.protocol.events import ClientEvent
from gateway.protocol.ids import counter_ids
from gateway.protocol.sse import SseParser, encode_events
from gateway.translate.approvals import ApprovalSigner
from gateway.translate.chat import ChatToResponsesEvents
from gateway.translate.mcp_items import mcp_call_history
from gateway.translate.restore import build_request_state
from gateway.translate.sealing import ReasoningSealer
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import CASSETTES, sse_events

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
PATCH = {"type": "custom", "name": "apply_patch"}
REQUEST = {"model": "tiny", "input": "hi", "stream": True, "tools": [WEATHER, PATCH]}


def run_chat(chunks: list[dict[str, Any]], request: dict[str, Any] = REQUEST, now: float = 1_700_000_000.5) -> bytes:
    """One chat stream through ChatToResponsesEvents and FunctionSseTranslator, with fixed time and ids."""
    state = build_request_state(request, resolve_tool_context(request), response_id="resp_fixed", created_at=1)
    ids = counter_ids()
    translator = FunctionSseTranslator(state, ids=ids)
    conv = ChatToResponsesEvents(model="tiny", ids=ids, clock=lambda: now)
    out: list[ClientEvent] = []
    for chunk in chunks:
        for ev in conv.feed(chunk):
            out += translator.feed(ev)
    for ev in conv.done():
        out += translator.feed(ev)
    out += translator.finish()
    return encode_events(out)


def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


def test_a_fixed_clock_and_counter_ids_make_a_chat_stream_byte_for_byte_repeatable() -> None:
    # Reasoning, text and two calls without upstream ids: every id the gateway makes comes from the factory.
    chunks = [chunk({"role": "assistant", "reasoning": "think"}), chunk({"content": "ok"}),
              chunk({"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": "{}"}}]}),
              chunk({"tool_calls": [{"index": 1, "function": {"name": "apply_patch",
                                                              "arguments": '{"input": "x"}'}}]}),
              chunk({}, "tool_calls", {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})]
    first = run_chat(chunks)
    assert first == run_chat(chunks)
    events = sse_events(first)
    check_stream(events)
    text = first.decode()
    # the converter's own ids and the call ids it made up are the counter's, none random
    assert "rs_000000000000000000000001" in text and "msg_000000000000000000000002" in text
    assert "call_000000000000000000000003" in text and "fc_000000000000000000000004" in text
    # and the time is the clock's: a different clock gives different bytes, not another reading of the wall clock
    assert run_chat(chunks, now=1_800_000_000.0) != first


@given(st.lists(st.one_of(
    st.builds(lambda t: {"content": t}, st.text(max_size=8)),
    st.builds(lambda t: {"reasoning": t}, st.text(max_size=8)),
    st.builds(lambda i, named, has_id, args: {"tool_calls": [{
        "index": i, **({"id": f"call_up{i}"} if has_id else {}),
        "function": {**({"name": "get_weather"} if named else {}), "arguments": args}}]},
        st.integers(0, 2), st.booleans(), st.booleans(), st.sampled_from(["", "{", "}", '{"a": 1}'])),
), max_size=12), st.sampled_from(["stop", "tool_calls", "length", None]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_chat_stream_translates_to_the_same_bytes_twice(deltas: list[dict[str, Any]], finish: str | None) -> None:
    chunks = [chunk(d) for d in deltas] + ([chunk({}, finish)] if finish else [])
    assert run_chat(chunks) == run_chat(chunks)


CHAT_STREAMS = [p for folder in ("vllm", "synthesized") for p in sorted((CASSETTES / folder).glob("chat_*_stream.yaml"))
                if load_cassette(p).interactions[0].status == 200
                and load_cassette(p).interactions[0].path == "/v1/chat/completions"]


@pytest.mark.parametrize("path", CHAT_STREAMS, ids=lambda p: p.stem)
def test_every_chat_cassette_is_repeatable(path: Path) -> None:
    inter = load_cassette(path).interactions[0]
    request = {"model": "tiny", "input": "x", "tools": [WEATHER, {**WEATHER, "name": "get_time"}, PATCH]}
    chunks = [orjson.loads(data) for _e, data in SseParser().feed(inter.body) if data != "[DONE]"]
    assert chunks
    assert run_chat(chunks, request) == run_chat(chunks, request)


def test_the_core_takes_its_randomness_and_time_from_the_caller() -> None:
    assert conversation_item({"role": "user", "content": "hi"}, counter_ids(7))["id"] == "msg_" + f"{7:024x}"
    # a history mcp_call without an id gets one made from its content: the same history, the same upstream ids
    call = {"type": "mcp_call", "server_label": "s", "name": "echo", "arguments": "{}", "output": "x"}
    assert mcp_call_history(call, "mcp__s__echo") == mcp_call_history(dict(call), "mcp__s__echo")
    assert mcp_call_history(call, "n")[0]["call_id"] != mcp_call_history({**call, "output": "y"}, "n")[0]["call_id"]
    # sealing's nonces and approval ids' random part and expiry come from what the caller hands in
    sealer = ReasoningSealer([b"k" * 32], random_bytes=lambda n: b"\0" * n)
    item = {"id": "rs_1", "content": [{"type": "reasoning_text", "text": "t"}]}
    assert sealer.seal(item) == sealer.seal(item)
    assert sealer.open(sealer.seal(item)) == {"id": "rs_1", "text": "t"}
    signer = ApprovalSigner([b"k" * 32], random_bytes=lambda n: b"\1" * n, clock=lambda: 1000.0, ttl=60)
    minted = signer.mint(None, "s", "echo", "{}")
    assert minted == signer.mint(None, "s", "echo", "{}")
    assert signer.verify(minted, None, "s", "echo", "{}") is None
