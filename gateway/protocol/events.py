"""The two event types of a response's pipeline: what the upstream sends (``UpstreamEvent``) and what the client
gets (``ClientEvent``). Pure data; each transport has one encoder for client events (SSE: gateway.protocol.sse,
WebSocket text frames and background-run rows: their transports)."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["TERMINAL_TYPES", "ClientEvent", "UpstreamEvent", "with_failed_terminal"]


class UpstreamEvent:
    """One upstream event in the Responses shape: as received (its SSE ``event:`` name and ``data:`` text, parsed
    on first use) or built by the gateway itself (a chat chunk converted, a takeover step's events), which is never
    serialized only to be parsed again."""

    __slots__ = ("_obj", "event", "text")

    def __init__(self, event: str, text: str = "", obj: dict[str, Any] | None = None) -> None:
        self.event = event
        self.text = text  # "" for a built event
        self._obj = obj

    @classmethod
    def built(cls, obj: dict[str, Any]) -> UpstreamEvent:
        etype = obj.get("type")
        return cls(etype if isinstance(etype, str) else "message", "", obj)

    def json(self) -> Any:
        """The event's data, parsed (once); raises ``orjson.JSONDecodeError`` when the text is not JSON."""
        if self._obj is None:
            obj = orjson.loads(self.text)
            if not isinstance(obj, dict):
                return obj
            self._obj = obj
        return self._obj

    def __repr__(self) -> str:
        return f"UpstreamEvent({self.event!r}, {self.text[:60]!r}{', built' if not self.text else ''})"


class ClientEvent:
    """One client event: its type, sequence number and output index, the event object (``payload``, with ``type``
    and ``sequence_number`` in it) and that object serialized (``data``). ``data`` is made once, when the event
    is made — or is the upstream's own text when a frame passes through unchanged — and every encoder writes it
    as is."""

    __slots__ = ("data", "output_index", "payload", "sequence_number", "type")

    def __init__(self, etype: str, sequence_number: int, output_index: int | None, payload: dict[str, Any],
                 data: bytes) -> None:
        self.type = etype
        self.sequence_number = sequence_number
        self.output_index = output_index
        self.payload = payload
        self.data = data

    @classmethod
    def of(cls, payload: dict[str, Any]) -> ClientEvent:
        """An event from its object (``type`` and ``sequence_number`` set), serialized now."""
        idx = payload.get("output_index")
        seq = payload.get("sequence_number")
        return cls(str(payload.get("type")), seq if isinstance(seq, int) else -1,
                   idx if isinstance(idx, int) else None, payload, orjson.dumps(payload))

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_TYPES

    def __repr__(self) -> str:
        return f"ClientEvent({self.type!r}, seq={self.sequence_number}, index={self.output_index})"


TERMINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})


def with_failed_terminal(events: list[ClientEvent], response: dict[str, Any]) -> list[ClientEvent]:
    """``events`` ending with ``response.failed`` (carrying ``response``): it takes the terminal event's place and
    number when the last event is terminal, and follows the last event otherwise."""
    out = list(events)
    seq = out[-1].sequence_number + 1 if out else 0
    if out and out[-1].terminal:
        seq = out.pop().sequence_number
    out.append(ClientEvent.of({"type": "response.failed", "sequence_number": seq, "response": response}))
    return out
