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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, ascii_only=st.booleans(),
       content_cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=25),
       byte_cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=40), cut_off=st.booleans())
def test_a_takeover_steps_content_is_the_input_at_any_split(text: str, ascii_only: bool, content_cuts: list[int],
                                                           byte_cuts: list[int], cut_off: bool) -> None:
    """The takeover (gateway.engine.takeover): the upstream opened the call, then a constrained chat step's content,
    cut anywhere and re-chunked anywhere on the wire, continues the same item through ``InputContinuation`` as the
    input itself. The client's deltas join to the text, the done input and the item's are the text, and the upstream
    call's arguments (what a later turn replays) are ``{"input": text}``, a token-limit cut included."""
    from gateway.enforce.constrain import InputContinuation
    from gateway.upstream.chat import chat_chunk_events

    opened = VllmStream().start().message("msg_1", ["hi"])
    opened.call("fc_abc", "call_abc", "apply_patch", [])
    state = build_request_state(REQUEST, resolve_tool_context(REQUEST), response_id="r", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    out: list[ClientEvent] = []
    added: dict = {}
    parser = SseParser()
    for event, data in parser.feed(opened.body()):
        if event == "response.output_item.added" and json.loads(data)["item"]["type"] == "function_call":
            added = json.loads(data)
            out += tr.feed(UpstreamEvent(event, data))
            break  # the takeover closes the upstream stream at the call's opening
        out += tr.feed(UpstreamEvent(event, data))
    cont = InputContinuation(added, tr.acc.snapshot)
    chunks = [{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": p}}]}
              for p in cut(text, content_cuts) if p]
    chunks.append({"id": "c", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "length" if cut_off else "stop"}]})
    wire = b"".join(b"data: " + json.dumps(c, ensure_ascii=ascii_only).encode() + b"\n\n" for c in chunks)
    wire += b"data: [DONE]\n\n"
    step = SseParser()
    pts = sorted({p % (len(wire) + 1) for p in byte_cuts})
    prev = 0
    for p in [*pts, len(wire)]:
        for _event, data in step.feed(wire[prev:p]):
            for ev in chat_chunk_events(data, cont):
                out += tr.feed(ev)
        prev = p
    out += tr.finish()
    events = sse_events(encode_events(out))
    summary = check_stream(events, {**REQUEST, "stream": True})
    assert summary["terminal"] == ("response.incomplete" if cut_off else "response.completed")
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == text
    assert summary["custom_inputs"] == [text]
    assert summary["items"][1]["input"] == text and summary["items"][1]["id"] == "ctc_abc"
    assert json.loads(cont.item["arguments"]) == {"input": text}
