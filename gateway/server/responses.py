"""The producer of a response (``ResponsesHandler.respond``): resolve the request once, rewrite it, forward it,
and pump the answer back as client frames. Transport-independent — no starlette here: the HTTP handler
(gateway.server.responses_http), the WebSocket transport and background runs consume it."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import structlog

from gateway.config import Settings
from gateway.enforce.constrain import ContentAsCall
from gateway.enforce.live import GrammarTakeover
from gateway.enforce.runner import Enforcer, Guard, Plan, StepError, Violation, plan_for, violation_response
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.protocol.conversations import conversation_item, conversation_ref
from gateway.protocol.events import ClientEvent, UpstreamEvent, with_failed_terminal
from gateway.protocol.ids import new_id
from gateway.server.conversations import APPENDED_STATUSES, conversation_history
from gateway.server.record import RequestRecord
from gateway.server.shutdown import Drain, ShuttingDown
from gateway.server.tool_loop import McpHub, ToolLoop
from gateway.store import BrokenChainError, ConversationTurn, HistoryTooLargeError, ResponseStore, StoredResponse
from gateway.translate.chat import ChatToResponsesEvents, build_chat_request
from gateway.translate.restore import RequestState, build_request_state, restore_output, restore_response
from gateway.translate.rewrite import build_upstream_request
from gateway.translate.sealing import ReasoningSealer, open_sealed_reasoning, parse_keys
from gateway.translate.tool_context import ToolInfo, resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from gateway.upstream.chat import chat_completion_events, chat_event_batches, responses_event_batches
from gateway.upstream.client import UpstreamClient, UpstreamResponse

if TYPE_CHECKING:
    from gateway.server.background import BackgroundRuns, RunIdentity

log = structlog.get_logger("gateway.responses")

Persist = Callable[[dict[str, Any]], Awaitable[None]]
ZERO_USAGE = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}

__all__ = ["Answered", "Outcome", "ResponsesHandler", "StoreWriteFailed", "Streamed", "Turn", "public_input_items"]

STORE_FAILED = "store_failed"


class StoreWriteFailed(GatewayError):
    """The response (or its conversation turn) could not be committed: the client is told so (a 500, or
    ``response.failed`` in place of its terminal event), never handed an id that does not exist."""

    status = 500
    type = "server_error"
    code = STORE_FAILED

    def __init__(self) -> None:
        super().__init__("The response could not be stored, so it was not kept; retry the request.")


class HistoryBudget:
    """What is left of --max-history-bytes for one request: item references first, then the chain or the
    conversation."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def exceeded(self, param: str) -> InvalidRequest:
        return InvalidRequest(f"The history this request resolves through '{param}' is larger than the gateway's "
                              f"limit of {self.limit} bytes (--max-history-bytes).", param=param,
                              code="history_too_large")


