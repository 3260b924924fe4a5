"""The producer of a response (``ResponsesHandler.respond``): resolve the request once, rewrite it, forward it,
and pump the answer back as client events. Transport-independent — no starlette here: the HTTP door
(gateway.server.responses_http), the WebSocket door and background runs consume it."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from gateway.config import Settings
from gateway.enforce.constrain import ContentAsCall
from gateway.enforce.onerequest import GrammarRoutes
from gateway.enforce.plan import Plan, Violation, plan_for, violation_response
from gateway.engine.background import BackgroundRuns, RunIdentity
from gateway.engine.compaction import Compactor, Pending, UpstreamRefused, compact_endpoint
from gateway.engine.context import ContextMeter, Fitted
from gateway.engine.drain import Drain, ShuttingDown
from gateway.engine.enforcer import Enforcer, Guard, StepError
from gateway.engine.grammar_routes import UpstreamGrammarSupport, mark_cut_calls, routes_for
from gateway.engine.history import (
    APPENDED_STATUSES,
    HistoryBudget,
    public_input_items,
    resolve_history,
    resolve_references,
)
from gateway.engine.outcome import Answered, Outcome, Persist, Streamed, Turn
from gateway.engine.record import RequestRecord
from gateway.engine.takeover import GrammarTakeover
from gateway.engine.tool_loop import McpHub, ToolLoop
from gateway.engine.web_search import WebSearchRunner
from gateway.errors import GatewayError, InvalidRequest, StreamFailure
from gateway.protocol.conversations import conversation_item, conversation_ref
from gateway.protocol.events import ClientEvent, UpstreamEvent, with_failed_terminal
from gateway.runtime import clock, new_id, random_bytes
from gateway.store import ConversationTurn, ResponseStore, StoredResponse
from gateway.translate.chat import ChatToResponsesEvents, build_chat_request
from gateway.translate.restore import RequestState, build_request_state, restore_output, restore_response
from gateway.translate.rewrite import build_upstream_request
from gateway.translate.sealing import ReasoningSealer, open_sealed_reasoning, parse_keys
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo, resolve_tool_context, with_web_search
from gateway.translate.translator import FunctionSseTranslator
from gateway.translate.usage import add_usage
from gateway.translate.web_search import open_sealed_searches
from gateway.upstream.chat import chat_completion_events, chat_event_batches, responses_event_batches
from gateway.upstream.client import UpstreamClient, UpstreamResponse
from gateway.websearch.base import SearchProvider
from gateway.websearch.limits import WebSearchRateLimiter

log = structlog.get_logger("gateway.responses")

ZERO_USAGE = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
              "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}

__all__ = ["ResponsesHandler", "StoreWriteFailed"]

STORE_FAILED = "store_failed"


class StoreWriteFailed(GatewayError):
    """The response (or its conversation turn) could not be committed: the client is told so (a 500, or
    ``response.failed`` in place of its terminal event), never handed an id that does not exist."""

    status = 500
    type = "server_error"
    code = STORE_FAILED

    def __init__(self) -> None:
        super().__init__("The response could not be stored, so it was not kept; retry the request.")


@dataclass
class ResponsesHandler:
    settings: Settings
    upstream: UpstreamClient
    store: ResponseStore | None
    # Graceful shutdown: ends streams still running after the drain period (gateway.server.shutdown).
    drain: Drain | None = None
    # Remote MCP servers the gateway runs tools on (gateway.mcp); None: mcp tools are refused.
    mcp: McpHub | None = None
    # Seals reasoning as encrypted_content (gateway.translate.sealing); built on first use from the resolved key.
    sealer: ReasoningSealer | None = None
    # Background mode (gateway.engine.background); None (no store): background=true is refused.
    background: BackgroundRuns | None = None
    # Whether the upstream constrains grammar calls in the request itself (gateway.engine.grammar_routes).
    grammar_support: UpstreamGrammarSupport | None = None
    # Token counts and the context window (gateway.engine.context); None: no window checks, no truncation.
    meter: ContextMeter | None = None
    _compactor: Compactor | None = None
    # The web search provider (gateway.websearch); None: web_search tools are passed upstream as they come.
    web_search: SearchProvider | None = None
    # The per-key search rate (--web-search-per-key-per-minute); None: no per-key limit.
    web_search_rate: WebSearchRateLimiter | None = None

    async def respond(self, body: dict[str, Any], headers: Mapping[str, str], owner: str | None,
                      record: RequestRecord, turn: Turn | None = None, *,
                      run: RunIdentity | None = None) -> Outcome:
        """The transport-independent producer of a response: a parsed request body in; a JSON answer (an error,
        or a non-streamed Response) or the client's SSE frames out. The SSE handler, the WebSocket transport and
        background runs all consume it. ``owner``: the caller's keyed key hash (None without gateway keys).
        ``turn``: a WebSocket connection's own recent responses (``previous_response_id`` with ``store: false``).
        ``run``: set by a background run calling back in (its response's id and created_at)."""
        record.model = body.get("model") if isinstance(body.get("model"), str) else None
        record.stream = bool(body.get("stream"))
        # --- background mode (gateway.engine.background): the registry answers now and runs the response in a
        # task of its own, which comes back here with ``run`` set and streams like any other response.
        if body.get("background") and run is None:
            if self.background is None:
                raise InvalidRequest("background needs a response store, and this gateway runs with --store none.",
                                     param="background", code="store_disabled")
            return await self.background.start_run(self._produce_run, body, headers, owner, record)
        # --- end of background mode
        budget = HistoryBudget(self.settings.max_history_bytes)
        body = await resolve_references(self.store, body, owner, budget)
        ctx = resolve_tool_context(body)
        if self.web_search is not None:
            ctx = with_web_search(ctx)
            if ctx.web_search is not None and self.web_search_rate is not None \
                    and self.web_search_rate.retry_after(owner):
                # The key spent its searches of the last minute: 429 (Retry-After) before the response starts;
                # a response that runs past the rate mid-way gets failed web_search_calls instead (engine/web_search).
                self.web_search_rate.check(owner)
        history = await resolve_history(self.store, body, owner, turn, budget)
        if turn is not None:
            turn.history, turn.input_items = history, public_input_items(body)
        state = build_request_state(body, ctx, response_id=run.response_id if run else new_id("resp"),
                                    created_at=run.created_at if run else int(time.time()),
                                    max_unnamed_call_bytes=self.settings.max_unnamed_call_bytes)
        persist = self._persister(body, state, owner) if self._should_store(body) or conversation_ref(body) \
            else None
        body, history, state = self._reasoning(body, history, state, record, owner)
        body, history = self._open_searches(body, history, owner)
        # Compaction (gateway.engine.compaction): compaction items opened into their summaries; a trigger or a
        # context_management threshold compacts the context into a compaction item first in the output.
        body, history, pending = await self.compactor().prepare(body, history, headers, record, owner, self.meter,
                                                                functools.partial(self._upstream_body, ctx=ctx))
        if pending is not None and record.stream:  # the client hears at once; the summary comes with the stream
            return Streamed(self._compacting(pending, body, state, headers, record, persist, owner))
        if pending is not None:
            try:
                body, state = await self.compactor().run(pending, body, state, headers, record, owner)
            except UpstreamRefused as exc:
                record.upstream_error = f"http_{exc.status}"
                return Answered(exc.payload, exc.status)
            return await self._answer(body, [], state, headers, record, persist, owner, only=pending.trigger)
        return await self._answer(body, history, state, headers, record, persist, owner)

    async def _answer(self, body: dict[str, Any], history: list[dict[str, Any]], state: RequestState,
                      headers: Mapping[str, str], record: RequestRecord, persist: Persist | None, owner: str | None,
                      *, only: bool = False) -> Outcome:
        """The response from its resolved request on: ``only`` (a compaction_trigger), the compaction alone."""
        ctx = state.ctx
        if only:
            return await self._no_generation(state, record, persist)
        extra = {"x-request-id": record.request_id}
        if body.get("generate") is False:
            return await self._no_generation(state, record, persist)
        fitted = await self._fit(body, state.ctx, history, headers)
        body, history = fitted.body, fitted.history
        if ctx.mcp_tools or ctx.web_search is not None:
            return await self._mcp(body, state, record, persist, history, headers, extra, owner)
        plan = plan_for(ctx, self.settings.tool_choice_enforcement)
        if self.settings.upstream_api != "responses" or plan.active:
            enforcer = Enforcer(plan, self.upstream, self.settings, body, ctx, history, headers, record, extra)
            try:
                return await self._enforced(body, plan, enforcer, state, record, persist, history)
            except StepError as exc:
                record.upstream_error = f"http_{exc.status}"
                return Answered(exc.payload, exc.status)
        return await self._forward(body, state, record, persist, history, headers, extra, guard=None)

    async def compact(self, body: dict[str, Any], headers: Mapping[str, str], owner: str | None,
                      record: RequestRecord) -> Answered:
        """``POST /v1/responses/compact``: the history (``previous_response_id``'s chain, item references, then
        ``input``) summarized by the upstream model into one sealed compaction item."""
        record.model = body.get("model") if isinstance(body.get("model"), str) else None
        budget = HistoryBudget(self.settings.max_history_bytes)

        async def history(b: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            b = await resolve_references(self.store, b, owner, budget)
            b.pop("conversation", None)  # not a parameter of compact
            return await resolve_history(self.store, b, owner, None, budget), b

        try:
            return Answered(await compact_endpoint(self.compactor(), body, owner, record, headers, history))
        except UpstreamRefused as exc:
            record.upstream_error = f"http_{exc.status}"
            return Answered(exc.payload, exc.status)

    async def _compacting(self, pending: Pending, body: dict[str, Any], state: RequestState,
                          headers: Mapping[str, str], record: RequestRecord, persist: Persist | None,
                          owner: str | None) -> AsyncIterator[list[ClientEvent]]:
        """A streamed response that compacts first: created, in_progress and the compaction item's added and
        ``response.compaction.compacting`` now, then the summarization turn, then the rest of the response
        numbered on from there (its translator finishes the item). A failure after the stream began ends it with
        ``response.failed``."""
        opening = FunctionSseTranslator(state, ids=new_id)
        frames = opening.announce([pending.placeholder()])
        record.ttfb = time.perf_counter() - record.started
        yield frames
        try:
            body, state = await self.compactor().run(pending, body, state, headers, record, owner)
            state = replace(state, lead_announced=opening.sequence)
            outcome = await self._answer(body, [], state, headers, record, persist, owner, only=pending.trigger)
        except UpstreamRefused as exc:
            record.upstream_error = f"http_{exc.status}"
            outcome = Answered(exc.payload, exc.status)
        except GatewayError as exc:
            record.response_status = "failed"
            # The stream began with a 200: the error's status becomes one of the codes a failed response may carry.
            yield opening.fail("invalid_prompt" if exc.status < 500 else "server_error", exc.message)
            return
        if isinstance(outcome, Answered):  # refused before its stream began: the stream ends failed
            error = outcome.payload.get("error") if isinstance(outcome.payload, dict) else None
            error = error if isinstance(error, dict) else {}
            record.response_status = "failed"
            yield opening.fail("invalid_prompt" if outcome.status < 500 else "server_error",
                               str(error.get("message") or f"The upstream answered {outcome.status}."))
            return
        async for out in outcome.events:
            yield out

    def compactor(self) -> Compactor:
        if self._compactor is None:
            self._compactor = Compactor(self.settings, self.upstream, self.reasoning_sealer)
        return self._compactor

    async def _fit(self, body: dict[str, Any], ctx: ResolvedToolContext, history: list[dict[str, Any]],
                   headers: Mapping[str, str]) -> Fitted:
        """The request as it fits the model's window (``truncation``), answered before anything goes upstream."""
        if self.meter is None or ctx.mcp_tools:  # MCP tools are listed later, per round: not fitted here
            return Fitted(body, history)
        return await self.meter.fit(body, history, functools.partial(self._upstream_body, ctx=ctx), headers)

    def _upstream_body(self, body: dict[str, Any], history: list[dict[str, Any]], *,
                       ctx: ResolvedToolContext) -> dict[str, Any]:
        """The body the configured upstream API gets for ``body`` over ``history``."""
        if self.settings.upstream_api == "chat":
            return build_chat_request(body, ctx, history)
        return build_upstream_request(body, ctx, history)

    async def input_tokens(self, body: dict[str, Any], headers: Mapping[str, str], owner: str | None) -> int:
        """``POST /v1/responses/input_tokens``: the input tokens the request would have upstream, its history
        (``previous_response_id``, ``conversation``, item references) loaded as for a response and
        ``truncation: "auto"`` applied; counted by vLLM's ``/tokenize``."""
        if self.meter is None:
            raise GatewayError("Token counting is not available on this gateway.", status=501,
                               type="server_error", code="not_implemented")
        budget = HistoryBudget(self.settings.max_history_bytes)
        body = await resolve_references(self.store, body, owner, budget)
        ctx = resolve_tool_context(body)
        history = await resolve_history(self.store, body, owner, None, budget)
        raw = body.get("input")
        if any(isinstance(i, dict) and i.get("type") == "reasoning" and i.get("encrypted_content")
               for i in [*history, *(raw if isinstance(raw, list) else ())]):
            sealer = self.reasoning_sealer()
            if isinstance(raw, list):
                body = {**body, "input": open_sealed_reasoning(raw, sealer, owner)[0]}
            history = open_sealed_reasoning(history, sealer, owner)[0]
        body, history = self.compactor().open_all(body, history, owner, None)  # counted as their summaries
        if body.get("truncation") == "auto":
            fitted = await self._fit(body, ctx, history, headers)
            if fitted.input_tokens is not None:
                return fitted.input_tokens
            body, history = fitted.body, fitted.history
        return await self.meter.count(self._upstream_body(body, history, ctx=ctx), headers)

    async def _produce_run(self, body: dict[str, Any], headers: Mapping[str, str], owner: str | None,
                           record: RequestRecord, run: RunIdentity) -> Outcome:
        """What a background run produces: this response, under the identity the run already gave it."""
        return await self.respond(body, headers, owner, record, run=run)

    # ------------------------------------------------------------------ an upstream round

    async def _open_round(self, body: dict[str, Any], ctx: ResolvedToolContext, history: list[dict[str, Any]],
                          headers: Mapping[str, str], extra: Mapping[str, str], record: RequestRecord,
                          routes: GrammarRoutes | None = None) -> Round | Answered:
        """One upstream round opened on the configured API (the plain request, and each round of the tool
        loop): its event batches, or (an error before the stream started) the upstream's error in OpenAI's
        shape."""
        chat = self.settings.upstream_api == "chat"
        path = "/v1/chat/completions" if chat else "/v1/responses"
        upstream_body = build_chat_request(body, ctx, history) if chat else build_upstream_request(body, ctx, history)
        if routes is not None:
            routes.apply(upstream_body)
        up = await self.upstream.send_json(path, upstream_body, headers, stream=True, extra_headers=extra)
        if not up.ok:
            try:
                err = await up.error_body()
            finally:
                await up.aclose()
            record.upstream_error = f"http_{up.status_code}"
            return Answered(err, up.status_code)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return Round(chat_event_batches(up, self._converter(model)) if chat else responses_event_batches(up), up)

    async def _constrained_round(self, enforcer: Enforcer, info: ToolInfo, model: str | None) -> Round:
        """A round whose call is pinned: the constrained step's content streamed as that call."""
        up = await enforcer.open_args_stream(info)
        conv = self._converter(model)
        conv.base_usage = enforcer.usage
        return Round(chat_event_batches(up, conv, ContentAsCall(info).feed), up)

    # ------------------------------------------------------------------ chat mode and enforcement

    async def _enforced(self, body: dict[str, Any], plan: Plan, enforcer: Enforcer, state: RequestState,
                        record: RequestRecord, persist: Persist | None, history: list[dict[str, Any]]) -> Outcome:
        """Every path but the plain one: --upstream-api chat, a guarded answer, or a constrained call."""
        guard = Guard(plan, state.ctx, enforcer) if plan.active else None
        headers, extra = enforcer.headers, enforcer.extra_headers
        model = body.get("model") if isinstance(body.get("model"), str) else None
        if plan.constrain:
            info: ToolInfo | None = None
            try:
                info = await enforcer.choose_tool()
                if record.stream:
                    return self._stream(await self._constrained_round(enforcer, info, model), state, record,
                                        persist, guard)
                final = self._translate_all(await enforcer.args_events(info, state), state)
                return await self._finish(final, record, persist, guard)
            except Violation as exc:
                return await self._violation(str(exc), state, record, persist)
            except StepError as exc:
                if exc.status not in (404, 405) or self.settings.upstream_api != "responses":
                    raise
                # No Chat Completions upstream: this request is answered as under validate (logged once
                # per process, counted), never passed off as the client's own 404.
                enforcer.step_unavailable(exc.status, "arguments" if info else "pick", info)
                plan = plan_for(state.ctx, "validate")
                enforcer.plan = plan
                guard = Guard(plan, state.ctx, enforcer)
        if guard is not None and plan.check_grammar:
            if self.grammar_support is None:
                self.grammar_support = UpstreamGrammarSupport(self.upstream)
            guard.routes = await routes_for(state.ctx, body, mode=plan.mode, parser=self.settings.tool_call_parser,
                                            support=self.grammar_support, record=record)
        return await self._forward(body, state, record, persist, history, headers, extra, guard=guard)

    async def _forward(self, body: dict[str, Any], state: RequestState, record: RequestRecord,
                       persist: Persist | None, history: list[dict[str, Any]], headers: Mapping[str, str],
                       extra: Mapping[str, str], *, guard: Guard | None) -> Outcome:
        """Send the request to the configured upstream API and answer from what comes back (streamed or not);
        ``guard`` checks the answer when enforcement is on."""
        routes = guard.routes if guard is not None else None
        if record.stream:
            opened = await self._open_round(body, state.ctx, history, headers, extra, record, routes)
            if isinstance(opened, Answered) and guard is not None and _refused(routes, opened.status):
                routes = _back_to_takeover(guard, record, opened.status)
                opened = await self._open_round(body, state.ctx, history, headers, extra, record, routes)
            if isinstance(opened, Answered):
                return opened
            return self._stream(opened, state, record, persist, guard)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        chat = self.settings.upstream_api == "chat"
        path = "/v1/chat/completions" if chat else "/v1/responses"
        upstream_body = build_chat_request(body, state.ctx, history) if chat else \
            build_upstream_request(body, state.ctx, history)
        if routes is not None:
            routes.apply(upstream_body)
        status, payload = await self.upstream.post_json(path, upstream_body, headers)
        if guard is not None and _refused(routes, status):
            _back_to_takeover(guard, record, status)
            upstream_body = build_chat_request(body, state.ctx, history) if chat else \
                build_upstream_request(body, state.ctx, history)
            status, payload = await self.upstream.post_json(path, upstream_body, headers)
        if status >= 400:
            record.upstream_error = f"http_{status}"
            return Answered(payload, status)
        if not isinstance(payload, dict):
            raise GatewayError("The upstream answered with an unexpected body.", status=502, type="server_error",
                               code="upstream_error")
        if chat:
            final = self._translate_all(chat_completion_events(payload, self._converter(model)), state)
        else:
            final = restore_response(payload, state,
                                     output=[*state.lead, *restore_output(payload.get("output") or [], state)])
            if state.lead_usage:  # the compaction pass this response ran first
                final["usage"] = add_usage(dict(state.lead_usage), final.get("usage"))
        return await self._finish(final, record, persist, guard)

    # ------------------------------------------------------------------ gateway-executed (MCP) tools

    async def _mcp(self, body: dict[str, Any], state: RequestState, record: RequestRecord, persist: Persist | None,
                   history: list[dict[str, Any]], headers: Mapping[str, str], extra: Mapping[str, str],
                   owner: str | None) -> Outcome:
        """A response whose tools the gateway runs (MCP, web search): the tool loop (gateway.engine.tool_loop)
        produces it."""
        executor: Any = _NoMcp()
        if state.ctx.mcp_tools:
            if self.mcp is None:
                raise InvalidRequest("This gateway does not run mcp tools.", param="tools", code="mcp_not_enabled")
            ctx, executor = self.mcp.bind(state.ctx, body, owner)
            state = replace(state, ctx=ctx)
        loop = ToolLoop(self, body, state, history, headers, extra, record, persist, executor, owner,
                        searcher=self._searcher(state.ctx, body, owner, record))
        loop.check_approvals()  # an answer to a request the gateway did not issue is a 400 before anything runs
        state, shown = await loop.prepare()
        frames = loop.frames(state, shown)
        if record.stream:
            return Streamed(frames)
        try:
            async for _chunk in frames:
                pass
        finally:
            await frames.aclose()
        final = loop.translator.final_response
        assert final is not None
        if _store_failed_response(final):
            raise StoreWriteFailed()
        _count_calls(record, final)
        return Answered(final)

    async def loop_round(self, loop: ToolLoop, translator: FunctionSseTranslator,
                          round_history: list[dict[str, Any]], withhold: bool) -> AsyncIterator[list[ClientEvent]]:
        """One upstream round of the tool loop, pumped into the loop's translator."""
        record = loop.record
        body, ctx = loop.round_body(round_history, withhold)
        body["stream"] = True
        model = body.get("model") if isinstance(body.get("model"), str) else None
        plan = plan_for(ctx, self.settings.tool_choice_enforcement) if translator.round == 0 else plan_for(ctx, "off")
        opened: Round | Answered
        try:
            if plan.constrain:
                enforcer = Enforcer(plan, self.upstream, self.settings, body, ctx, loop.history, loop.headers,
                                    record, loop.extra)
                opened = await self._constrained_round(enforcer, await enforcer.choose_tool(), model)
            else:
                opened = await self._open_round(body, ctx, loop.history, loop.headers, loop.extra, record)
                if isinstance(opened, Answered):
                    err = opened.payload.get("error") if isinstance(opened.payload, dict) else None
                    err = err if isinstance(err, dict) else {}
                    yield translator.fail("upstream_error", str(err.get("message") or
                                                                "The upstream refused the request."))
                    return
        except GatewayError as exc:  # a violation, a step's HTTP error, an unreachable upstream
            yield failed(translator, record, exc)
            return
        async for chunk in self._pump_events(opened.batches, opened.up, translator, record, persist=loop.persist,
                                             guard=None):
            yield chunk

    async def loop_finished(self, translator: FunctionSseTranslator, record: RequestRecord,
                             persist: Persist | None, frames: list[ClientEvent] | None = None) -> None:
        """The loop ended the response itself (after running a round's calls): record and store it first. A failed
        store write turns the terminal event in ``frames`` (changed in place) into ``response.failed``."""
        final = translator.final_response
        if final is None:
            return
        record.response_status = final.get("status")
        record.usage = final.get("usage") if isinstance(final.get("usage"), dict) else None
        out, failed = await self._persist_frames(persist, frames or [], final, record)
        if failed is not final:
            translator.final_response = failed
            if frames is not None:
                frames[:] = out

    async def _persist_frames(self, persist: Persist | None, frames: list[ClientEvent], final: dict[str, Any],
                              record: RequestRecord) -> tuple[list[ClientEvent], dict[str, Any]]:
        """Store the response before its terminal event goes out; if the write fails, the frames end with
        ``response.failed`` (``store_failed``) instead, and that failed response is the final one."""
        if persist is None:
            return frames, final
        try:
            await persist(final)
        except StoreWriteFailed:
            record.response_status = "failed"
            return _store_failed_frames(frames, final)
        return frames, final

    def _reasoning(self, body: dict[str, Any], history: list[dict[str, Any]], state: RequestState,
                   record: RequestRecord, owner: str | None = None
                   ) -> tuple[dict[str, Any], list[dict[str, Any]], RequestState]:
        """Sealed reasoning: blobs in the input and history opened for the upstream (the stored input keeps what
        the client sent); reasoning the client gets sealed when its include asks for it. Blobs are bound to the
        caller's owner: another key's blob does not open, and is dropped and counted like a tampered one."""
        include = body.get("include")
        wants = isinstance(include, list) and "reasoning.encrypted_content" in include
        raw = body.get("input")
        sealed_in = any(isinstance(i, dict) and i.get("type") == "reasoning" and i.get("encrypted_content")
                        for i in [*history, *(raw if isinstance(raw, list) else ())])
        if not wants and not sealed_in:
            return body, history, state
        sealer = self.reasoning_sealer()
        rejected = 0
        if sealed_in:
            if isinstance(raw, list):
                opened, n = open_sealed_reasoning(raw, sealer, owner)
                body, rejected = {**body, "input": opened}, rejected + n
            history, n = open_sealed_reasoning(history, sealer, owner)
            rejected += n
        if rejected:
            record.reasoning_rejected = rejected
            log.warning("reasoning_blob_rejected", request_id=record.request_id, count=rejected,
                        reason="encrypted_content did not open with the configured --reasoning-key(s) for this "
                        "API key")
        if wants:
            state = replace(state, seal=functools.partial(sealer.seal, owner=owner))
        return body, history, state

    def _searcher(self, ctx: ResolvedToolContext, body: Mapping[str, Any], owner: str | None,
                  record: RequestRecord) -> WebSearchRunner | None:
        search = ctx.web_search
        if search is None or self.web_search is None:
            return None
        seal = None
        if self.settings.reasoning_key:
            sealer = self.reasoning_sealer()

            def seal(item_id: str, text: str) -> str:
                return sealer.seal({"id": item_id, "content": [{"text": text}]}, owner)

        tool = search.definition.get("web_search_tool")
        rate = self.web_search_rate
        return WebSearchRunner(self.web_search, self.settings, tool if isinstance(tool, dict) else {}, body,
                               owner=owner, allow=rate.allow if rate is not None else None, seal=seal,
                               request_id=record.request_id, outcomes=record.web_search_calls)

    def _open_searches(self, body: dict[str, Any], history: list[dict[str, Any]], owner: str | None
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Searches of earlier turns (the chain, or resent by the client): their sealed results opened for the
        upstream, for this owner only (gateway.translate.web_search); the stored input keeps what was sent."""
        raw = body.get("input")
        if not any(isinstance(i, dict) and i.get("type") == "web_search_call"
                   for i in [*history, *(raw if isinstance(raw, list) else ())]):
            return body, history
        opener = None
        if self.settings.reasoning_key:
            sealer = self.reasoning_sealer()

            def opener(blob: Any) -> dict[str, Any] | None:
                return sealer.open(blob, owner)

        if isinstance(raw, list):
            body = {**body, "input": open_sealed_searches(raw, opener)}
        return body, open_sealed_searches(history, opener)

    def reasoning_sealer(self) -> ReasoningSealer:
        if self.sealer is None:
            # Resolved by the app's lifespan (gateway.server.keys): --reasoning-key or the store's own key.
            if not self.settings.reasoning_key:
                raise RuntimeError("ResponsesHandler needs settings.reasoning_key (gateway.server.keys)")
            self.sealer = ReasoningSealer(parse_keys(self.settings.reasoning_key), random_bytes=random_bytes)
        return self.sealer

    async def _no_generation(self, state: RequestState, record: RequestRecord, persist: Persist | None) -> Outcome:
        """``generate: false`` (Codex's warm-up): a completed, empty response whose id later turns chain from; its
        input is kept as history. Nothing is sent upstream."""
        translator = FunctionSseTranslator(state, ids=new_id)
        frames = translator.start() + translator.end(usage=ZERO_USAGE)
        final = translator.final_response
        assert final is not None
        record.response_status = "completed"
        return await self._made_here_stored(persist, frames, final, record)

    def _converter(self, model: str | None) -> ChatToResponsesEvents:
        return ChatToResponsesEvents(model=model, max_unnamed_bytes=self.settings.max_unnamed_call_bytes, ids=new_id,
                                     clock=clock)

    @staticmethod
    def _translate_all(events: list[UpstreamEvent], state: RequestState) -> dict[str, Any]:
        """A non-streamed answer through the same translator as a stream: one code path for both."""
        translator = FunctionSseTranslator(state, ids=new_id)
        for ev in events:
            translator.feed(ev)
            if translator.finished:
                break
        translator.finish()
        assert translator.final_response is not None
        return translator.final_response

    async def _finish(self, final: dict[str, Any], record: RequestRecord, persist: Persist | None,
                      guard: Guard | None) -> Outcome:
        if guard is not None:
            final = await guard.settle(final)
        _count_calls(record, final)
        record.usage = final.get("usage") if isinstance(final.get("usage"), dict) else None
        record.response_status = final.get("status")
        if persist is not None:
            await persist(final)
        return Answered(final)

    async def _violation(self, message: str, state: RequestState, record: RequestRecord,
                         persist: Persist | None) -> Outcome:
        """No call could be made at all (the pick step failed): a failed response, streamed or not."""
        translator = FunctionSseTranslator(state, ids=new_id)
        frames = translator.fail("tool_choice_violation", message)
        final = translator.final_response or violation_response(restore_response(None, state, output=[]), message)
        record.response_status = "failed"
        return await self._made_here_stored(persist, frames, final, record)

    async def _made_here_stored(self, persist: Persist | None, frames: list[ClientEvent], final: dict[str, Any],
                                record: RequestRecord) -> Outcome:
        """A response the gateway made, stored first: a failed write is a 500 (not streamed) or the stream's
        ``response.failed``."""
        if not record.stream:
            if persist is not None:
                await persist(final)  # StoreWriteFailed: the client's 500
            return Answered(final)
        frames, final = await self._persist_frames(persist, frames, final, record)
        return _made_here(frames, final, record)

    def _stream(self, opened: Round, state: RequestState, record: RequestRecord, persist: Persist | None,
                guard: Guard | None) -> Outcome:
        batches, up = opened.batches, opened.up
        translator = FunctionSseTranslator(state, ids=new_id)
        routes = guard.routes if guard is not None else None
        if guard is not None and routes is not None and routes.one_request:
            # Constrained by the request itself: checked once at each call's end, never held or taken over.
            batches = mark_cut_calls(batches, state.ctx, routes.one_request, guard.checked, guard.enforcer.note)
        if guard is not None and guard.plan.regenerate and (routes is None or routes.takeover):
            takeover = GrammarTakeover(state.ctx, guard.enforcer, lambda: _so_far(translator),
                                       names=routes.takeover if routes is not None else None)
            takeover.checked = guard.checked
            batches = takeover.run(batches, up)
        return Streamed(self._pump_events(batches, up, translator, record, persist, guard))

    async def _pump_events(self, batches: AsyncIterator[list[UpstreamEvent]], up: UpstreamResponse,
                           translator: FunctionSseTranslator, record: RequestRecord, persist: Persist | None,
                           guard: Guard | None) -> AsyncIterator[list[ClientEvent]]:
        """Client frames from upstream event batches (chat chunks already converted), written as they come.

        Nothing is held here: the guard sees only the last frames (the terminal event) before the client
        does, so a pinned violation becomes ``response.failed``.
        """
        feed = translator.feed
        drain = self.drain
        task = asyncio.current_task()
        assert task is not None
        read = batches.__anext__
        try:
            out: list[ClientEvent] = []
            try:
                while True:
                    # The drain's guard inline (Drain.guard as a generator would be one more layer per frame).
                    if drain is not None:
                        drain.enter(task)
                    try:
                        events = await read()
                    except StopAsyncIteration:
                        out += translator.finish()
                        break
                    except asyncio.CancelledError:
                        if drain is not None and drain.ours(task):
                            raise ShuttingDown from None
                        raise
                    finally:
                        if drain is not None:
                            drain.leave(task)
                    for ev in events:
                        out += feed(ev)
                        if translator.finished or translator.round_done:
                            break
                    if translator.finished or translator.round_done:
                        break
                    if out:
                        if record.ttfb is None:
                            record.ttfb = time.perf_counter() - record.started
                        yield out
                        out = []
            except StreamFailure as exc:  # the drain, a broken or idle upstream, a takeover step's HTTP error
                if exc.upstream_error == "stream_broken":
                    self.upstream.generation += 1  # it may come back as another server (gateway.engine.grammar_routes)
                out += failed(translator, record, exc)
            final = translator.final_response
            if guard is not None:
                out, final = guard.end(out, final)
                translator.final_response = final
            if final is not None:
                record.response_status = final.get("status")
                record.usage = final.get("usage") if isinstance(final.get("usage"), dict) else None
                # Stored before the terminal event goes out: a client never gets the id of a response the store
                # does not hold (a failed write ends the stream with response.failed instead).
                out, stored = await self._persist_frames(persist, out, final, record)
                if stored is not final:
                    translator.final_response = stored
            if out:
                if record.ttfb is None:
                    record.ttfb = time.perf_counter() - record.started
                yield out
        finally:
            stats = translator.stats  # recorded first: a cancelled task may not get past the awaits below
            record.tool_calls = {"custom": stats.custom_calls, "function": stats.function_calls,
                                 "builtin": stats.builtin_calls}
            record.held_bytes_peak = stats.held_bytes_peak
            record.overflowed = stats.overflowed
            if stats.raw_inputs or stats.input_mismatches:
                # Counts only: a custom tool's input never reaches the logs.
                log.debug("custom_input_not_input_json", request_id=record.request_id, raw=stats.raw_inputs,
                          mismatches=stats.input_mismatches)
            # Closed here, in order, rather than left to the garbage collector: an async generator abandoned
            # at a break is finalized later by a task the event loop creates for it, once per response.
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                await aclose()
            if translator.acc.terminal is not None and not stats.overflowed:
                # The upstream's own terminal event ended the answer: read the rest of its body (bounded) so
                # the connection goes back to the pool (release() drops it instead if the task is cancelled).
                await up.release()
            else:  # the client left mid-answer, a gateway-side failure, an overflow: abort, vLLM stops generating
                await up.aclose()

    def _should_store(self, body: dict[str, Any]) -> bool:
        return self.store is not None and body.get("store", True) is not False

    def _persister(self, body: dict[str, Any], state: RequestState,
                   owner: str | None = None) -> Callable[[dict[str, Any]], Awaitable[None]]:
        store = self.store
        assert store is not None
        items = public_input_items(body)
        tool_context = state.ctx.describe()
        keep = self._should_store(body)  # False: only the conversation (if any) is written
        conversation_id = conversation_ref(body)

        async def persist(final: dict[str, Any]) -> None:
            """The record and the conversation turn, in one transaction; StoreWriteFailed if it did not commit."""
            now = int(time.time())
            # A response that holds a compaction item starts its chain anew: loading a later turn's history
            # stops here, and what the compaction replaced is never read again (gateway.engine.history).
            compacted = any(i.get("type") == "compaction" for i in [*items, *(final.get("output") or ())]
                            if isinstance(i, dict))
            rec = StoredResponse(id=final["id"], created_at=int(final.get("created_at") or now),
                                 previous_response_id=None if compacted else body.get("previous_response_id"),
                                 status=str(final.get("status")), response=final, input_items=items,
                                 tool_context=tool_context, updated_at=now, owner=owner) if keep else None
            turn = None
            if conversation_id is not None and final.get("status") in APPENDED_STATUSES:
                # A response's turn joins its conversation whatever `store` says, as OpenAI does.
                turn_items = [conversation_item(i, new_id) for i in items]
                turn_items += [conversation_item(o, new_id) for o in final.get("output") or () if isinstance(o, dict)]
                turn = ConversationTurn(conversation_id, turn_items, now)
            if rec is None and turn is None:
                return
            try:
                appended = await store.put(rec, turn, owner)
            except Exception as exc:
                log.error("store_write_failed", response_id=final.get("id"), conversation_id=conversation_id,
                          error=type(exc).__name__)
                raise StoreWriteFailed() from None
            if not appended:  # the conversation was deleted while the response ran
                log.warning("conversation_gone", conversation_id=conversation_id, response_id=final.get("id"))

        return persist


class _NoMcp:
    """The loop's MCP side when a response runs only web search: no servers."""

    async def list_tools(self, label: str) -> list[dict[str, Any]]:
        return []

    async def call_tool(self, label: str, name: str, arguments: dict[str, Any]) -> Any:
        raise RuntimeError("no MCP servers in this request")

    def metric_label(self, label: str) -> str:
        return "other"


@dataclass(frozen=True, slots=True)
class Round:
    """An upstream round's open stream: its event batches (whichever API answered) and the response to release or
    close at its end."""

    batches: AsyncIterator[list[UpstreamEvent]]
    up: UpstreamResponse


def failed(translator: FunctionSseTranslator, record: RequestRecord, exc: GatewayError) -> list[ClientEvent]:
    """End the response with ``response.failed`` for ``exc``: the error carries its code (and, for a stream
    failure, what the request log records as ``upstream_error``)."""
    if isinstance(exc, StreamFailure) and exc.upstream_error is not None:
        record.upstream_error = exc.upstream_error
    return translator.fail(exc.code or "upstream_error", exc.message)


def _refused(routes: GrammarRoutes | None, status: int) -> bool:
    """The upstream answered 400 to a body the one-request routes changed (a schema or pattern its structured-output
    backend does not take): the request is sent again as it would have been without them."""
    return routes is not None and routes.changes_body and status == 400


def _back_to_takeover(guard: Guard, record: RequestRecord, status: int) -> GrammarRoutes:
    log.warning("grammar_constraint_refused", request_id=record.request_id, status=status, routes=record.grammar_routes,
                message="The upstream refused the request with the grammar tools' constraint; sent again without it "
                        "(the takeover enforces those calls).")
    record.upstream_error = None
    routes = guard.routes = GrammarRoutes(routes={name: "takeover" for name in (guard.routes.routes if guard.routes
                                                                                else {})})
    record.grammar_routes = list(routes.used)
    return routes


def _so_far(translator: FunctionSseTranslator) -> tuple[dict[str, Any] | None, str]:
    """The upstream's response snapshot and the assistant text streamed so far (for a takeover step)."""
    acc = translator.acc
    text = "".join(up.text(ci) for _, up in sorted(acc.items.items())
                   if up.type == "message" for ci in sorted(up.texts))
    return acc.snapshot, text


def _made_here(frames: list[ClientEvent], final: dict[str, Any], record: RequestRecord) -> Outcome:
    """A response the gateway made without an upstream stream: its events at once, or the body."""
    if not record.stream:
        return Answered(final)

    async def once() -> AsyncIterator[list[ClientEvent]]:
        yield frames

    return Streamed(once())


def _store_failed_response(final: Mapping[str, Any]) -> bool:
    error = final.get("error")
    return final.get("status") == "failed" and isinstance(error, dict) and error.get("code") == STORE_FAILED


def _store_failed_frames(frames: list[ClientEvent], final: dict[str, Any]
                         ) -> tuple[list[ClientEvent], dict[str, Any]]:
    """``frames`` with their terminal event (the last one) replaced by ``response.failed`` (``store_failed``),
    and that failed response."""
    exc = StoreWriteFailed()
    failed = {**final, "status": "failed", "error": {"code": exc.code, "message": exc.message}}
    return with_failed_terminal(frames, failed), failed


def _count_calls(record: RequestRecord, final: dict[str, Any]) -> None:
    counts = {"custom": 0, "function": 0, "builtin": 0}
    for item in final.get("output") or ():
        if item.get("type") == "custom_tool_call":
            counts["custom"] += 1
        elif item.get("type") == "function_call":
            counts["function"] += 1
        elif item.get("type") in ("apply_patch_call", "shell_call", "local_shell_call"):
            counts["builtin"] += 1
    record.tool_calls = counts
