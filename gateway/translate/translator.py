"""FunctionSseTranslator: upstream Responses frames in, client frames out. Pure; no I/O.

Theory of operation
-------------------
vLLM streams every tool call as a ``function_call`` item because the gateway rewrote custom and
namespace tools into functions. For each upstream item the translator decides, once, what the client
sees (``_Item.kind``):

* ``custom``     the call is shown as a ``custom_tool_call``: ``custom_tool_call_input.delta`` events carry
                 the decoded ``input`` string as it arrives, ``.done`` carries the whole of it (an upstream
                 ``custom_tool_call_input.delta`` for the item, a takeover step's text, is the input as is);
* ``function``   a function call, passed through (namespace members get their public name back);
* ``pass``       messages, reasoning and anything unknown, passed through;
* ``patch``      an ``apply_patch`` call, shown as an ``apply_patch_call``: announced once its operation's type and
                 path are known, its diff streamed as ``response.apply_patch_call_operation_diff.delta`` events
                 (gateway.translate.builtin_tools);
* ``builtin``    a ``shell`` / ``local_shell`` call, shown as a ``shell_call`` / ``local_shell_call`` completed with
                 its action when its arguments are; a shell call's commands stream as
                 ``response.shell_call_command.added/.delta/.done`` events as they are written;
* ``pending``    a call whose name has not arrived: its frames are held (at most
                 ``max_unnamed_call_bytes`` per response) until the name arrives, then released in order;
* ``suppressed`` a call after the first one when ``parallel_tool_calls`` is false: nothing is emitted;
* ``mcp``        a gateway-owned call of a listed MCP tool: the client sees an ``mcp_call`` item and
                 ``mcp_call_arguments`` events, never the function call; the item stays open after the
                 upstream's done until the I/O shell runs the call and hands the result to ``complete_owned``;
* ``announced``  an item the gateway is still making (a compaction), opened by ``announce``; another translator
                 finishes it, or ``fail`` closes it as announced;
* ``web_search`` a gateway-owned call of the search function (gateway.translate.web_search): announced as a
                 ``web_search_call`` once its query is complete (``in_progress``, ``searching``), then left open
                 until the shell has searched and hands the item to ``complete_search``;
* ``approval``   the same call when its server requires approval: an ``mcp_approval_request`` item, announced
                 (``added`` then ``done``) once its arguments are complete, because its id (``mint_approval``,
                 gateway.translate.approvals) is a MAC over them.

Rounds (the tool loop). When an upstream response ends with gateway-owned calls still to run, the
translator does not emit a terminal event: ``round_done`` is set, the shell runs the calls
(``owned_calls``/``complete_owned``), then either starts the next upstream response into the same client
response (``next_round``) or ends it (``end``). Output indexes, sequence numbers and the output list
continue across rounds; usage is summed. Items the gateway makes itself (``mcp_list_tools``, a call run
after an approval) are emitted with ``owned_item``.

``sequence_number`` is renumbered from 0 over the emitted events and ``output_index`` is assigned in
emission order, so both stay contiguous whatever is held or suppressed. A frame whose numbers already
match is forwarded as the text it came in (the common case, and the cheap one).

The stream always ends with exactly one terminal event (``response.completed``, ``.incomplete`` or
``.failed``): the upstream's, or one the translator makes when the upstream ends early
(``finish``), breaks (``fail``) or overflows the hold buffer. ``finished`` tells the I/O shell to
stop reading and close the upstream request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.protocol.events import ClientEvent, UpstreamEvent
from gateway.protocol.ids import IdFactory
from gateway.translate.accumulator import ResponseAccumulator, UpstreamItem
from gateway.translate.builtin_tools import (
    BUILTIN_TOOL_TYPES,
    PatchStream,
    ShellStream,
    builtin_call_item,
    opening_item,
)
from gateway.translate.custom_input import InputDecoder, final_input
from gateway.translate.mcp_items import approval_request_item, approval_required, mcp_call_item
from gateway.translate.restore import RequestState, client_call_item, restore_response
from gateway.translate.tool_context import ToolInfo
from gateway.translate.usage import add_usage
from gateway.translate.web_search import citations, search_item, search_query_of

__all__ = ["FunctionSseTranslator", "TranslatorStats"]

_LIFECYCLE_START = frozenset({"response.created", "response.in_progress", "response.queued"})
# ShellStream steps -> OpenAI's shell command events and the field that carries the text.
_SHELL_EVENTS = {"added": ("response.shell_call_command.added", "command"),
                 "delta": ("response.shell_call_command.delta", "delta"),
                 "done": ("response.shell_call_command.done", "command")}
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}

@dataclass(slots=True)
class TranslatorStats:
    custom_calls: int = 0
    function_calls: int = 0
    suppressed_calls: int = 0
    held_bytes_peak: int = 0
    overflowed: bool = False
    input_mismatches: int = 0
    raw_inputs: int = 0
    mcp_calls: int = 0
    builtin_calls: int = 0


@dataclass(slots=True)
class _Item:
    up: UpstreamItem
    kind: str = "pass"
    client_index: int = -1
    item_id: str | None = None
    info: ToolInfo | None = None
    held: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    decoder: InputDecoder | None = None
    patch: PatchStream | None = None
    shell: ShellStream | None = None
    emitted: list[str] = field(default_factory=list)
    input_done: str | None = None
    args_done_sent: bool = False
    final: dict[str, Any] | None = None
    opened: dict[str, Any] | None = None  # a gateway-owned item as announced (mcp_call / approval request)
    round: int = 0
    annotations: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # url citations per content part

    @property
    def open(self) -> bool:
        return self.client_index >= 0 and self.final is None


class FunctionSseTranslator:
    def __init__(self, state: RequestState, mint_approval: Callable[[str, str, str], str] | None = None, *,
                 ids: IdFactory) -> None:
        self.state = state
        self.ids = ids  # the ids of gateway-owned items the upstream's own ids do not give
        self.mint_approval = mint_approval  # (server label, tool name, arguments) → the request's id
        self.acc = ResponseAccumulator()
        self.stats = TranslatorStats()
        self.finished = False
        self.final_response: dict[str, Any] | None = None
        self._seq = 0
        self._next_index = 0
        self._items: dict[int, _Item] = {}
        self._order: list[_Item] = []
        self._held_bytes = 0
        self._created = False
        self._in_progress = False
        self._call_shown = False
        self.round = 0
        self.round_done = False
        # Summed over finished rounds, from what the items the gateway made first cost (a compaction pass).
        self._usage: dict[str, Any] | None = dict(state.lead_usage) if state.lead_usage else None
        self._lead_sent = not state.lead
        if state.lead_announced:  # created, in_progress and the lead items' openings went out already
            self._seq = state.lead_announced
            self._created = self._in_progress = True
        self._round_terminal: dict[str, Any] | None = None
        # Results of this response's searches, (url, title), numbered from [1]: the markers the model was asked to
        # use, turned into url_citation annotations in later message text.
        self.sources: list[tuple[str, str]] = []
        self._handlers: dict[str, Callable[[str, dict[str, Any], str], list[ClientEvent]]] = {
            "response.output_item.added": self._on_added,
            "response.output_item.done": self._on_item_done,
            "response.completed": self._on_terminal,
            "response.incomplete": self._on_terminal,
            "response.failed": self._on_terminal,
            "error": self._on_error,
        }

    # ------------------------------------------------------------------ entry points

    def feed(self, ev: UpstreamEvent) -> list[ClientEvent]:
        """One upstream event -> client events.

        An event the gateway built itself (a converted chat chunk, a takeover step's events) has no text: it is
        never passed on as text, so nothing is serialized only to be parsed again."""
        if self.finished:
            return []
        data = ev.text
        event = ev.event
        if data == "[DONE]":
            return []
        try:
            d = ev.json()
        except orjson.JSONDecodeError:
            return self.fail("upstream_malformed_event", "The upstream sent an event that is not valid JSON.")
        if not isinstance(d, dict):
            return self.fail("upstream_malformed_event", "The upstream sent an event that is not a JSON object.")
        etype = d.get("type") or event
        if not isinstance(etype, str):
            return self.fail("upstream_malformed_event", "The upstream sent an event without a type.")
        handler = self._handlers.get(etype)
        if handler is not None:
            return handler(etype, d, data)
        if etype in _LIFECYCLE_START:
            return self._on_start(etype, d)
        if "output_index" in d:
            return self._on_sub_event(etype, d, data)
        return self._forward(etype, d, data)

    def start(self) -> list[ClientEvent]:
        """``response.created`` and ``.in_progress`` now, if not sent yet (a response the gateway opens itself)."""
        return self._ensure_started()

    def finish(self) -> list[ClientEvent]:
        """The upstream stream ended. Without a terminal event that is a failure, never a hang."""
        if self.finished:
            return []
        return self.fail("upstream_stream_incomplete",
                         "The upstream stream ended before the response completed.")

    def fail(self, code: str, message: str) -> list[ClientEvent]:
        """End the response with ``response.failed`` (broken upstream, timeout, overflow, shutdown)."""
        if self.finished:
            return []
        out = self._ensure_started()
        out += self._close_open_items("incomplete")
        error = {"code": code, "message": message}
        resp = restore_response(self.acc.snapshot, self.state, output=self._final_output(), status="failed",
                                error=error)
        out.append(self._emit("response.failed", {"response": resp}))
        self.finished = True
        self.final_response = resp
        return out

    # ------------------------------------------------------------------ emission helpers

    def _emit(self, etype: str, payload: dict[str, Any]) -> ClientEvent:
        payload["type"] = etype
        seq = payload["sequence_number"] = self._seq
        self._seq += 1
        idx = payload.get("output_index")
        return ClientEvent(etype, seq, idx if isinstance(idx, int) else None, payload, orjson.dumps(payload))

    def _forward(self, etype: str, d: dict[str, Any], data: str, client_index: int | None = None) -> list[ClientEvent]:
        """Pass a frame on; re-serialize only when its numbers must change."""
        seq = self._seq
        if data and d.get("sequence_number") == seq and d.get("type") == etype and (
                client_index is None or d.get("output_index") == client_index):
            self._seq += 1  # passed through: the upstream's text is the event's data
            return [ClientEvent(etype, seq, client_index, d, data.encode())]
        if client_index is not None:
            d["output_index"] = client_index
        return [self._emit(etype, d)]

    def _ensure_started(self) -> list[ClientEvent]:
        out: list[ClientEvent] = []
        if not self._created:
            self._created = True
            resp = restore_response(self.acc.snapshot, self.state, output=[], status="in_progress")
            resp["usage"] = None
            out.append(self._emit("response.created", {"response": resp}))
        if not self._in_progress:
            self._in_progress = True
            resp = restore_response(self.acc.snapshot, self.state, output=[], status="in_progress")
            resp["usage"] = None
            out.append(self._emit("response.in_progress", {"response": resp}))
        if not self._lead_sent:
            self._lead_sent = True
            out += self._emit_lead()
        return out

    def _emit_lead(self) -> list[ClientEvent]:
        """The items the gateway made before the upstream answered, each added, (a compaction item's
        ``response.compaction.compacting``,) done."""
        out: list[ClientEvent] = []
        for item in self.state.lead:
            if self.state.lead_announced:  # announced by another translator: only its done is left
                st = _Item(UpstreamItem(-1), kind="owned", item_id=item.get("id"), round=self.round)
                self._assign(st)
                st.final = item
                out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": item}))
                continue
            out += self.owned_item(item, _lead_events(item))
        return out

    def announce(self, items: list[dict[str, Any]]) -> list[ClientEvent]:
        """Open a response with items the gateway is still making (a compaction item, its blob not yet sealed):
        ``response.created``, ``.in_progress``, each item's added and progress events, so the client hears at once.
        The translator that finishes the response runs over a state whose ``lead`` holds the finished items and
        whose ``lead_announced`` is ``sequence``; this one can still end it with ``fail``."""
        out = self._ensure_started()
        for item in items:
            st = _Item(UpstreamItem(-1), kind="announced", item_id=item.get("id"), opened=dict(item))
            self._assign(st)
            idx = st.client_index
            out.append(self._emit("response.output_item.added", {"output_index": idx, "item": dict(item)}))
            for etype, payload in _lead_events(item):
                out.append(self._emit(etype, {"item_id": item.get("id"), "output_index": idx, **payload}))
        return out

    @property
    def sequence(self) -> int:
        """The next event's sequence number."""
        return self._seq

    # ------------------------------------------------------------------ lifecycle

    def _on_start(self, etype: str, d: dict[str, Any]) -> list[ClientEvent]:
        self.acc.apply(etype, d)
        if etype == "response.created" and not self._created:
            self._created = True
            resp = restore_response(self.acc.snapshot, self.state, output=[], status="in_progress")
            return [self._emit(etype, {"response": resp})]
        if etype == "response.in_progress" and not self._in_progress:
            self._in_progress = True
            resp = restore_response(self.acc.snapshot, self.state, output=[], status="in_progress")
            out = []
            if not self._created:
                self._created = True
                out.append(self._emit("response.created", {"response": dict(resp)}))
            out.append(self._emit(etype, {"response": resp}))
            return out + self._ensure_started()  # the gateway's own first items (a compaction), if any
        return []  # duplicates (and queued) are folded into the snapshot only

    def _on_error(self, etype: str, d: dict[str, Any], data: str) -> list[ClientEvent]:
        err = raw if isinstance(raw := d.get("error"), dict) else d
        code = err.get("code")
        return self.fail(code if isinstance(code, str) else "upstream_error",
                         str(err.get("message") or "The upstream reported an error."))

    def _on_terminal(self, etype: str, d: dict[str, Any], data: str) -> list[ClientEvent]:
        self.acc.apply(etype, d)
        resp = self.acc.terminal or {}
        out = self._ensure_started()
        # Reconcile with the upstream's final output: items it never streamed are shown now, and calls
        # still waiting for a name take it from there.
        for item in resp.get("output") or ():
            if not isinstance(item, dict):
                continue
            st = self._match(item)
            if st is None:
                # Never streamed: shown now as a done-only item, under an index no upstream item uses.
                idx = 1_000_000 + len(self._items)
                out += self._on_item_done("response.output_item.done",
                                          {"output_index": idx, "item": item, "sequence_number": -1}, "")
            elif st.kind == "pending":
                if not item.get("name"):
                    break
                out += self._on_item_done("response.output_item.done",
                                          {"output_index": st.up.output_index, "item": item,
                                           "sequence_number": -1}, "")
            if self.finished:
                return out
        if any(st.kind == "pending" for st in self._items.values()):
            return out + self.fail("unnamed_tool_call",
                                   "The upstream produced a tool call whose name never arrived.")
        status = resp.get("status") if resp.get("status") in ("completed", "incomplete", "failed") else None
        if status is None:
            status = etype.removeprefix("response.") if etype != "response.completed" else "completed"
        if status == "completed" and self.owned_calls():
            # The tool loop runs these calls; the client response goes on (next_round) or ends (end).
            self.round_done = True
            self._round_terminal = resp
            return out
        return out + self._terminal(resp, status)

    def _terminal(self, resp: dict[str, Any], status: str) -> list[ClientEvent]:
        out = self._close_open_items("completed" if status == "completed" else "incomplete")
        if self._usage is not None:
            resp = {**resp, "usage": add_usage(self._usage, resp.get("usage"))}
        error = resp.get("error") if isinstance(resp.get("error"), dict) else None
        if status == "failed" and error is None:
            error = {"code": "upstream_failed", "message": "The upstream reported the response as failed."}
        final = restore_response(resp, self.state, output=self._final_output(), status=status, error=error)
        out.append(self._emit(_TERMINAL[status], {"response": final}))
        self.finished = True
        self.final_response = final
        return out

    def _match(self, item: dict[str, Any]) -> _Item | None:
        iid, cid = item.get("id"), item.get("call_id")
        for st in self._items.values():
            up = st.up.item
            if (iid and up.get("id") == iid) or (cid and up.get("call_id") == cid):
                return st
        return None

    # ------------------------------------------------------------------ items

    def _on_added(self, etype: str, d: dict[str, Any], data: str) -> list[ClientEvent]:
        out = self._ensure_started()
        up = self.acc.apply(etype, d)
        if up is None:
            return out
        st = self._items.get(up.output_index)
        if st is None:
            st = self._items[up.output_index] = _Item(up)
        item = up.item
        if item.get("type") == "function_call":
            if not up.name:
                st.kind = "pending"
                return out + self._hold(st, etype, d, data)
            out += self._open_call(st)
            return out
        st.kind = "pass"
        st.item_id = item.get("id")
        self._assign(st)
        return out + self._forward(etype, d, data, st.client_index)

    def _assign(self, st: _Item) -> None:
        st.client_index = self._next_index
        self._next_index += 1
        self._order.append(st)

    def _open_call(self, st: _Item) -> list[ClientEvent]:
        """Decide what the client sees of a call whose name is now known, and open it."""
        up = st.up
        if self._call_shown and not self.state.ctx.parallel_tool_calls:
            st.kind = "suppressed"
            self.stats.suppressed_calls += 1
            return []
        self._call_shown = True
        st.info = self.state.ctx.lookup(up.name)
        base = dict(up.item)
        base["name"] = up.name
        if st.info is not None and st.info.kind == "mcp":
            return self._open_owned(st)
        if st.info is not None and st.info.kind in BUILTIN_TOOL_TYPES:
            return self._open_builtin(st, base)
        if st.info is not None and st.info.kind == "web_search":
            st.kind = "web_search"  # announced when its query is complete (_close_search)
            st.round = self.round
            return []
        if st.info is not None and st.info.kind == "custom":
            st.kind = "custom"
            st.decoder = InputDecoder()
            self.stats.custom_calls += 1
            item = client_call_item(base, st.info, "")
            item["status"] = "in_progress"
        else:
            st.kind = "function"
            self.stats.function_calls += 1
            item = client_call_item(base, st.info)
            item["arguments"] = ""
            item["status"] = "in_progress"
        st.item_id = item.get("id")
        self._assign(st)
        return [self._emit("response.output_item.added", {"output_index": st.client_index, "item": item})]

    # ------------------------------------------------------------------ client-executed built-in tools

    def _open_builtin(self, st: _Item, base: dict[str, Any]) -> list[ClientEvent]:
        assert st.info is not None
        self.stats.builtin_calls += 1
        st.round = self.round
        if st.info.kind == "apply_patch":
            st.kind = "patch"  # announced when its operation's type and path are known (_patch_delta)
            st.patch = PatchStream(self.state.max_unnamed_call_bytes)
            return []
        st.kind = "builtin"
        if st.info.kind == "shell":  # its commands stream as response.shell_call_command.* events
            st.shell = ShellStream(self.state.max_unnamed_call_bytes)
        item = opening_item(st.info.kind, base)
        st.item_id = item["id"]
        self._assign(st)
        return [self._emit("response.output_item.added", {"output_index": st.client_index, "item": item})]

    def _open_patch(self, st: _Item, operation: dict[str, Any]) -> list[ClientEvent]:
        item = opening_item("apply_patch", {**st.up.item, "name": st.up.name}, {**operation, "diff": ""}
                            if operation.get("type") != "delete_file" else operation)
        st.item_id = item["id"]
        self._assign(st)
        return [self._emit("response.output_item.added", {"output_index": st.client_index, "item": item})]

    def _patch_delta(self, st: _Item, delta: str) -> list[ClientEvent]:
        assert st.patch is not None
        piece = st.patch.feed(delta)
        out: list[ClientEvent] = []
        if st.client_index < 0 and st.patch.operation is not None:
            out += self._open_patch(st, st.patch.operation)
        if piece and st.client_index >= 0:
            st.emitted.append(piece)
            out.append(self._emit("response.apply_patch_call_operation_diff.delta",
                                  {"item_id": st.item_id, "output_index": st.client_index, "delta": piece}))
        return out

    def _close_patch(self, st: _Item, status: str) -> list[ClientEvent]:
        """The authoritative operation from the complete arguments; a catch-up delta keeps the deltas'
        concatenation equal to the done diff (as custom inputs do)."""
        up = st.up
        final = builtin_call_item("apply_patch", {**up.item, "status": status}, up.arguments)
        operation = final["operation"]
        out: list[ClientEvent] = []
        if st.client_index < 0:
            out += self._open_patch(st, operation)
        base = {"item_id": st.item_id, "output_index": st.client_index}
        if "diff" in operation:
            diff, sent = str(operation["diff"]), "".join(st.emitted)
            if diff.startswith(sent):
                if diff[len(sent):]:
                    out.append(self._emit("response.apply_patch_call_operation_diff.delta",
                                          {**base, "delta": diff[len(sent):]}))
            else:
                self.stats.input_mismatches += 1  # the authoritative diff wins; the deltas were a guess
            out.append(self._emit("response.apply_patch_call_operation_diff.done", {**base, "diff": diff}))
        st.final = final
        out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": final}))
        return out

    def _shell_steps(self, st: _Item, steps: list[tuple[str, int, str]]) -> list[ClientEvent]:
        out: list[ClientEvent] = []
        for step, index, text in steps:
            etype, key = _SHELL_EVENTS[step]
            # item_id is not in the SDK's model of these events (extra fields are allowed): every other sub-event
            # names its item, and the stream invariants hold for these too.
            out.append(self._emit(etype, {"item_id": st.item_id, "output_index": st.client_index,
                                          "command_index": index, key: text}))
        return out

    def _close_shell(self, st: _Item, commands: list[str]) -> list[ClientEvent]:
        """The commands the stream did not finish, from the complete action (catch-up deltas as for diffs)."""
        shell = st.shell
        assert shell is not None
        steps: list[tuple[str, int, str]] = []
        for index, command in enumerate(commands):
            if index < len(shell.done):
                continue
            sent = shell.decoder.value if index == shell.index and shell.decoder is not None else ""
            if index > shell.index:
                steps.append(("added", index, ""))
            if command.startswith(sent) and command[len(sent):]:
                steps.append(("delta", index, command[len(sent):]))
            steps.append(("done", index, command))
        st.shell = None
        return self._shell_steps(st, steps)

    # ------------------------------------------------------------------ gateway-owned calls (MCP)

    def _open_owned(self, st: _Item) -> list[ClientEvent]:
        info = st.info
        assert info is not None
        label = str(info.definition.get("server_label"))
        server = self.state.ctx.mcp_server(label) or {}
        suffix = str(st.up.item.get("id") or "").partition("_")[2] or None
        if suffix and any(o.item_id and o.item_id.endswith("_" + suffix) for o in self._order):
            suffix = None  # an upstream that reuses an item id across rounds: the client's ids stay unique
        if approval_required(server, info.name) and self.mint_approval is not None:
            st.kind = "approval"  # announced when complete (_close_owned): its id binds the arguments
            st.round = self.round
            self.stats.mcp_calls += 1
            return []
        if approval_required(server, info.name):
            st.kind = "approval"
            item = approval_request_item(label, info.name, "", item_id=f"mcpr_{suffix}" if suffix else self.ids("mcpr"))
        else:
            st.kind = "mcp"
            item = mcp_call_item(label, info.name, "", item_id=f"mcp_{suffix}" if suffix else self.ids("mcp"))
        self.stats.mcp_calls += 1
        st.item_id = item["id"]
        st.opened = item
        st.round = self.round
        self._assign(st)
        return [self._emit("response.output_item.added", {"output_index": st.client_index, "item": dict(item)})]

    def _owned_sub_event(self, st: _Item, etype: str, d: dict[str, Any]) -> list[ClientEvent]:
        if st.kind != "mcp":
            return []  # an approval request shows its arguments when it is done
        base = {"item_id": st.item_id, "output_index": st.client_index}
        if etype == "response.function_call_arguments.delta":
            delta = str(d.get("delta", ""))
            return [self._emit("response.mcp_call_arguments.delta", {**base, "delta": delta})] if delta else []
        if etype == "response.function_call_arguments.done":
            return self._owned_args_done(st)
        return []

    def _owned_args_done(self, st: _Item) -> list[ClientEvent]:
        if st.args_done_sent:
            return []
        st.args_done_sent = True
        base = {"item_id": st.item_id, "output_index": st.client_index}
        return [self._emit("response.mcp_call_arguments.done", {**base, "arguments": st.up.arguments}),
                self._emit("response.mcp_call.in_progress", dict(base))]

    def _close_owned(self, st: _Item, status: str) -> list[ClientEvent]:
        if st.kind == "approval" and st.opened is None:  # deferred: mint the id over the complete call
            assert st.info is not None and self.mint_approval is not None
            label, args = str(st.info.definition.get("server_label")), st.up.arguments
            item = approval_request_item(label, st.info.name, "", item_id=self.mint_approval(label, st.info.name, args))
            st.item_id = item["id"]
            st.opened = item
            self._assign(st)
            st.final = {**item, "arguments": args}
            return [self._emit("response.output_item.added", {"output_index": st.client_index, "item": dict(item)}),
                    self._emit("response.output_item.done", {"output_index": st.client_index, "item": st.final})]
        assert st.opened is not None
        if st.kind == "approval":
            final = {**st.opened, "arguments": st.up.arguments}
            st.final = final
            return [self._emit("response.output_item.done", {"output_index": st.client_index, "item": final})]
        if status != "completed":  # cut off before the call could run
            out = self._owned_args_done(st)
            return out + self._owned_result(st, None, None, status="incomplete")
        return self._owned_args_done(st)  # stays open: the shell runs it (complete_owned)

    def owned_calls(self) -> list[dict[str, Any]]:
        """Gateway-owned calls of this round whose arguments are complete and that have not run yet (``kind``:
        ``mcp`` or ``web_search``)."""
        return [{"kind": "mcp", "key": st.item_id, "server_label": st.opened["server_label"],
                 "name": st.opened["name"], "arguments": st.up.arguments, "upstream_name": st.up.name}
                if st.kind == "mcp" else
                {"kind": "web_search", "key": st.item_id, "query": st.opened["action"]["query"] or None,
                 "arguments": st.up.arguments, "upstream_name": st.up.name}
                for st in self._order
                if st.final is None and st.opened is not None and (
                    (st.kind == "mcp" and st.args_done_sent) or st.kind == "web_search")]

    # ------------------------------------------------------------------ gateway-owned web search

    def _close_search(self, st: _Item, status: str) -> list[ClientEvent]:
        """The search call's arguments are complete: announce the ``web_search_call`` (kept open for the shell),
        or, cut off before it could run, show it incomplete."""
        if st.opened is not None:  # announced, never completed (the response ends under it)
            if st.final is not None:
                return []
            st.final = {**st.opened, "status": "incomplete"}
            return [self._emit("response.output_item.done", {"output_index": st.client_index, "item": st.final})]
        suffix = str(st.up.item.get("id") or "").partition("_")[2] or None
        if suffix and any(o.item_id and o.item_id.endswith("_" + suffix) for o in self._order):
            suffix = None
        item = search_item(f"ws_{suffix}" if suffix else self.ids("ws"), search_query_of(st.up.arguments),
                           "in_progress")
        st.item_id = item["id"]
        st.opened = item
        self._assign(st)
        base = {"item_id": st.item_id, "output_index": st.client_index}
        out = [self._emit("response.output_item.added", {"output_index": st.client_index, "item": dict(item)}),
               self._emit("response.web_search_call.in_progress", dict(base))]
        if status != "completed":
            st.final = {**item, "status": "incomplete"}
            out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": st.final}))
            return out
        out.append(self._emit("response.web_search_call.searching", dict(base)))
        return out

    def complete_search(self, key: str, final: dict[str, Any], sources: list[tuple[str, str]] | None = None
                        ) -> list[ClientEvent]:
        """A search ran (or was refused): ``response.web_search_call.completed`` when it completed, then the done
        item ``final`` (the shell's: status, sources per the include, the sealed results). ``sources`` (url,
        title): its results, numbered after the earlier ones for the citations."""
        st = next((s for s in self._order if s.item_id == key and s.kind == "web_search" and s.final is None), None)
        if st is None:
            return []
        self.sources += sources or []
        st.final = final
        out = []
        if final.get("status") == "completed":
            out.append(self._emit("response.web_search_call.completed",
                                  {"item_id": st.item_id, "output_index": st.client_index}))
        out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": final}))
        return out

    def _annotate(self, st: _Item, content_index: int, text: str) -> list[ClientEvent]:
        """``response.output_text.annotation.added`` for each citation marker in a finished text part."""
        found = citations(text, self.sources) if self.sources else []
        if not found:
            return []
        st.annotations[content_index] = found
        return [self._emit("response.output_text.annotation.added", {
            "item_id": st.item_id, "output_index": st.client_index, "content_index": content_index,
            "annotation_index": i, "annotation": ann}) for i, ann in enumerate(found)]

    def _with_annotations(self, st: _Item, item: dict[str, Any]) -> dict[str, Any]:
        if not st.annotations or item.get("type") != "message" or not isinstance(item.get("content"), list):
            return item
        content = [{**part, "annotations": [*(part.get("annotations") or ()), *st.annotations[ci]]}
                   if ci in st.annotations and isinstance(part, dict) else part
                   for ci, part in enumerate(item["content"])]
        return {**item, "content": content}

    @property
    def approval_requested(self) -> bool:
        return any(st.kind == "approval" and st.round == self.round for st in self._order)

    @property
    def client_calls_in_round(self) -> bool:
        return any(st.kind in ("custom", "function", "patch", "builtin") and st.round == self.round
                   for st in [*self._order, *self._items.values()])

    def complete_owned(self, key: str, output: str | None = None, error: dict[str, Any] | None = None
                       ) -> list[ClientEvent]:
        """A gateway-owned call ran: ``response.mcp_call.completed`` (or ``.failed``), then its done item."""
        st = next((s for s in self._order if s.item_id == key and s.kind == "mcp" and s.final is None), None)
        if st is None:
            return []
        return self._owned_result(st, output, error, status="failed" if error is not None else "completed")

    def _owned_result(self, st: _Item, output: str | None, error: dict[str, Any] | None, *, status: str
                      ) -> list[ClientEvent]:
        assert st.opened is not None
        final = {**st.opened, "arguments": st.up.arguments, "output": output, "error": error, "status": status}
        st.final = final
        base = {"item_id": st.item_id, "output_index": st.client_index}
        out = []
        if status in ("completed", "failed"):
            out.append(self._emit(f"response.mcp_call.{status}", dict(base)))
        out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": final}))
        return out

    def owned_item(self, item: dict[str, Any], events: list[tuple[str, dict[str, Any]]],
                   final: dict[str, Any] | None = None) -> list[ClientEvent]:
        """An item the gateway made itself (``mcp_list_tools``, a call run after approval): added, ``events``
        (given without item_id/output_index), done."""
        out = self._ensure_started()
        st = _Item(UpstreamItem(-1), kind="owned", item_id=item.get("id"), round=self.round)
        self._assign(st)
        base = {"item_id": st.item_id, "output_index": st.client_index}
        out.append(self._emit("response.output_item.added", {"output_index": st.client_index, "item": dict(item)}))
        for etype, payload in events:
            out.append(self._emit(etype, {**base, **payload}))
        st.final = final if final is not None else item
        out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": st.final}))
        return out

    def round_items(self) -> list[dict[str, Any]]:
        """The public items of the round that just ended (the next round's history)."""
        return [st.final for st in self._order if st.round == self.round and st.final is not None]

    def next_round(self) -> None:
        """Read the next upstream response into the same client response."""
        if self._round_terminal is not None:
            self._usage = add_usage(self._usage, self._round_terminal.get("usage"))
        self._round_terminal = None
        self.round += 1
        self.round_done = False
        self.finished = False
        self.acc = ResponseAccumulator()
        self._items = {}
        self._call_shown = False  # parallel_tool_calls: false allows one call per round

    def end(self, usage: dict[str, Any] | None = None) -> list[ClientEvent]:
        """End the client response after a round whose calls ran (no further round); ``usage`` is added."""
        if self.finished:
            return []
        if usage is not None:
            self._usage = add_usage(self._usage, usage)
        resp = self._round_terminal or self.acc.snapshot or {}
        self._round_terminal = None
        self.round_done = False
        return self._terminal(dict(resp), "completed")

    def _hold(self, st: _Item, etype: str, d: dict[str, Any], data: str) -> list[ClientEvent]:
        size = len(data) if data else len(orjson.dumps(d))
        self._held_bytes += size
        self.stats.held_bytes_peak = max(self.stats.held_bytes_peak, self._held_bytes)
        if self._held_bytes > self.state.max_unnamed_call_bytes:
            self.stats.overflowed = True
            return self.fail(
                "unnamed_call_buffer_overflow",
                f"A tool call's name did not arrive within {self.state.max_unnamed_call_bytes} bytes of its "
                "frames; the gateway stopped the response rather than buffer without bound.",
            )
        st.held.append((etype, d, data))
        return []

    def _release(self, st: _Item) -> list[ClientEvent]:
        """The name arrived: open the call and replay its held frames in their original order."""
        held, st.held = st.held, []
        self._held_bytes -= sum(len(h[2]) for h in held)
        out = self._open_call(st)
        for etype, d, data in held:
            if etype == "response.output_item.added":
                continue
            out += self._route_sub_event(st, etype, d, data)
        return out

    def _on_sub_event(self, etype: str, d: dict[str, Any], data: str) -> list[ClientEvent]:
        idx = d["output_index"]
        st = self._items.get(idx) if isinstance(idx, int) else None
        if st is None:
            if not isinstance(idx, int):
                return []
            # An event for an item that was never added: hold it until its output_item.done says what it is.
            up = self.acc.item(idx)
            st = self._items[idx] = _Item(up, kind="pending")
        up = self.acc.apply(etype, d) or st.up
        if st.kind == "pending":
            if etype == "response.function_call_arguments.done" and up.name and up.type == "function_call":
                return self._release(st) + self._route_sub_event(st, etype, d, data, applied=True)
            return self._hold(st, etype, d, data)
        return self._route_sub_event(st, etype, d, data, applied=True)

    def _route_sub_event(self, st: _Item, etype: str, d: dict[str, Any], data: str,
                         applied: bool = True) -> list[ClientEvent]:
        kind = st.kind
        if kind == "custom":  # first: the hottest kind (every input delta of a custom call)
            if etype == "response.function_call_arguments.delta":
                assert st.decoder is not None
                return self._custom_input(st, st.decoder.feed(str(d.get("delta", ""))))
            if etype == "response.custom_tool_call_input.delta":  # the input itself (a takeover step's content)
                return self._custom_input(st, str(d.get("delta", "")))
            if etype == "response.function_call_arguments.done":
                return self._custom_done(st, str(d.get("arguments", "")))
            return []  # nothing else belongs to a custom call
        if kind == "builtin":
            if st.shell is not None and etype == "response.function_call_arguments.delta":
                return self._shell_steps(st, st.shell.feed(str(d.get("delta", ""))))
            return []  # the rest of a shell call's action is shown when complete
        if kind == "suppressed":
            return []
        if kind == "patch":
            return self._patch_delta(st, str(d.get("delta", ""))) \
                if etype == "response.function_call_arguments.delta" else []
        if kind == "mcp" or kind == "approval":
            return self._owned_sub_event(st, etype, d)
        if kind == "web_search":
            return []  # its arguments are the query, shown in the item once complete
        if self.sources and kind == "pass":
            if etype == "response.output_text.done" and isinstance(ci := d.get("content_index"), int):
                return self._annotate(st, ci, str(d.get("text", ""))) + self._forward(etype, d, data, st.client_index)
            if etype == "response.content_part.done" and d.get("content_index") in st.annotations \
                    and isinstance(d.get("part"), dict):
                ci = d["content_index"]
                part = d["part"]
                d["part"] = {**part, "annotations": [*(part.get("annotations") or ()), *st.annotations[ci]]}
                d["output_index"] = st.client_index
                return [self._emit(etype, d)]
        if kind == "function" and etype == "response.function_call_arguments.done":
            st.args_done_sent = True
            if st.info is not None or not d.get("name"):
                d["name"] = st.info.name if st.info is not None else st.up.name
                d["output_index"] = st.client_index
                d["item_id"] = st.item_id
                return [self._emit(etype, d)]
        if "item_id" in d and st.item_id is not None and d["item_id"] != st.item_id:
            d["item_id"] = st.item_id
            d["output_index"] = st.client_index
            return [self._emit(etype, d)]
        return self._forward(etype, d, data, st.client_index)

    def _custom_input(self, st: _Item, piece: str) -> list[ClientEvent]:
        """Decoded input text (from the arguments' decoder, or as an upstream sent it) -> its client delta."""
        if not piece:
            return []
        st.emitted.append(piece)
        return [self._emit("response.custom_tool_call_input.delta",
                           {"item_id": st.item_id, "output_index": st.client_index, "delta": piece})]

    def _custom_done(self, st: _Item, arguments: str) -> list[ClientEvent]:
        """Settle the input; a catch-up delta keeps the deltas' concatenation equal to the done input."""
        if st.input_done is not None:
            return []
        value = final_input(arguments, st.decoder)
        if value == arguments and arguments and not _is_input_json(arguments):
            self.stats.raw_inputs += 1  # the I/O shell logs this at debug level (never the input itself)
        sent = "".join(st.emitted)
        out: list[ClientEvent] = []
        if value.startswith(sent):
            rest = value[len(sent):]
            if rest:
                st.emitted.append(rest)
                out.append(self._emit("response.custom_tool_call_input.delta",
                                      {"item_id": st.item_id, "output_index": st.client_index, "delta": rest}))
        else:
            self.stats.input_mismatches += 1  # the authoritative value wins; the deltas were a guess
        st.input_done = value
        out.append(self._emit("response.custom_tool_call_input.done",
                              {"item_id": st.item_id, "output_index": st.client_index, "input": value}))
        return out

    def _on_item_done(self, etype: str, d: dict[str, Any], data: str) -> list[ClientEvent]:
        out = self._ensure_started()
        idx = d.get("output_index")
        if not isinstance(idx, int):
            return out
        existing = self._items.get(idx)
        up = self.acc.apply(etype, d)
        if up is None:
            return out
        st = existing
        if st is None:
            st = self._items[idx] = _Item(up)
        item = up.item
        if existing is None or (st.kind == "pending" and st.client_index < 0 and not st.held):
            # Done-only: the upstream never announced this item; show a complete lifecycle now.
            return out + self._done_only(st)
        if st.kind == "pending":
            if item.get("type") != "function_call" or not up.name:
                if item.get("type") == "function_call":
                    return out + self.fail("unnamed_tool_call",
                                           "The upstream finished a tool call without ever naming it.")
                held, st.held = st.held, []
                self._held_bytes -= sum(len(h[2]) for h in held)
                return out + self._done_only(st)
            out += self._release(st)
        # "incomplete": a grammar call the engine found cut short (gateway.engine.grammar_routes.mark_cut_calls).
        return out + self._close_item(st, "incomplete" if item.get("status") == "incomplete" else "completed")

    def _done_only(self, st: _Item) -> list[ClientEvent]:
        up = st.up
        item = up.item
        out: list[ClientEvent] = []
        if item.get("type") == "function_call":
            if not up.name:
                return self.fail("unnamed_tool_call", "The upstream finished a tool call without ever naming it.")
            out += self._open_call(st)
            if st.kind == "suppressed":
                return out
            if st.kind in ("patch", "builtin", "web_search"):
                return out + self._close_item(st, "completed")
            if st.kind in ("mcp", "approval"):
                if st.kind == "mcp" and up.arguments:
                    out += self._owned_sub_event(st, "response.function_call_arguments.delta",
                                                 {"delta": up.arguments})
                return out + self._close_item(st, "completed")
            if st.kind == "custom":
                out += self._custom_done(st, up.arguments)
            else:
                args = up.arguments
                if args:
                    out.append(self._emit("response.function_call_arguments.delta",
                                          {"item_id": st.item_id, "output_index": st.client_index, "delta": args}))
                out += self._args_done(st)
            return out + self._close_item(st, "incomplete" if item.get("status") == "incomplete" else "completed")
        st.kind = "pass"
        st.item_id = item.get("id")
        self._assign(st)
        opened = _opening(item)
        out.append(self._emit("response.output_item.added", {"output_index": st.client_index, "item": opened}))
        out += self._synthesize_parts(st, item)
        return out + self._close_item(st, "completed")

    def _synthesize_parts(self, st: _Item, item: dict[str, Any]) -> list[ClientEvent]:
        out: list[ClientEvent] = []
        base = {"item_id": st.item_id, "output_index": st.client_index}
        itype = item.get("type")
        if itype == "message":
            for ci, part in enumerate(item.get("content") or ()):
                if not isinstance(part, dict) or part.get("type") != "output_text":
                    continue
                text = str(part.get("text", ""))
                out.append(self._emit("response.content_part.added", {
                    **base, "content_index": ci, "part": {"type": "output_text", "text": "", "annotations": []}}))
                if text:
                    out.append(self._emit("response.output_text.delta",
                                          {**base, "content_index": ci, "delta": text, "logprobs": []}))
                out += self._annotate(st, ci, text)
                out.append(self._emit("response.output_text.done",
                                      {**base, "content_index": ci, "text": text, "logprobs": []}))
                if ci in st.annotations:
                    part = {**part, "annotations": [*(part.get("annotations") or ()), *st.annotations[ci]]}
                out.append(self._emit("response.content_part.done", {**base, "content_index": ci, "part": part}))
        elif itype == "reasoning":
            for ci, part in enumerate(item.get("content") or ()):
                if not isinstance(part, dict):
                    continue
                text = str(part.get("text", ""))
                out.append(self._emit("response.content_part.added", {
                    **base, "content_index": ci, "part": {"type": "reasoning_text", "text": ""}}))
                if text:
                    out.append(self._emit("response.reasoning_text.delta",
                                          {**base, "content_index": ci, "delta": text}))
                out.append(self._emit("response.reasoning_text.done", {**base, "content_index": ci, "text": text}))
                out.append(self._emit("response.content_part.done", {**base, "content_index": ci, "part": part}))
        return out

    def _args_done(self, st: _Item) -> list[ClientEvent]:
        if st.args_done_sent:
            return []
        st.args_done_sent = True
        name = st.info.name if st.info is not None else st.up.name
        return [self._emit("response.function_call_arguments.done", {
            "item_id": st.item_id, "output_index": st.client_index, "arguments": st.up.arguments, "name": name})]

    def _close_item(self, st: _Item, status: str) -> list[ClientEvent]:
        """``output_item.done`` with the authoritative item (the upstream's done item, or what we built)."""
        if st.kind == "web_search":
            return self._close_search(st, status)
        if st.kind == "approval" and st.opened is None and st.final is None and status == "completed":
            return self._close_owned(st, status)  # a deferred approval request, complete now
        if st.kind == "patch" and st.final is None:
            return self._close_patch(st, status)
        if st.kind == "suppressed" or st.client_index < 0 or st.final is not None:
            return []
        if st.kind in ("mcp", "approval"):
            return self._close_owned(st, status)
        if st.kind == "announced":  # still being made by the gateway when the response ended: as announced
            st.final = dict(st.opened or {})
            return [self._emit("response.output_item.done", {"output_index": st.client_index, "item": st.final})]
        up = st.up
        out: list[ClientEvent] = []
        if st.kind == "custom":
            out += self._custom_done(st, up.arguments)
            final = client_call_item({**up.item, "name": up.name}, st.info, st.input_done)
            final["status"] = status
        elif st.kind == "builtin":
            assert st.info is not None
            final = builtin_call_item(st.info.kind, {**up.item, "status": status}, up.arguments)
            if st.shell is not None:
                out += self._close_shell(st, final["action"]["commands"])
        elif st.kind == "function":
            out += self._args_done(st)
            final = client_call_item({**up.item, "name": up.name, "arguments": up.arguments}, st.info)
            final["status"] = status
        else:
            final = dict(up.item)
            if not up.done:
                final = _with_partial_text(final, up)
                final["status"] = status
            final = self._with_annotations(st, self.state.with_sealed(final))
        st.final = final
        out.append(self._emit("response.output_item.done", {"output_index": st.client_index, "item": final}))
        return out

    def _close_open_items(self, status: str) -> list[ClientEvent]:
        out: list[ClientEvent] = []
        for st in self._order:
            if st.open:
                out += self._close_item(st, status)
        for st in list(self._items.values()):
            if st.kind == "patch" and st.final is None:  # never announced: shown with what arrived
                out += self._close_patch(st, status)
        return out

    def _final_output(self) -> list[dict[str, Any]]:
        return [st.final for st in self._order if st.final is not None]


def _lead_events(item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The progress events of an item the gateway makes before the model answers."""
    return [("response.compaction.compacting", {})] if item.get("type") == "compaction" else []


def _is_input_json(arguments: str) -> bool:
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, str) or (isinstance(parsed, dict) and isinstance(parsed.get("input"), str))


def _opening(item: dict[str, Any]) -> dict[str, Any]:
    """The ``output_item.added`` form of a finished item: same identity, empty accumulators."""
    opened = dict(item)
    opened["status"] = "in_progress"
    if item.get("type") == "message":
        opened["content"] = []
    elif item.get("type") == "reasoning":
        opened["summary"] = []
        if "content" in opened:
            opened["content"] = []
    return opened


def _with_partial_text(item: dict[str, Any], up: UpstreamItem) -> dict[str, Any]:
    if item.get("type") == "message" and up.texts:
        item["content"] = [{"type": "output_text", "text": up.text(ci), "annotations": [], "logprobs": []}
                           for ci in sorted(up.texts)]
    elif item.get("type") == "reasoning" and up.texts:
        item["content"] = [{"type": "reasoning_text", "text": up.text(ci)} for ci in sorted(up.texts)]
    return item
