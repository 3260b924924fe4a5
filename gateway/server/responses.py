"""POST /v1/responses: resolve the request once, rewrite it, forward it, and pump the answer back."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import structlog
from starlette.requests import Request
from starlette.responses import Response

from gateway.config import Settings
from gateway.enforce.constrain import ContentAsCall
from gateway.enforce.live import GrammarTakeover
from gateway.enforce.runner import Enforcer, Guard, Plan, StepError, Violation, plan_for, violation_response
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.protocol.ids import new_id
from gateway.protocol.request import parse_request_body
from gateway.server.http import OrjsonResponse, SseResponse, read_body
from gateway.server.record import RequestRecord
from gateway.server.shutdown import Drain, ShuttingDown
from gateway.store import BrokenChainError, ResponseStore, StoredResponse
from gateway.translate.chat import ChatToResponsesEvents, Event, build_chat_request
from gateway.translate.restore import RequestState, build_request_state, restore_output, restore_response
from gateway.translate.rewrite import build_upstream_request
from gateway.translate.tool_context import ToolInfo, resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from gateway.upstream.chat import chat_completion_events, chat_event_batches, responses_event_batches
from gateway.upstream.client import UpstreamClient, UpstreamResponse

log = structlog.get_logger("gateway.responses")

Persist = Callable[[dict[str, Any]], Awaitable[None]]

__all__ = ["ResponsesHandler", "public_input_items"]


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
    # Hook points for tool_choice enforcement (gateway.enforce); None: forward as is.
    strategy: Callable[..., Awaitable[Response] | None] | None = None
    # Graceful shutdown: ends streams still running after the drain period (gateway.server.shutdown).
    drain: Drain | None = None

    async def create(self, request: Request, record: RequestRecord) -> Response:
        raw = await read_body(request, self.settings.max_body_bytes)
        record.request_bytes = len(raw)
        body = parse_request_body(raw)
        record.model = body.get("model") if isinstance(body.get("model"), str) else None
        record.stream = bool(body.get("stream"))
        body = await self._resolve_references(body)
        ctx = resolve_tool_context(body)
        history = await self._history(body)
        state = build_request_state(body, ctx, response_id=new_id("resp"), created_at=int(time.time()),
                                    max_unnamed_call_bytes=self.settings.max_unnamed_call_bytes)
        persist = self._persister(body, state) if self._should_store(body) else None
        headers = {k: v for k, v in request.headers.items()}
        extra = {"x-request-id": record.request_id}
        plan = plan_for(ctx, self.settings.tool_choice_enforcement)
        if self.settings.upstream_api != "responses" or plan.active:
            enforcer = Enforcer(plan, self.upstream, self.settings, body, ctx, history, headers, record, extra)
            try:
                return await self._enforced(body, plan, enforcer, state, record, persist, history)
            except StepError as exc:
                record.upstream_error = f"http_{exc.status}"
                return OrjsonResponse(exc.payload, status_code=exc.status)
        return await self._forward(body, state, record, persist, history, headers, extra, guard=None)

    async def _open_stream(self, path: str, body: dict[str, Any], headers: Mapping[str, str],
                           extra: Mapping[str, str], record: RequestRecord) -> UpstreamResponse | Response:
        """The open upstream stream, or (an error before it started) the upstream's error in OpenAI's shape."""
        up = await self.upstream.send_json(path, body, headers, stream=True, extra_headers=extra)
        if up.ok:
            return up
        try:
            err = await up.error_body()
        finally:
            await up.aclose()
        record.upstream_error = f"http_{up.status_code}"
        return OrjsonResponse(err, status_code=up.status_code)

    # ------------------------------------------------------------------ chat mode and enforcement

    async def _enforced(self, body: dict[str, Any], plan: Plan, enforcer: Enforcer, state: RequestState,
                        record: RequestRecord, persist: Persist | None, history: list[dict[str, Any]]) -> Response:
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
                       extra: Mapping[str, str], *, guard: Guard | None) -> Response:
        """Send the request to the configured upstream API and answer from what comes back (streamed or not);
        ``guard`` checks the answer when enforcement is on."""
        model = body.get("model") if isinstance(body.get("model"), str) else None
        chat = self.settings.upstream_api == "chat"
        path = "/v1/chat/completions" if chat else "/v1/responses"
        upstream_body = build_chat_request(body, state.ctx, history) if chat else \
            build_upstream_request(body, state.ctx, history)
        if record.stream:
            up = await self._open_stream(path, upstream_body, headers, extra, record)
            if isinstance(up, Response):
                return up
            batches = chat_event_batches(up, self._converter(model)) if chat else responses_event_batches(up)
            return self._stream(batches, up, state, record, persist, guard)
        status, payload = await self.upstream.post_json(path, upstream_body, headers)
        if status >= 400:
            record.upstream_error = f"http_{status}"
            return OrjsonResponse(payload, status_code=status)
        if not isinstance(payload, dict):
            raise GatewayError("The upstream answered with an unexpected body.", status=502, type="server_error",
                               code="upstream_error")
        if chat:
            final = self._translate_all(chat_completion_events(payload, self._converter(model)), state)
        else:
            final = restore_response(payload, state, output=restore_output(payload.get("output") or [], state))
        return await self._finish(final, record, persist, guard)

    def _converter(self, model: str | None) -> ChatToResponsesEvents:
        return ChatToResponsesEvents(model=model, max_unnamed_bytes=self.settings.max_unnamed_call_bytes)

    @staticmethod
    def _translate_all(events: list[Event], state: RequestState) -> dict[str, Any]:
        """A non-streamed answer through the same translator as a stream: one code path for both."""
        translator = FunctionSseTranslator(state)
        for event, data in events:
            translator.feed(event, data)
            if translator.finished:
                break
        translator.finish()
        assert translator.final_response is not None
        return translator.final_response

    async def _finish(self, final: dict[str, Any], record: RequestRecord, persist: Persist | None,
                      guard: Guard | None) -> Response:
        if guard is not None:
            final = await guard.settle(final)
        _count_calls(record, final)
        record.usage = final.get("usage") if isinstance(final.get("usage"), dict) else None
        record.response_status = final.get("status")
        if persist is not None:
            await persist(final)
        return OrjsonResponse(final, headers={"x-request-id": record.request_id})

    async def _violation(self, message: str, state: RequestState, record: RequestRecord,
                         persist: Persist | None) -> Response:
        """No call could be made at all (the pick step failed): a failed response, streamed or not."""
        translator = FunctionSseTranslator(state)
        frames = translator.fail("tool_choice_violation", message)
        final = translator.final_response or violation_response(restore_response(None, state, output=[]), message)
        record.response_status = "failed"
        if persist is not None:
            await persist(final)
        if not record.stream:
            return OrjsonResponse(final, headers={"x-request-id": record.request_id})

        async def once() -> AsyncIterator[bytes]:
            yield b"".join(frames)

        return SseResponse(once(), headers={"x-request-id": record.request_id},
                           on_disconnect=lambda: _mark_disconnect(record))

    def _stream(self, batches: AsyncIterator[list[Event]], up: UpstreamResponse, state: RequestState,
                record: RequestRecord, persist: Persist | None, guard: Guard | None) -> Response:
        translator = FunctionSseTranslator(state)
        if guard is not None and guard.plan.regenerate:
            takeover = GrammarTakeover(state.ctx, guard.enforcer, lambda: _so_far(translator))
            guard.checked = takeover.checked
            batches = takeover.run(batches, up)
        return SseResponse(self._pump_events(batches, up, translator, record, persist, guard),
                           headers={"x-request-id": record.request_id},
                           on_disconnect=lambda: _mark_disconnect(record))

    async def _pump_events(self, batches: AsyncIterator[list[Event]], up: UpstreamResponse,
                           translator: FunctionSseTranslator, record: RequestRecord, persist: Persist | None,
                           guard: Guard | None) -> AsyncIterator[bytes]:
        """Client frames from upstream event batches (chat chunks already converted), written as they come.

        Nothing is held here: the guard sees only the last frames (the terminal event) before the client
        does, so a pinned violation becomes ``response.failed``.
        """
        feed = translator.feed
        try:
            out: list[bytes] = []
            try:
                async for events in (self.drain.guard(batches) if self.drain is not None else batches):
                    for event, data in events:
                        out += feed(event, data)
                        if translator.finished:
                            break
                    if translator.finished:
                        break
                    if out:
                        if record.ttfb is None:
                            record.ttfb = time.perf_counter() - record.started
                        yield b"".join(out)
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
                if persist is not None:
                    await persist(final)
            if out:
                if record.ttfb is None:
                    record.ttfb = time.perf_counter() - record.started
                yield b"".join(out)
        finally:
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                await aclose()
            await up.aclose()
            stats = translator.stats
            record.tool_calls = {"custom": stats.custom_calls, "function": stats.function_calls}
            record.held_bytes_peak = stats.held_bytes_peak
            record.overflowed = stats.overflowed
            if stats.raw_inputs or stats.input_mismatches:
                # Counts only: a custom tool's input never reaches the logs.
                log.debug("custom_input_not_input_json", request_id=record.request_id, raw=stats.raw_inputs,
                          mismatches=stats.input_mismatches)

    def _should_store(self, body: dict[str, Any]) -> bool:
        return self.store is not None and body.get("store", True) is not False

    async def _resolve_references(self, body: dict[str, Any]) -> dict[str, Any]:
        """``item_reference`` inputs replaced by the stored items they name (any input or output item)."""
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
        found = await self.store.get_items([item["id"] for item in refs.values()])
        for i, item in refs.items():
            if item["id"] not in found:
                raise InvalidRequest(f"Item with id '{item['id']}' not found.", param=f"input[{i}].id",
                                     code="item_not_found")
        return {**body, "input": [found[item["id"]] if i in refs else item for i, item in enumerate(raw)]}

    async def _history(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        prev = body.get("previous_response_id")
        if not prev:
            return []
        if self.store is None:
            raise InvalidRequest("previous_response_id needs a response store, and this gateway runs with "
                                 "--store none.", param="previous_response_id", code="store_disabled")
        try:
            chain = await self.store.get_chain(prev)
        except BrokenChainError as exc:
            raise NotFound(f"Response with id '{prev}' cannot be continued: an earlier response in its chain "
                           f"('{exc.missing_id}') no longer exists.", param="previous_response_id") from None
        if not chain:
            raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
        return history_from_chain(chain)

    def _persister(self, body: dict[str, Any], state: RequestState) -> Callable[[dict[str, Any]], Awaitable[None]]:
        store = self.store
        assert store is not None
        items = public_input_items(body)
        tool_context = state.ctx.describe()

        async def persist(final: dict[str, Any]) -> None:
            now = int(time.time())
            rec = StoredResponse(id=final["id"], created_at=int(final.get("created_at") or now),
                                 previous_response_id=body.get("previous_response_id"),
                                 status=str(final.get("status")), response=final, input_items=items,
                                 tool_context=tool_context, updated_at=now)
            try:
                await store.put(rec)
            except Exception as exc:  # the client still gets its answer; the failure is logged and counted
                log.error("store_write_failed", response_id=final.get("id"), error=type(exc).__name__)

        return persist


def _so_far(translator: FunctionSseTranslator) -> tuple[dict[str, Any] | None, str]:
    """The upstream's response snapshot and the assistant text streamed so far (for a takeover step)."""
    acc = translator.acc
    text = "".join(up.text(ci) for _, up in sorted(acc.items.items())
                   if up.type == "message" for ci in sorted(up.texts))
    return acc.snapshot, text


def _mark_disconnect(record: RequestRecord) -> None:
    record.disconnected = True


def _count_calls(record: RequestRecord, final: dict[str, Any]) -> None:
    counts = {"custom": 0, "function": 0}
    for item in final.get("output") or ():
        if item.get("type") == "custom_tool_call":
            counts["custom"] += 1
        elif item.get("type") == "function_call":
            counts["function"] += 1
    record.tool_calls = counts
