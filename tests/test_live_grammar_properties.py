"""Property tests: a grammar call streamed live (taken over under constrain, passed through under validate) never
reorders the other items' frames, and output indexes stay contiguous, whatever comes before and after it and
however the upstream bytes are cut. Upstream streams are SYNTHESIZED in vLLM's framing (tests/vllm_frames.py);
the constrained step's stream is the real vLLM's recorded one (cassettes/vllm/enforce_custom_lark_stream.yaml).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import lark
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.engine.takeover import GrammarTakeover
from gateway.protocol.events import ClientEvent, UpstreamEvent
from gateway.protocol.sse import SseParser, encode_events
from gateway.runtime import new_id
from gateway.translate.restore import build_request_state
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from gateway.upstream.client import UpstreamResponse
from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import cassette, sse_events
from tests.vllm_frames import VllmStream, args_deltas

RECORDED = load_cassette(cassette("enforce_custom_lark_stream")).interactions[0]
GRAMMAR = RECORDED.request_body["structured_outputs"]["grammar"]  # type: ignore[index]
REQUEST = {"model": "tiny", "input": "x", "tools": [
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}},
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
]}

kinds = st.sampled_from(["message", "reasoning", "function"])


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c


def _cut(body: bytes, cuts: list[int]) -> list[bytes]:
    pts = sorted({c % (len(body) + 1) for c in cuts} | {len(body)})
    out, prev = [], 0
    for p in pts:
        if p > prev:
            out.append(body[prev:p])
        prev = p
    return out


def _stream(before: list[str], after: list[str]) -> VllmStream:
    s = VllmStream().start()
    n = 0

    def add(kind: str) -> None:
        nonlocal n
        n += 1
        if kind == "message":
            s.message(f"msg_{n:016x}", ["some ", "text ", str(n)])
        elif kind == "reasoning":
            s.reasoning(f"rs_{n:016x}", ["think", str(n)])
        else:
            s.call(f"fc_{n:016x}", f"call_{n}", "get_weather", args_deltas({"city": f"c{n}"}, pieces=3))

    for k in before:
        add(k)
    s.call("fc_00000000000000a1", "call_a1", "apply_patch", args_deltas({"input": "not a patch"}, pieces=5))
    for k in after:
        add(k)
    return s.complete()


async def _run(body: bytes, cuts: list[int], step_cuts: list[int], constrain: bool) -> list[dict[str, Any]]:
    state = build_request_state(REQUEST, resolve_tool_context(REQUEST), response_id="resp_1", created_at=1)
    translator = FunctionSseTranslator(state, ids=new_id)

    async def batches() -> AsyncIterator[list[UpstreamEvent]]:
        parser = SseParser()
        for chunk in _cut(body, cuts):
            events = parser.feed(chunk)
            if events:
                yield [UpstreamEvent(event, data) for event, data in events]

    up = UpstreamResponse(httpx.Response(200, stream=_Chunks([])))
    source: AsyncIterator[list[UpstreamEvent]] = batches()
    if constrain:
        async def open_step(info: Any, text: str) -> UpstreamResponse:
            return UpstreamResponse(httpx.Response(200, stream=_Chunks(_cut(RECORDED.body, step_cuts))))

        enforcer = SimpleNamespace(usage=None, note=lambda *a, **k: None, step_unavailable=lambda *a, **k: None)

        def so_far() -> tuple[dict[str, Any] | None, str]:
            return translator.acc.snapshot, ""

        source = GrammarTakeover(state.ctx, enforcer, so_far, open_step).run(source, up)  # type: ignore[arg-type]
    out: list[ClientEvent] = []
    async for events in source:
        for ev in events:
            out += translator.feed(ev)
        if translator.finished:
            break
    out += translator.finish()
    return sse_events(encode_events(out))


def _types(items: list[dict[str, Any]]) -> list[str]:
    return ["function" if i["type"] == "function_call" else "grammar" if i["type"] == "custom_tool_call"
            else i["type"] for i in items]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(kinds, max_size=4), after=st.lists(kinds, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=50_000), max_size=30),
       step_cuts=st.lists(st.integers(min_value=0, max_value=50_000), max_size=20))
def test_constrain_takeover_keeps_order_and_contiguous_indexes(before: list[str], after: list[str], cuts: list[int],
                                                               step_cuts: list[int]) -> None:
    events = asyncio.run(_run(_stream(before, after).body(), cuts, step_cuts, constrain=True))
    summary = check_stream(events, REQUEST)  # contiguous output_index and sequence numbers, one terminal
    items = summary["items"]
    # everything before the call, in order, then the call; the upstream was closed, so nothing after it
    assert _types(items) == [*before, "grammar"]
    assert items[-1]["id"] == "ctc_00000000000000a1"
    lark.Lark(GRAMMAR, parser="earley").parse(items[-1]["input"])
    assert summary["terminal"] == "response.completed"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(kinds, max_size=4), after=st.lists(kinds, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=50_000), max_size=30))
def test_validate_passes_a_grammar_call_through_in_order(before: list[str], after: list[str], cuts: list[int]) -> None:
    events = asyncio.run(_run(_stream(before, after).body(), cuts, [], constrain=False))
    summary = check_stream(events, REQUEST)
    assert _types(summary["items"]) == [*before, "grammar", *after]
    call = summary["items"][len(before)]
    assert call["input"] == "not a patch"
    # the call's frames are contiguous with their neighbours': no item's events overtake another's
    order = [e["output_index"] for e in events if "output_index" in e]
    assert order == sorted(order)
    json.dumps(events)
