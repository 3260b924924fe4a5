"""Decode a custom tool's ``input`` from the upstream's function-call arguments, incrementally.

The upstream sees each custom tool as a function taking ``{"input": "<string>"}``; its argument deltas
are fragments of that JSON text, cut anywhere, including inside an escape such as ``\\u00e9`` or a
surrogate pair. ``InputDecoder.feed`` returns the newly decoded characters of the ``input`` string so
the client receives ``custom_tool_call_input.delta`` events as the model writes. ``final_input`` decides
the authoritative value once the arguments are complete.
"""

from __future__ import annotations

import re
from typing import Literal

import orjson

__all__ = ["InputDecoder", "final_input"]

_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SPECIAL = re.compile(r'["\\]')
_WS = " \t\r\n"

Mode = Literal["start", "object", "key", "after_key", "colon", "value", "done", "raw"]


class InputDecoder:
    """A small state machine over ``{"input": "..."}`` (or a bare JSON string).

    Anything else (other keys first, a number, ``null``) switches to ``raw``: nothing is streamed and
    ``final_input`` falls back to the raw arguments.
    """

    __slots__ = ("_escape", "_high", "_key", "_parts", "mode", "streamed")

    def __init__(self) -> None:
        self.mode: Mode = "start"
        self._key: list[str] = []
        self._escape: str | None = None  # pending escape text after the backslash
        self._high: str | None = None  # a high surrogate waiting for its low half
        self._parts: list[str] = []
        self.streamed = False

    @property
    def value(self) -> str:
        return "".join(self._parts)

    def feed(self, text: str) -> str:
        out: list[str] = []
        i, n = 0, len(text)
        while i < n:
            mode = self.mode
            if mode in ("done", "raw"):
                break
            if mode == "value":
                i = self._value(text, i, out)
                continue
            ch = text[i]
            i += 1
            if mode == "start":
                if ch in _WS:
                    continue
                self.mode = "object" if ch == "{" else "value" if ch == '"' else "raw"
            elif mode == "object":
                if ch in _WS:
                    continue
                self.mode = "key" if ch == '"' else "raw"
            elif mode == "key":
                if ch == '"':
                    self.mode = "colon" if "".join(self._key) == "input" else "raw"
                elif ch == "\\":
                    self.mode = "raw"  # an escaped key is never our "input"
                else:
                    self._key.append(ch)
                    if len(self._key) > 5:
                        self.mode = "raw"
            elif mode == "colon":
                if ch in _WS:
                    continue
                self.mode = "after_key" if ch == ":" else "raw"
            elif mode == "after_key":
                if ch in _WS:
                    continue
                self.mode = "value" if ch == '"' else "raw"
        piece = "".join(out)
        if piece:
            self._parts.append(piece)
            self.streamed = True
        return piece

    def _value(self, text: str, i: int, out: list[str]) -> int:
        if self._escape is not None:
            return self._continue_escape(text, i, out)
        m = _SPECIAL.search(text, i)
        end = m.start() if m else len(text)
        if end > i:
            self._flush_high(out)
            out.append(text[i:end])
        if m is None:
            return len(text)
        if text[end] == '"':
            self._flush_high(out)
            self.mode = "done"
            return end + 1
        self._escape = ""
        return self._continue_escape(text, end + 1, out)

    def _continue_escape(self, text: str, i: int, out: list[str]) -> int:
        esc = self._escape or ""
        n = len(text)
        while i < n:
            esc += text[i]
            i += 1
            if esc[0] != "u":
                self._escape = None
                self._flush_high(out)
                out.append(_SIMPLE_ESCAPES.get(esc[0], esc[0]))
                return i
            if len(esc) == 5:
                self._escape = None
                self._unicode(esc[1:], out)
                return i
        self._escape = esc
        return i

    def _unicode(self, hexdigits: str, out: list[str]) -> None:
        try:
            code = int(hexdigits, 16)
        except ValueError:
            self.mode = "raw"
            return
        if 0xD800 <= code <= 0xDBFF:
            self._flush_high(out)
            self._high = chr(code)
            return
        if 0xDC00 <= code <= 0xDFFF and self._high is not None:
            high = ord(self._high)
            self._high = None
            out.append(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
            return
        self._flush_high(out)
        out.append("\ufffd" if 0xDC00 <= code <= 0xDFFF else chr(code))

    def _flush_high(self, out: list[str]) -> None:
        if self._high is not None:
            self._high = None
            out.append("\ufffd")  # a lone surrogate cannot be sent as UTF-8


def final_input(arguments: str, decoder: InputDecoder | None = None) -> str:
    """The authoritative custom-tool input for complete arguments.

    ``{"input": s}`` (extra keys ignored) gives ``s``; a bare JSON string is used as is; anything else
    is passed on raw. Arguments cut short (a length cut-off) that were being streamed as an input value
    keep the decoded prefix rather than turning into raw JSON.
    """
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        if decoder is not None and decoder.mode in ("value", "done"):
            return decoder.value
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return _clean(parsed["input"])
    if isinstance(parsed, str):
        return _clean(parsed)
    return arguments


def _clean(value: str) -> str:
    # orjson decodes a lone surrogate escape into a lone surrogate; it could not be re-encoded.
    try:
        value.encode()
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode()
    return value
