"""SseParser: the bytes fast path gives what httpx-sse's decoders give, however the stream is cut."""

from __future__ import annotations

import codecs
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.sse import SseParser


def _decoders_only() -> SseParser:
    parser = SseParser()
    parser._text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as after a "\r"
    return parser


def _parse(parser: SseParser, raw: bytes, cuts: list[int]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    for a, b in itertools.pairwise(bounds):
        out += parser.feed(raw[a:b])
    return out + parser.close()


_value = st.text(alphabet="ab {}\":,\u00e9\U0001F600:", max_size=8)
_line = st.one_of(
    _value.map(lambda v: f"data: {v}"), _value.map(lambda v: f"data:{v}"), st.just("data"),
    st.sampled_from(["event: response.created", "event:error", "event", "id: 7", "retry: 10", ": comment",
                     "other: x"]),
)
_frame = st.lists(_line, min_size=0, max_size=4).map(lambda lines: "".join(f"{x}\n" for x in lines) + "\n")


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(_frame, max_size=6), tail=st.sampled_from(["", "data: last", "data: last\n", "\n"]),
       cuts=st.lists(st.integers(0, 400), max_size=8))
def test_fast_path_matches_the_decoders(frames: list[str], tail: str, cuts: list[int]) -> None:
    raw = ("".join(frames) + tail).encode()
    assert _parse(SseParser(), raw, cuts) == _parse(_decoders_only(), raw, [])


def test_vllm_frames_and_a_switch_to_crlf_mid_stream() -> None:
    parser = SseParser()
    assert parser.feed(b'event: response.created\ndata: {"a":1}\n\nevent: x\nda') == [("response.created", '{"a":1}')]
    assert parser.feed(b"ta: 2\n\n") == [("x", "2")]
    assert parser.feed(b"data: 3\r\n\r\ndata: 4\r\n") == [("message", "3")]
    assert parser.close() == [("message", "4")]


def test_utf8_split_inside_a_character() -> None:
    raw = 'data: {"t":"caf\u00e9 \U0001F600"}\n\n'.encode()
    parser = SseParser()
    out = []
    for i in range(len(raw)):
        out += parser.feed(raw[i:i + 1])
    assert out == [("message", '{"t":"caf\u00e9 \U0001F600"}')]


def test_the_encoders_frame_heads_are_cached_within_a_bound_and_every_type_still_encodes() -> None:
    """An upstream passing through ever new event types cannot grow the encoder's cache without bound."""
    from gateway.protocol import sse
    from gateway.protocol.events import ClientEvent

    events = [ClientEvent(f"x.type_{i}", i, None, {}, b'{"n":%d}' % i) for i in range(sse._HEADS_MAX * 3)]
    one_by_one = b"".join(sse.encode_events([ev]) for ev in events)
    assert one_by_one == sse.encode_events(events)
    assert len(sse._HEADS) <= sse._HEADS_MAX
    parsed = SseParser().feed(one_by_one)
    assert parsed == [(f"x.type_{i}", f'{{"n":{i}}}') for i in range(sse._HEADS_MAX * 3)]
