"""SSE framing for the Responses stream: bytes in, ``(type, data)`` pairs out, and back.

Parsing uses httpx-sse's line and event decoders. They live in its private ``_decoders`` module: its
public API only wraps an httpx response, and the translator must stay sans-I/O (it is fed bytes by
the server and by tests that re-chunk recorded streams), so we drive the decoders directly.
"""

from __future__ import annotations

import codecs

from httpx_sse._decoders import SSEDecoder, SSELineDecoder

__all__ = ["SseParser", "encode", "encode_comment"]


def encode(event_type: str, data: str) -> bytes:
    """One frame in the shape vLLM and OpenAI send: ``event:`` line, one ``data:`` line, blank line."""
    return f"event: {event_type}\ndata: {data}\n\n".encode()


def encode_comment(text: str) -> bytes:
    return f": {text}\n\n".encode()


class SseParser:
    """Incremental SSE parser. Chunks may split lines, UTF-8 sequences and ``\\r\\n`` anywhere."""

    __slots__ = ("_events", "_lines", "_text")

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lines = SSELineDecoder()
        self._events = SSEDecoder()

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        text = self._text.decode(chunk)
        if not text:
            return []
        return self._decode_lines(self._lines.decode(text))

    def close(self) -> list[tuple[str, str]]:
        """End of stream: flush a last frame that lacked its blank line."""
        tail = self._text.decode(b"", final=True)
        lines = self._lines.decode(tail) if tail else []
        lines += self._lines.flush()
        lines.append("")
        return self._decode_lines(lines)

    def _decode_lines(self, lines: list[str]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        decode = self._events.decode
        for line in lines:
            sse = decode(line)
            if sse is not None and sse.data:
                out.append((sse.event, sse.data))
        return out
