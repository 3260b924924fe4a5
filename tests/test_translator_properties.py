"""Property tests: chunking never changes what the client receives."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocol.events import ClientEvent, UpstreamEvent
from gateway.protocol.sse import SseParser, encode_events
from gateway.runtime import new_id
from gateway.translate.custom_input import InputDecoder, final_input
from gateway.translate.restore import build_request_state
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from tests.invariants import check_stream
from tests.support import sse_events
from tests.vllm_frames import VllmStream

REQUEST = {"model": "tiny", "input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80) | st.sampled_from(
    ["*** Begin Patch\n+h\u00e9llo \"w\u00f6rld\" \\ \U0001f600\t\n*** End Patch\n", "\\u0041", "\"\"\\\\"])


def cut(text: str, points: list[int]) -> list[str]:
    pts = sorted({p % (len(text) + 1) for p in points})
    pieces, prev = [], 0
    for p in pts:
        pieces.append(text[prev:p])
        prev = p
    pieces.append(text[prev:])
    return pieces


def run(body: bytes, byte_cuts: list[int], request: dict) -> list[dict]:
    state = build_request_state(request, resolve_tool_context(request), response_id="r", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    parser = SseParser()
    out: list[ClientEvent] = []
    pts = sorted({p % (len(body) + 1) for p in byte_cuts})
    prev = 0
    for p in [*pts, len(body)]:
        for event, data in parser.feed(body[prev:p]):
            out += tr.feed(UpstreamEvent(event, data))
        prev = p
    for event, data in parser.close():
        out += tr.feed(UpstreamEvent(event, data))
    out += tr.finish()
    return sse_events(encode_events(out))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, ascii_only=st.booleans(), named=st.booleans(),
       delta_cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=25),
       byte_cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=40))
def test_rechunking_never_changes_the_custom_input(text: str, ascii_only: bool, named: bool,
                                                    delta_cuts: list[int], byte_cuts: list[int]) -> None:
    arguments = json.dumps({"input": text}, ensure_ascii=ascii_only)
    s = VllmStream().start().message("msg_1", ["hi"])
    s.call("fc_abc", "call_abc", "apply_patch", cut(arguments, delta_cuts), name_in_added=named).complete()
    events = run(s.body(), byte_cuts, REQUEST)
    summary = check_stream(events, REQUEST)
    assert summary["custom_inputs"] == [text]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert deltas == text
    assert summary["items"][1]["input"] == text


@settings(max_examples=300, deadline=None)
@given(text=texts, ascii_only=st.booleans(), cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_input_decoder_matches_json_at_any_split(text: str, ascii_only: bool, cuts: list[int]) -> None:
    arguments = json.dumps({"input": text}, ensure_ascii=ascii_only)
    decoder = InputDecoder()
    streamed = "".join(decoder.feed(piece) for piece in cut(arguments, cuts))
    assert streamed == text == final_input(arguments, decoder)


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(st.integers(), st.none(), st.booleans(), st.lists(st.integers(), max_size=3),
                       st.dictionaries(st.sampled_from(["a", "inputs", "x"]), st.integers(), max_size=2)))
def test_arguments_that_are_not_an_input_object_pass_on_raw(value: object) -> None:
    arguments = json.dumps(value)
    decoder = InputDecoder()
    assert decoder.feed(arguments) == ""
    assert final_input(arguments, decoder) == arguments
