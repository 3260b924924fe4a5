"""The tool loop: one client response over several upstream rounds, running gateway-owned (MCP) calls between
them. Transport-independent: it yields the client's events, which the HTTP handler streams (or collects for
a non-streamed answer), and which the WebSocket transport and background runs consume too. No starlette here.

A response with MCP tools runs as:

1. *Listing* (before any upstream request): for each MCP server, its tools are listed (``tools/list``, filtered
   by ``allowed_tools``) — or reused from an ``mcp_list_tools`` item already in the conversation, except for a
   servers-file server, whose listing is never taken from the client — and shown as an ``mcp_list_tools`` item.
   A server that cannot be listed gets the item's ``error`` and is left out.
2. *Approvals* carried by the input (``mcp_approval_response``): approved calls run now and are shown as
   ``mcp_call`` items with their ``approval_request_id``; denied ones are told to the model (rewrite.py).
   An approval runs a call only if this gateway issued that request to this owner: its id is a MAC over the
   owner, server, tool and arguments (gateway.translate.approvals), checked whether the request comes from the
   stored chain or from the input (``store: false``; there it also has not expired); the tool must still be
   listed and allowed; a call already run (in the chain or the input, or spent in this process) is not run
   again. Anything else is a 400 naming ``input[N].approval_request_id`` before any server is contacted.
3. *Rounds*: the upstream answers; calls of listed tools are gateway-owned (the translator shows ``mcp_call``
   items and keeps them open); at the round's end the gateway runs them (a few at a time, each with
   ``--mcp-call-timeout``), shows their results and sends the conversation plus those calls and outputs
   upstream again, into the same client response. A round that also calls client tools, or asks for an
   approval, ends the response there (its gateway-owned calls run first).
4. *Bounds*: ``max_tool_calls`` caps the calls run per response, ``--max-tool-rounds`` the rounds that run
   calls; past either, one more round runs with the tools withheld so the model answers in text.

Web search (gateway.engine.web_search) runs on the same loop: a call of the search function is a gateway-owned
``web_search_call``, searched between rounds like an MCP call and counted against the same bounds.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import structlog

from gateway.config import Settings
from gateway.engine.drain import Drain, ShuttingDown
from gateway.engine.outcome import Persist
from gateway.engine.web_search import SearchOutcome, WebSearchRunner
from gateway.errors import InvalidRequest
from gateway.protocol.events import ClientEvent
from gateway.runtime import new_id
from gateway.translate.approvals import ApprovalSigner
from gateway.translate.mcp_items import CEILING_APPROVAL, McpCallOutcome, list_tools_item, mcp_call_item, tool_allowed
from gateway.translate.restore import RequestState
from gateway.translate.tool_context import ResolvedToolContext, with_mcp_tools
from gateway.translate.translator import FunctionSseTranslator
from gateway.translate.web_search import RESULTS_KEY, search_item

if TYPE_CHECKING:
    from gateway.engine.record import RequestRecord

log = structlog.get_logger("gateway.mcp")

__all__ = ["CALL_CONCURRENCY", "LazyMcpHub", "McpExecutor", "McpHub", "Shown", "ToolLoop", "approvals_in",
           "reused_listings"]

CALL_CONCURRENCY = 4  # calls of one round run at most this many at a time
WITHHELD = {"type": "mcp_tool_execution_error",
            "content": [{"type": "text", "text": "Not run: the response reached its tool-round or call bound."}]}
SHUTDOWN = {"type": "http_error", "code": 503, "message": "The gateway shut down before the call finished."}
NOT_RUN = {"type": "mcp_tool_execution_error",
           "content": [{"type": "text", "text": "Not run: the response reached max_tool_calls."}]}


@dataclass(frozen=True, slots=True)
class Shown:
    """A gateway-made item: as announced, its events (without item_id/output_index), as done."""

    opened: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    final: dict[str, Any]


class McpExecutor(Protocol):
    """What the loop needs from the MCP I/O layer (gateway.mcp), per server label."""

    async def list_tools(self, label: str) -> list[dict[str, Any]]: ...

    async def call_tool(self, label: str, name: str, arguments: dict[str, Any]) -> McpCallOutcome: ...

    def metric_label(self, label: str) -> str:
        """``label`` as a metric label value: an operator-defined label, else ``other``."""
        ...


class McpHub(Protocol):
    """Binds one request's MCP tools to their servers (allowlist, servers file, credentials, pooled sessions):
    the context with servers-file defaults merged in, and the executor (raises InvalidRequest first)."""

    def bind(self, ctx: ResolvedToolContext, body: Mapping[str, Any], owner: str | None = None
             ) -> tuple[ResolvedToolContext, McpExecutor]:
        ...


class LazyMcpHub:
    """The process's hub, built on the first request with mcp tools: the MCP SDK costs ~20 MB of RSS, which a
    gateway that never runs MCP tools should not pay. A servers file is loaded (and checked) at start-up."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self._hub: Any = None
        if settings.mcp_servers_file:
            self._load()

    def _load(self) -> Any:
        if self._hub is None:
            from gateway.mcp.hub import GatewayMcpHub

            self._hub = GatewayMcpHub(self.settings)
        return self._hub

    def bind(self, ctx: ResolvedToolContext, body: Mapping[str, Any], owner: str | None = None
             ) -> tuple[ResolvedToolContext, McpExecutor]:
        hub: McpHub = self._load()
        return hub.bind(ctx, body, owner)

    async def aclose(self) -> None:
        if self._hub is not None:
            await self._hub.aclose()


