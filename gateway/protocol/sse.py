"""SSE framing for the Responses stream: bytes in, ``(type, data)`` pairs out; client events back out as frames (the
gateway's one SSE encoder).

Parsing uses httpx-sse's line and event decoders. They live in its private ``_decoders`` module: its
public API only wraps an httpx response, and the translator must stay sans-I/O (it is fed bytes by
the server and by tests that re-chunk recorded streams), so we drive the decoders directly.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from gateway.protocol.events import ClientEvent

__all__ = ["SseParser", "encode_events"]


# Each event type's frame head (``event: TYPE\ndata: ``), encoded once: the types are OpenAI's closed set plus what
# an upstream passes through, so the cache stops growing at _HEADS_MAX and later types are encoded per frame.
_HEADS: dict[str, bytes] = {}
_HEADS_MAX = 256


def _head(etype: str) -> bytes:
    head = _HEADS.get(etype)
    if head is None:
        head = b"event: " + etype.encode() + b"\ndata: "
        if len(_HEADS) < _HEADS_MAX:
            _HEADS[etype] = head
    return head


def encode_events(events: Sequence[ClientEvent]) -> bytes:
    """Client events as SSE frames: the gateway's one SSE encoder (``event:`` line, one ``data:`` line)."""
    if len(events) == 1:  # the common batch: one upstream frame in, one client frame out
        ev = events[0]
        return _head(ev.type) + ev.data + b"\n\n"
    parts: list[bytes] = []
    for ev in events:
        parts += (_head(ev.type), ev.data, b"\n\n")
    return b"".join(parts)


class SseParser:
    """Incremental SSE parser. Chunks may split lines, UTF-8 sequences and ``\\r\\n`` anywhere.

    The common stream (vLLM's: ``\\n`` line ends only) is parsed on bytes, a whole read at a time: what ends
    in a blank line is split into frames at once, the rest waits for the next chunk. The first ``\\r`` seen
    hands the stream, from that point on, to httpx-sse's decoders, which implement every line ending.
    """

    __slots__ = ("_buf", "_events", "_lines", "_text")

    def __init__(self) -> None:
        self._buf = b""  # the fast path's unfinished frame
        self._text: codecs.IncrementalDecoder | None = None  # set once the stream switched to the decoders
        self._lines = SSELineDecoder()
        self._events = SSEDecoder()

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        if self._text is not None:
            return self._feed_decoders(chunk)
        if b"\r" in chunk:
            self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
            buf, self._buf = self._buf, b""
            return self._feed_decoders(buf + chunk)
        buf = self._buf + chunk if self._buf else chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return []
        self._buf = buf[end + 2:]
        out: list[tuple[str, str]] = []
        for block in buf[:end].split(b"\n\n"):
            if block:
                frame = _frame(block)
                if frame is not None:
                    out.append(frame)
        return out

    def close(self) -> list[tuple[str, str]]:
        """End of stream: flush a last frame that lacked its blank line."""
        if self._text is None:
            buf, self._buf = self._buf, b""
            frame = _frame(buf) if buf.strip(b"\n") else None
            return [frame] if frame is not None else []
        tail = self._text.decode(b"", final=True)
        lines = self._lines.decode(tail) if tail else []
        lines += self._lines.flush()
        lines.append("")
        return self._decode_lines(lines)

    def _feed_decoders(self, chunk: bytes) -> list[tuple[str, str]]:
        assert self._text is not None
        text = self._text.decode(chunk)
        if not text:
            return []
        return self._decode_lines(self._lines.decode(text))

    def _decode_lines(self, lines: list[str]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        decode = self._events.decode
        for line in lines:
            sse = decode(line)
            if sse is not None and sse.data:
                out.append((sse.event, sse.data))
        return out


def _frame(block: bytes) -> tuple[str, str] | None:
    """One frame's lines (``\\n``-separated, no blank line) as ``(event, data)``; None without data.

    The fields as the SSE spec reads them: ``event``, ``data`` (lines joined by ``\\n``), comments and other
    fields ignored, one space after the colon dropped."""
    # The two shapes vLLM sends: "data: {...}" (chat) and "event: X\ndata: {...}" (responses).
    nl = block.find(b"\n")
    if nl < 0:
        if block.startswith(b"data: ") and len(block) > 6:
            return "message", block[6:].decode("utf-8", "replace")
    elif block.startswith(b"event: ") and block.startswith(b"data: ", nl + 1) and block.find(b"\n", nl + 1) < 0 \
            and len(block) > nl + 7:
        return block[7:nl].decode("utf-8", "replace") or "message", block[nl + 7:].decode("utf-8", "replace")
    event = ""
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            value = line[6:]
            event = (value[1:] if value.startswith(b" ") else value).decode("utf-8", "replace")
        elif line == b"data":
            data.append(b"")
        elif line == b"event":
            event = ""
    if not data:
        return None
    text = (data[0] if len(data) == 1 else b"\n".join(data)).decode("utf-8", "replace")
    if not text:
        return None
    return event or "message", text
