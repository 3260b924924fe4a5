"""ResponseAccumulator: the authoritative state of the upstream response, built from its frames.

It owns the upstream view only (the response snapshot, each item as the upstream described it, the
argument and text deltas seen so far); the translator owns what the client has been shown. Feeding it
is cheap on purpose: deltas are appended to lists and joined only when an item is read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ResponseAccumulator", "UpstreamItem"]

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(slots=True)
class UpstreamItem:
    output_index: int
    item: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    texts: dict[int, list[str]] = field(default_factory=dict)
    args_done: str | None = None
    name: str | None = None
    done: bool = False

    @property
    def type(self) -> str | None:
        return self.item.get("type")

    @property
    def arguments(self) -> str:
        if self.done and isinstance(args := self.item.get("arguments"), str):
            return args
        if self.args_done is not None:
            return self.args_done
        return "".join(self.args)

    def text(self, content_index: int = 0) -> str:
        return "".join(self.texts.get(content_index, ()))


class ResponseAccumulator:
    __slots__ = ("items", "snapshot", "terminal")

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None
        self.items: dict[int, UpstreamItem] = {}
        self.terminal: dict[str, Any] | None = None

    def item(self, output_index: int) -> UpstreamItem:
        st = self.items.get(output_index)
        if st is None:
            st = self.items[output_index] = UpstreamItem(output_index)
        return st

    def apply(self, etype: str, d: Mapping[str, Any]) -> UpstreamItem | None:
        """Fold one upstream event in; return the item it concerns, if any."""
        if etype in TERMINAL_EVENTS:
            resp = d.get("response")
            if isinstance(resp, dict):
                self.terminal = resp
                self.snapshot = resp
            return None
        if etype in ("response.created", "response.in_progress", "response.queued"):
            resp = d.get("response")
            if isinstance(resp, dict):
                self.snapshot = resp
            return None
        idx = d.get("output_index")
        if not isinstance(idx, int):
            return None
        st = self.item(idx)
        if etype == "response.output_item.added" or etype == "response.output_item.done":
            item = d.get("item")
            if isinstance(item, dict):
                st.item = item
                if item.get("name"):
                    st.name = item["name"]
            st.done = etype == "response.output_item.done"
        elif etype == "response.function_call_arguments.delta":
            st.args.append(str(d.get("delta", "")))
        elif etype == "response.function_call_arguments.done":
            st.args_done = str(d.get("arguments", ""))
            if d.get("name"):
                st.name = d["name"]
        elif etype in ("response.output_text.delta", "response.reasoning_text.delta"):
            st.texts.setdefault(int(d.get("content_index", 0)), []).append(str(d.get("delta", "")))
        return st

    def find_terminal_item(self, up: UpstreamItem) -> Mapping[str, Any] | None:
        """The terminal response's version of an item, matched on id, then call_id."""
        if not self.terminal:
            return None
        iid, cid = up.item.get("id"), up.item.get("call_id")
        for item in self.terminal.get("output") or ():
            if isinstance(item, dict) and ((iid and item.get("id") == iid) or (cid and item.get("call_id") == cid)):
                return item
        return None