def reused_listings(history: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The last successful ``mcp_list_tools`` item per server label already in the conversation."""
    found: dict[str, dict[str, Any]] = {}
    for item in history:
        if isinstance(item, dict) and item.get("type") == "mcp_list_tools" and not item.get("error"):
            found[str(item.get("server_label"))] = item
    return found


_SIGNERS: dict[str, ApprovalSigner] = {}
_SIGNERS_LOCK = threading.Lock()


def approval_signer(reasoning_key: str | None) -> ApprovalSigner:
    """The process's signer for the resolved reasoning key (gateway.server.keys: --reasoning-key or the store's)."""
    from gateway.translate.sealing import parse_keys

    if not reasoning_key:
        raise RuntimeError("approval ids need a resolved reasoning key (gateway.server.keys)")
    with _SIGNERS_LOCK:
        signer = _SIGNERS.get(reasoning_key)
        if signer is None:
            signer = _SIGNERS[reasoning_key] = ApprovalSigner(parse_keys(reasoning_key), random_bytes=os.urandom,
                                                              clock=time.time)
        return signer


def server_identity(server: Mapping[str, Any] | None) -> str:
    """What an approval request's MAC binds of its server: a servers-file label, or the request's URL."""
    if server is None:
        return ""
    if CEILING_APPROVAL in server:
        return f"configured:{server.get('server_label')}"
    return f"url:{server.get('server_url')}"


def approvals_in(items: Sequence[Any], history: Sequence[Any], verify: Any = None
                 ) -> list[tuple[dict[str, Any], dict[str, Any], int]]:
    """``(approval response, the request it answers, input index)`` for each ``mcp_approval_response`` of the
    new input whose call has not run yet; an answer to a request the conversation does not hold is the client's
    mistake (400). ``verify(request, from_history)``: None when an *approved* request was issued by this gateway
    to this caller, else why not (400)."""
    stored = {i.get("id"): i for i in history if isinstance(i, dict) and i.get("type") == "mcp_approval_request"}
    sent = {i.get("id"): i for i in items if isinstance(i, dict) and i.get("type") == "mcp_approval_request"}
    # A client resending the whole history (store: false) resends answers already acted on: the mcp_call that
    # carries the request's id is there too, and the call must not run again.
    done = {i.get("approval_request_id") for i in [*history, *items]
            if isinstance(i, dict) and i.get("type") == "mcp_call" and i.get("approval_request_id")}
    out = []
    for idx, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type") != "mcp_approval_response":
            continue
        rid = item.get("approval_request_id")
        param = f"input[{idx}].approval_request_id"
        if not isinstance(item.get("approve"), bool):
            raise InvalidRequest("An mcp_approval_response needs a boolean 'approve'.", param=f"input[{idx}].approve",
                                 code="invalid_value")
        request = stored.get(rid) or sent.get(rid)
        if request is None:
            raise InvalidRequest(f"No mcp_approval_request with id '{rid}' in this conversation.", param=param,
                                 code="invalid_value")
        if rid in done:
            continue
        if item["approve"] and verify is not None and (why := verify(request, rid in stored)) is not None:
            raise InvalidRequest(f"The mcp_approval_request '{rid}' cannot be approved: {why}.", param=param,
                                 code="invalid_value")
        out.append((item, request, idx))
    return out


def _parse_args(arguments: str) -> dict[str, Any] | None:
    """The call's arguments as an object; empty or ``null`` (what small models write for no arguments) is {}."""
    try:
        value = orjson.loads(arguments.strip() or "{}")
    except orjson.JSONDecodeError:
        return None
    if value is None:
        return {}
    return value if isinstance(value, dict) else None