def public_input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id (``input_items`` lists them)."""
    raw = body.get("input")
    if isinstance(raw, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    elif isinstance(raw, list):
        items = raw
    else:
        items = []
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        if "type" not in item and "role" in item:
            item["type"] = "message"
        if not item.get("id"):
            item["id"] = new_id("msg" if item.get("type") == "message" else "item")
        out.append(item)
    return out


def history_from_chain(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    """Earlier inputs and outputs, in order; the new input is appended by the caller."""
    history: list[dict[str, Any]] = []
    for record in chain:
        history.extend(record.input_items)
        history.extend(i for i in record.response.get("output") or () if isinstance(i, dict))
    return history


@dataclass
class ResponsesHandler:
    settings: Settings
    upstream: UpstreamClient
    store: ResponseStore | None
    # Graceful shutdown: ends streams still running after the drain period (gateway.server.shutdown).
    drain: Drain | None = None
    # Remote MCP servers the gateway runs tools on (gateway.mcp); None: mcp tools are refused.
    mcp: McpHub | None = None
    # Seals reasoning as encrypted_content (gateway.translate.sealing); built on first use from --reasoning-key.
    sealer: ReasoningSealer | None = None
    # Background mode (gateway.server.background); None (no store): background=true is refused.
    background: BackgroundRuns | None = None

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
        # --- background mode (gateway.server.background): the registry answers now and runs the response in a
        # task of its own, which comes back here with ``run`` set and streams like any other response.
        if body.get("background") and run is None:
            if self.background is None:
                raise InvalidRequest("background needs a response store, and this gateway runs with --store none.",
                                     param="background", code="store_disabled")
            return await self.background.start_run(self, body, headers, owner, record)
        # --- end of background mode
        budget = HistoryBudget(self.settings.max_history_bytes)
        body = await self._resolve_references(body, owner, budget)
        ctx = resolve_tool_context(body)
        history = await self._history(body, owner, turn, budget)
        if turn is not None:
            turn.history, turn.input_items = history, public_input_items(body)
        state = build_request_state(body, ctx, response_id=run.response_id if run else new_id("resp"),
                                    created_at=run.created_at if run else int(time.time()),
                                    max_unnamed_call_bytes=self.settings.max_unnamed_call_bytes)
        persist = self._persister(body, state, owner) if self._should_store(body) or conversation_ref(body) \
            else None
        body, history, state = self._reasoning(body, history, state, record, owner)
        extra = {"x-request-id": record.request_id}
        if body.get("generate") is False:
            return await self._no_generation(state, record, persist)
        if ctx.mcp_tools:
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

    async def _open_stream(self, path: str, body: dict[str, Any], headers: Mapping[str, str],
                           extra: Mapping[str, str], record: RequestRecord) -> UpstreamResponse | Answered:
        """The open upstream stream, or (an error before it started) the upstream's error in OpenAI's shape."""
        up = await self.upstream.send_json(path, body, headers, stream=True, extra_headers=extra)
        if up.ok:
            return up
        try:
            err = await up.error_body()
        finally:
            await up.aclose()
        record.upstream_error = f"http_{up.status_code}"
        return Answered(err, up.status_code)

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
                    up = await enforcer.open_args_stream(info)
                    conv = self._converter(model)
                    conv.base_usage = enforcer.usage
                    batches = chat_event_batches(up, conv, ContentAsCall(info).feed)
                    return self._stream(batches, up, state, record, persist, guard)
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
        return await self._forward(body, state, record, persist, history, headers, extra, guard=guard)

    async def _forward(self, body: dict[str, Any], state: RequestState, record: RequestRecord,
                       persist: Persist | None, history: list[dict[str, Any]], headers: Mapping[str, str],
                       extra: Mapping[str, str], *, guard: Guard | None) -> Outcome:
        """Send the request to the configured upstream API and answer from what comes back (streamed or not);
        ``guard`` checks the answer when enforcement is on."""
        model = body.get("model") if isinstance(body.get("model"), str) else None
        chat = self.settings.upstream_api == "chat"
        path = "/v1/chat/completions" if chat else "/v1/responses"
        upstream_body = build_chat_request(body, state.ctx, history) if chat else \
            build_upstream_request(body, state.ctx, history)
        if record.stream:
            up = await self._open_stream(path, upstream_body, headers, extra, record)
            if isinstance(up, Answered):
                return up
            batches = chat_event_batches(up, self._converter(model)) if chat else responses_event_batches(up)
            return self._stream(batches, up, state, record, persist, guard)
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
            final = restore_response(payload, state, output=restore_output(payload.get("output") or [], state))
        return await self._finish(final, record, persist, guard)

    # ------------------------------------------------------------------ gateway-executed (MCP) tools

    async def _mcp(self, body: dict[str, Any], state: RequestState, record: RequestRecord, persist: Persist | None,
                   history: list[dict[str, Any]], headers: Mapping[str, str], extra: Mapping[str, str],
                   owner: str | None) -> Outcome:
        """A response whose tools the gateway runs: the tool loop (gateway.server.tool_loop) produces it."""
        if self.mcp is None:
            raise InvalidRequest("This gateway does not run mcp tools.", param="tools", code="mcp_not_enabled")
        ctx, executor = self.mcp.bind(state.ctx, body, owner)
        state = replace(state, ctx=ctx)
        loop = ToolLoop(self, body, state, history, headers, extra, record, persist, executor, owner)
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

    async def _loop_round(self, loop: ToolLoop, translator: FunctionSseTranslator,
                          round_history: list[dict[str, Any]], withhold: bool) -> AsyncIterator[list[ClientEvent]]:
        """One upstream round of the tool loop, pumped into the loop's translator."""
        record = loop.record
        body, ctx = loop.round_body(round_history, withhold)
        body["stream"] = True
        model = body.get("model") if isinstance(body.get("model"), str) else None
        chat = self.settings.upstream_api == "chat"
        plan = plan_for(ctx, self.settings.tool_choice_enforcement) if translator.round == 0 else plan_for(ctx, "off")
        try:
            if plan.constrain:
                enforcer = Enforcer(plan, self.upstream, self.settings, body, ctx, loop.history, loop.headers,
                                    record, loop.extra)
                info = await enforcer.choose_tool()
                up = await enforcer.open_args_stream(info)
                conv = self._converter(model)
                conv.base_usage = enforcer.usage
                batches = chat_event_batches(up, conv, ContentAsCall(info).feed)
            else:
                path = "/v1/chat/completions" if chat else "/v1/responses"
                upstream_body = build_chat_request(body, ctx, loop.history) if chat else \
                    build_upstream_request(body, ctx, loop.history)
                opened = await self._open_stream(path, upstream_body, loop.headers, loop.extra, record)
                if isinstance(opened, Answered):
                    err = opened.payload.get("error") if isinstance(opened.payload, dict) else None
                    err = err if isinstance(err, dict) else {}
                    yield translator.fail("upstream_error", str(err.get("message") or
                                                                "The upstream refused the request."))
                    return
                up = opened
                batches = chat_event_batches(up, self._converter(model)) if chat else responses_event_batches(up)
        except Violation as exc:
            yield translator.fail("tool_choice_violation", str(exc))
            return
        except StepError as exc:
            record.upstream_error = f"http_{exc.status}"
            yield translator.fail("upstream_error", "An enforcement step's upstream request failed.")
            return
        except GatewayError as exc:
            yield translator.fail(exc.code or "upstream_error", exc.message)
            return
        async for chunk in self._pump_events(batches, up, translator, record, persist=loop.persist, guard=None):
            yield chunk

    async def _loop_finished(self, translator: FunctionSseTranslator, record: RequestRecord,
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

    def reasoning_sealer(self) -> ReasoningSealer:
        if self.sealer is None:
            if self.settings.reasoning_key:
                self.sealer = ReasoningSealer(parse_keys(self.settings.reasoning_key))
            else:
                log.warning("reasoning_key_random", message="No --reasoning-key: reasoning encrypted_content is "
                            "sealed with a random per-process key, so it does not open after a restart or on "
                            "another replica. Set GATEWAY_REASONING_KEY.")
                self.sealer = ReasoningSealer.random()
        return self.sealer

    async def _no_generation(self, state: RequestState, record: RequestRecord, persist: Persist | None) -> Outcome:
        """``generate: false`` (Codex's warm-up): a completed, empty response whose id later turns chain from; its
        input is kept as history. Nothing is sent upstream."""
        translator = FunctionSseTranslator(state)
        frames = translator.start() + translator.end(usage=ZERO_USAGE)
        final = translator.final_response
        assert final is not None
        record.response_status = "completed"
        return await self._made_here_stored(persist, frames, final, record)

    def _converter(self, model: str | None) -> ChatToResponsesEvents:
        return ChatToResponsesEvents(model=model, max_unnamed_bytes=self.settings.max_unnamed_call_bytes)

    @staticmethod
    def _translate_all(events: list[UpstreamEvent], state: RequestState) -> dict[str, Any]:
        """A non-streamed answer through the same translator as a stream: one code path for both."""
        translator = FunctionSseTranslator(state)
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
        translator = FunctionSseTranslator(state)
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

    def _stream(self, batches: AsyncIterator[list[UpstreamEvent]], up: UpstreamResponse, state: RequestState,
                record: RequestRecord, persist: Persist | None, guard: Guard | None) -> Outcome:
        translator = FunctionSseTranslator(state)
        if guard is not None and guard.plan.regenerate:
            takeover = GrammarTakeover(state.ctx, guard.enforcer, lambda: _so_far(translator))
            guard.checked = takeover.checked
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
        source = self.drain.guard(batches) if self.drain is not None else batches
        try:
            out: list[ClientEvent] = []
            try:
                async for events in source:
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
                else:
                    out += translator.finish()
            except ShuttingDown:
                out += translator.fail("gateway_shutting_down", "The gateway is shutting down; the stream was "
                                       "ended after the drain period. Retry the request.")
            except httpx.ReadTimeout:
                record.upstream_error = "idle_timeout"
                out += translator.fail("stream_idle_timeout", f"No upstream event for "
                                       f"{self.settings.stream_idle_timeout:g} seconds; the gateway ended the stream.")
            except httpx.HTTPError as exc:
                record.upstream_error = "stream_broken"
                out += translator.fail("upstream_connection_error",
                                       f"The upstream connection broke mid-stream ({type(exc).__name__}).")
            except StepError as exc:  # a regeneration step's upstream error: the answer so far, then failed
                record.upstream_error = f"http_{exc.status}"
                out += translator.fail("upstream_error", "An enforcement step's upstream request failed.")
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
            record.tool_calls = {"custom": stats.custom_calls, "function": stats.function_calls}
            record.held_bytes_peak = stats.held_bytes_peak
            record.overflowed = stats.overflowed
            if stats.raw_inputs or stats.input_mismatches:
                # Counts only: a custom tool's input never reaches the logs.
                log.debug("custom_input_not_input_json", request_id=record.request_id, raw=stats.raw_inputs,
                          mismatches=stats.input_mismatches)
            # Closed here, in order, rather than left to the garbage collector: an async generator abandoned
            # at a break is finalized later by a task the event loop creates for it, once per response.
            for gen in ((source, batches) if source is not batches else (batches,)):
                aclose = getattr(gen, "aclose", None)
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

    async def _resolve_references(self, body: dict[str, Any], owner: str | None = None,
                                  budget: HistoryBudget | None = None) -> dict[str, Any]:
        """``item_reference`` inputs replaced by the stored items they name (any input or output item), bounded by
        ``budget`` while they are loaded."""
        raw = body.get("input")
        if not isinstance(raw, list):
            return body
        refs = {i: item for i, item in enumerate(raw)
                if isinstance(item, dict) and item.get("type") == "item_reference"}
        if not refs:
            return body
        for i, item in refs.items():
            if not isinstance(item.get("id"), str) or not item["id"]:
                raise InvalidRequest("An item_reference needs the id of a stored item.", param=f"input[{i}].id",
                                     code="invalid_value")
        if self.store is None:
            raise InvalidRequest("item_reference needs a response store, and this gateway runs with --store none.",
                                 param=f"input[{min(refs)}]", code="store_disabled")
        try:
            found = await self.store.get_items([item["id"] for item in refs.values()], owner=owner,
                                               max_bytes=None if budget is None else budget.left)
        except HistoryTooLargeError as exc:
            assert budget is not None
            at = next((i for i, item in refs.items() if item["id"] == exc.item_id), min(refs))
            raise budget.exceeded(f"input[{at}].id") from None
        if budget is not None:
            budget.left -= sum(len(orjson.dumps(item)) for item in found.values())
        for i, item in refs.items():
            if item["id"] not in found:
                raise InvalidRequest(f"Item with id '{item['id']}' not found.", param=f"input[{i}].id",
                                     code="item_not_found")
        return {**body, "input": [found[item["id"]] if i in refs else item for i, item in enumerate(raw)]}

    async def _history(self, body: dict[str, Any], owner: str | None = None, turn: Turn | None = None,
                       budget: HistoryBudget | None = None) -> list[dict[str, Any]]:
        max_bytes = None if budget is None else max(budget.left, 0)
        try:  # the `conversation` field's items
            conversation = await conversation_history(self.store, body, owner, max_bytes=max_bytes)
        except HistoryTooLargeError:
            assert budget is not None
            raise budget.exceeded("conversation") from None
        if conversation is not None:
            return conversation
        prev = body.get("previous_response_id")
        if not prev:
            return []
        local = turn.local_history(prev) if turn is not None else None
        if local is not None:
            return local
        if turn is not None and self.store is None:  # found nowhere: not on this connection, and no store
            raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
        if self.store is None:
            raise InvalidRequest("previous_response_id needs a response store, and this gateway runs with "
                                 "--store none.", param="previous_response_id", code="store_disabled")
        try:
            chain = await self.store.get_chain(prev, owner=owner, max_bytes=max_bytes)
        except HistoryTooLargeError:
            assert budget is not None
            raise budget.exceeded("previous_response_id") from None
        except BrokenChainError as exc:
            raise NotFound(f"Response with id '{prev}' cannot be continued: an earlier response in its chain "
                           f"('{exc.missing_id}') no longer exists.", param="previous_response_id") from None
        if not chain:
            raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
        return history_from_chain(chain)

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
            rec = StoredResponse(id=final["id"], created_at=int(final.get("created_at") or now),
                                 previous_response_id=body.get("previous_response_id"),
                                 status=str(final.get("status")), response=final, input_items=items,
                                 tool_context=tool_context, updated_at=now, owner=owner) if keep else None
            turn = None
            if conversation_id is not None and final.get("status") in APPENDED_STATUSES:
                # A response's turn joins its conversation whatever `store` says, as OpenAI does.
                turn_items = [conversation_item(i) for i in items]
                turn_items += [conversation_item(o) for o in final.get("output") or () if isinstance(o, dict)]
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


def _so_far(translator: FunctionSseTranslator) -> tuple[dict[str, Any] | None, str]:
    """The upstream's response snapshot and the assistant text streamed so far (for a takeover step)."""
    acc = translator.acc
    text = "".join(up.text(ci) for _, up in sorted(acc.items.items())
                   if up.type == "message" for ci in sorted(up.texts))
    return acc.snapshot, text


@dataclass(frozen=True, slots=True)
class Answered:
    """A JSON answer: a non-streamed Response (200) or an error in OpenAI's shape with its status."""

    payload: Any
    status: int = 200


@dataclass(frozen=True, slots=True)
class Streamed:
    """The client's events, in order, in batches (one write each), ending with the terminal event; each
    transport encodes them (SSE: gateway.protocol.sse.encode_events)."""

    events: AsyncIterator[list[ClientEvent]]


Outcome = Answered | Streamed


@dataclass
class Turn:
    """One response on a WebSocket connection: the connection's cache of recent responses, and what the
    response used (its history and input items, which the connection caches for the next turn)."""

    local_history: Callable[[str], list[dict[str, Any]] | None]
    history: list[dict[str, Any]] = field(default_factory=list)
    input_items: list[dict[str, Any]] = field(default_factory=list)


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
    counts = {"custom": 0, "function": 0}
    for item in final.get("output") or ():
        if item.get("type") == "custom_tool_call":
            counts["custom"] += 1
        elif item.get("type") == "function_call":
            counts["function"] += 1
    record.tool_calls = counts