class RoundHost(Protocol):
    """What the loop needs from the engine (gateway.engine.respond): an upstream round pumped into the loop's
    translator, and the response stored once the loop ends it itself."""

    settings: Settings
    drain: Drain | None

    def loop_round(self, loop: ToolLoop, translator: FunctionSseTranslator, round_history: list[dict[str, Any]],
                   withhold: bool) -> AsyncIterator[list[ClientEvent]]: ...

    async def loop_finished(self, translator: FunctionSseTranslator, record: RequestRecord, persist: Persist | None,
                            frames: list[ClientEvent] | None = None) -> None: ...


class ToolLoop:
    """One response's rounds; ``host`` opens the upstream rounds and pumps them."""

    def __init__(self, host: RoundHost, body: dict[str, Any], state: RequestState, history: list[dict[str, Any]],
                 headers: Mapping[str, str], extra: Mapping[str, str], record: RequestRecord,
                 persist: Persist | None, executor: McpExecutor, owner: str | None = None,
                 searcher: WebSearchRunner | None = None) -> None:
        self.host = host
        self.settings = host.settings
        self.body = body
        self.state = state
        self.history = history
        self.headers = headers
        self.extra = extra
        self.record = record
        self.persist = persist
        self.executor = executor
        self.owner = owner
        self.signer = approval_signer(self.settings.reasoning_key)
        self.approved: list[tuple[dict[str, Any], dict[str, Any], int]] = []
        raw = body.get("input")
        self.new_input: list[Any] = ([{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str)
                                     else list(raw) if isinstance(raw, list) else [])
        mtc = body.get("max_tool_calls")
        self.max_calls = mtc if isinstance(mtc, int) and mtc >= 0 else None
        self.executed = 0
        self.searcher = searcher

    # ------------------------------------------------------------------ before the first round

    def check_approvals(self) -> None:
        """400 for an answer to a request this gateway did not issue to this caller (before anything runs)."""
        self.approved = approvals_in(self.new_input, self.history, self._verify)

    def _verify(self, request: Mapping[str, Any], from_history: bool) -> str | None:
        server = self.state.ctx.mcp_server(str(request.get("server_label")))
        if server is None:
            return f"its server '{request.get('server_label')}' is not among this request's mcp tools"
        return self.signer.verify(request.get("id"), self.owner, server_identity(server), str(request.get("name")),
                                  str(request.get("arguments") or ""), check_expiry=not from_history)

    def _mint(self, label: str, name: str, arguments: str) -> str:
        return self.signer.mint(self.owner, server_identity(self.state.ctx.mcp_server(label)), name, arguments)

    def _claim_approvals(self, ctx: ResolvedToolContext) -> None:
        """The approved tools must still be listed and allowed (400 otherwise); each approval runs once."""
        claimed = []
        for response, request, idx in self.approved:
            if response.get("approve") is True:
                label, name = str(request.get("server_label")), str(request.get("name"))
                if ctx.find_mcp(label, name) is None:
                    raise InvalidRequest(f"The approved tool '{name}' is not offered by the MCP server '{label}' "
                                         "(not listed, or not in allowed_tools).",
                                         param=f"input[{idx}].approval_request_id", code="invalid_value")
            claimed.append((response, request, idx))
        self.approved = [(r, q, i) for r, q, i in claimed
                         if r.get("approve") is not True or self.signer.spend(str(q.get("id")))]

    async def prepare(self) -> tuple[RequestState, list[Shown]]:
        """List (or reuse) every server's tools; the state with them, and the listing items to show.

        Runs before the response starts, so a ``tool_choice`` naming a tool the server does not have is
        still a clean 400."""
        ctx = self.state.ctx
        reused = reused_listings([*self.history, *self.new_input])  # the chain, or the history the client sent
        # A listing the client sent is its word: a servers-file server (the operator's credentials) is listed anew.
        reused = {label: item for label, item in reused.items()
                  if CEILING_APPROVAL not in (ctx.mcp_server(label) or {})}
        listed: dict[str, list[dict[str, Any]]] = {}
        shown: list[Shown] = []
        to_list = [str(t["server_label"]) for t in ctx.mcp_tools if str(t["server_label"]) not in reused]
        results = await asyncio.gather(*(self._list(label) for label in to_list))
        for label, (tools, error) in zip(to_list, results, strict=True):
            server = ctx.mcp_server(label) or {}
            tools = [t for t in tools if tool_allowed(server, t)]
            item = list_tools_item(label, tools, error, item_id=new_id("mcpl"))
            status = "failed" if error else "completed"
            shown.append(Shown({**item, "tools": [], "error": None}, [("response.mcp_list_tools.in_progress", {}),
                                                                      (f"response.mcp_list_tools.{status}", {})],
                               item))
            if not error:
                listed[label] = item["tools"]
        for label, item in reused.items():
            if ctx.mcp_server(label) is None:
                continue
            server = ctx.mcp_server(label) or {}
            listed[label] = [t for t in item.get("tools") or () if isinstance(t, dict) and tool_allowed(server, t)]
        new_ctx = with_mcp_tools(ctx, listed)
        self._claim_approvals(new_ctx)
        return replace(self.state, ctx=new_ctx), shown

    async def _list(self, label: str) -> tuple[list[dict[str, Any]], str | None]:
        started = time.perf_counter()
        try:
            tools = await self.executor.list_tools(label)
        except Exception as exc:  # the response goes on without that server's tools
            log.warning("mcp_list_tools_failed", request_id=self.record.request_id, server_label=label,
                        error=type(exc).__name__, duration_ms=round((time.perf_counter() - started) * 1000, 1))
            return [], f"Could not list the tools of MCP server '{label}' ({type(exc).__name__})."
        log.info("mcp_list_tools", request_id=self.record.request_id, server_label=label, tools=len(tools),
                 duration_ms=round((time.perf_counter() - started) * 1000, 1))
        return tools, None

    # ------------------------------------------------------------------ the rounds

    async def frames(self, state: RequestState, shown: list[Shown]) -> AsyncGenerator[list[ClientEvent], None]:
        translator = FunctionSseTranslator(state, mint_approval=self._mint, ids=new_id)
        self.translator = translator
        out: list[ClientEvent] = []
        for item in shown:
            out += translator.owned_item(item.opened, item.events, item.final)
        round_history: list[dict[str, Any]] = []
        # Approved calls from the input run first; their results are history for the first round.
        for response, request, _ in self.approved:
            if response.get("approve") is not True:
                continue
            ran = await self._run_approved(request, response)
            out += translator.owned_item(mcp_call_item(ran["server_label"], ran["name"], "",
                                                       item_id=ran["id"],
                                                       approval_request_id=ran["approval_request_id"]),
                                         _call_events(ran), ran)
            round_history.append(ran)
        if not out:
            out += translator.start()
        yield out
        rounds_run = 0
        while True:
            withhold = rounds_run >= self.settings.max_tool_rounds or (
                self.max_calls is not None and self.executed >= self.max_calls)
            async for chunk in self.host.loop_round(self, translator, round_history, withhold):
                yield chunk
            if translator.finished or not translator.round_done:
                return
            calls = translator.owned_calls()
            if withhold:  # the tools were withheld and the model called one anyway: shown, not run
                for call in calls:
                    if call["kind"] == "web_search":
                        yield self._search_not_run(translator, call, "Not searched: the response reached its "
                                                   "tool-round or call bound.")
                        continue
                    self.record.mcp_calls.append((self._metric_label(call["server_label"]), "not_run", None))
                    yield translator.complete_owned(call["key"], error=WITHHELD)
            else:
                async for chunk in self._run_calls(translator, calls):
                    yield chunk
                if translator.finished:
                    return
            # This round's items (the approved calls run before it share its number: not twice); a search as
            # the model read it.
            round_history += [self._as_read(i) for i in translator.round_items()
                              if not any(i is r for r in round_history)]
            rounds_run += 1
            if withhold or translator.client_calls_in_round or translator.approval_requested:
                frames = translator.end()
                await self.host.loop_finished(translator, self.record, self.persist, frames)
                yield frames
                return
            translator.next_round()

    def round_body(self, round_history: list[dict[str, Any]], withhold: bool) -> tuple[dict[str, Any],
                                                                                     ResolvedToolContext]:
        """The upstream request of the next round: the new input plus what earlier rounds did."""
        ctx = self.translator.state.ctx
        body = {k: v for k, v in self.body.items() if k != "max_tool_calls"}  # the gateway enforces it
        body["input"] = [*self.new_input, *round_history]
        if withhold:
            ctx = replace(ctx, upstream_tool_choice="none", allowed_upstream_names=None)
        elif round_history or self.translator.round > 0:
            # tool_choice pins the first round only; later rounds let the model answer.
            if ctx.upstream_tool_choice not in ("auto", "none"):
                ctx = replace(ctx, upstream_tool_choice="auto", allowed_upstream_names=None)
        return body, ctx

    async def _run_calls(self, translator: FunctionSseTranslator, calls: list[dict[str, Any]]
                         ) -> AsyncIterator[list[ClientEvent]]:
        budget = None if self.max_calls is None else max(self.max_calls - self.executed, 0)
        runnable = calls if budget is None else calls[:budget]
        for call in calls[len(runnable):]:
            if call["kind"] == "web_search":
                yield self._search_not_run(translator, call, "Not searched: the response reached max_tool_calls.")
                continue
            self.record.mcp_calls.append((self._metric_label(call["server_label"]), "not_run", None))
            yield translator.complete_owned(call["key"], error=NOT_RUN)
        self.executed += len(runnable)
        sem = asyncio.Semaphore(CALL_CONCURRENCY)

        async def one(call: dict[str, Any]) -> tuple[dict[str, Any], McpCallOutcome | SearchOutcome]:
            async with sem:
                if call["kind"] == "web_search":
                    return call, await self._search(call)
                return call, await self._call(call["server_label"], call["name"], call["arguments"])

        tasks = [asyncio.ensure_future(one(c)) for c in runnable]

        async def results() -> AsyncGenerator[tuple[dict[str, Any], McpCallOutcome | SearchOutcome], None]:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done

        drain = self.host.drain
        source = drain.guard(results()) if drain is not None else results()
        try:
            async for call, result in source:
                if isinstance(result, SearchOutcome):
                    yield translator.complete_search(call["key"], result.item, result.sources)
                else:
                    yield translator.complete_owned(call["key"], output=result.output, error=result.error)
        except ShuttingDown:
            # The drain period is over: calls still running are abandoned, and the response ends failed.
            out: list[ClientEvent] = []
            for call in runnable:
                if call["kind"] == "web_search":
                    out += translator.complete_search(call["key"], search_item(call["key"], call["query"], "failed"))
                else:
                    out += translator.complete_owned(call["key"], error=SHUTDOWN)
            out += translator.fail("gateway_shutting_down", "The gateway is shutting down; the response was ended "
                                   "after the drain period. Retry the request.")
            await self.host.loop_finished(translator, self.record, self.persist, out)
            yield out
        finally:
            for task in tasks:
                task.cancel()
            await source.aclose()  # now, not when the collector finds it (a client that left stops us mid-loop)

    async def _search(self, call: Mapping[str, Any]) -> SearchOutcome:
        if self.searcher is None:  # no provider: the function is never offered, so this is not reached
            return SearchOutcome(search_item(str(call["key"]), call.get("query"), "failed"),
                                 "Web search is not available.")
        return await self.searcher.run(str(call["key"]), call.get("query"))

    def _search_not_run(self, translator: FunctionSseTranslator, call: Mapping[str, Any], why: str
                        ) -> list[ClientEvent]:
        item = search_item(str(call["key"]), call.get("query"), "failed")
        if self.searcher is not None:
            item = self.searcher.not_run(item, why)
        return translator.complete_search(str(call["key"]), item)

    def _as_read(self, item: dict[str, Any]) -> dict[str, Any]:
        """A round's item as the next round's history: a search with the results the model read."""
        if item.get("type") != "web_search_call" or self.searcher is None:
            return item
        text = self.searcher.outcomes.get(str(item.get("id")))
        return item if text is None else {**item, RESULTS_KEY: text}

    async def _run_approved(self, request: Mapping[str, Any], response: Mapping[str, Any]) -> dict[str, Any]:
        label, name, arguments = str(request.get("server_label")), str(request.get("name")), str(
            request.get("arguments") or "{}")
        result = await self._call(label, name, arguments)
        item = mcp_call_item(label, name, arguments, item_id=new_id("mcp"),
                             approval_request_id=str(request.get("id")),
                             status="failed" if result.error else "completed")
        item.update(output=result.output, error=result.error)
        self.executed += 1
        return item

    def _metric_label(self, label: str) -> str:
        """Metric label values are the operator's (servers-file labels) or ``other``, never a client's string."""
        metric = getattr(self.executor, "metric_label", None)
        return metric(label) if metric is not None else "other"

    async def _call(self, label: str, name: str, arguments: str) -> McpCallOutcome:
        started = time.perf_counter()
        args = _parse_args(arguments)
        if args is None:
            result = McpCallOutcome(error={"type": "mcp_tool_execution_error", "content": [
                {"type": "text", "text": "The arguments are not a JSON object; the tool was not called."}]})
        elif self.state.ctx.mcp_server(label) is None:
            result = McpCallOutcome(error={"type": "mcp_protocol_error", "code": -32602,
                                           "message": f"No MCP server '{label}' is declared in this request."})
        else:
            try:
                result = await self.executor.call_tool(label, name, args)
            except Exception as exc:  # the I/O layer maps what it knows; anything else is a failed call
                result = McpCallOutcome(error={"type": "http_error", "code": 502,
                                               "message": f"The MCP call failed ({type(exc).__name__})."})
        seconds = time.perf_counter() - started
        outcome = "failed" if result.error is not None else "completed"
        self.record.mcp_calls.append((self._metric_label(label), outcome, seconds))
        log.info("mcp_call", request_id=self.record.request_id, server_label=label, tool=name, outcome=outcome,
                 error_type=(result.error or {}).get("type"), duration_ms=round(seconds * 1000, 1))
        return result


def _call_events(item: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    status = "failed" if item.get("error") else "completed"
    args = str(item.get("arguments") or "")
    return [("response.mcp_call_arguments.delta", {"delta": args}),
            ("response.mcp_call_arguments.done", {"arguments": args}),
            ("response.mcp_call.in_progress", {}),
            (f"response.mcp_call.{status}", {})]

