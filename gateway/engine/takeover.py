"""Grammar custom calls under ``tool_choice: auto`` with ``constrain``: live, and matching their grammar.

This is the fallback route (issue 18): on vLLM >= 0.32 a grammar tool whose grammar converts is constrained by the
upstream request itself (gateway.enforce.onerequest: one request, no second step); the takeover below is for
upstreams that cannot (an older or unknown server) and grammars that do not convert (``names``: those tools only).

The model decides *whether* to call a grammar tool (``auto``), but vLLM cannot constrain a function's
string argument to a Lark or regex grammar. Holding the call until its end to check it (the old design)
turned Codex's live patch preview into one lump and needed an unbounded buffer. Instead, the gateway
takes the call over at the moment it is opened:

1. The upstream stream is read as usual; every frame goes to the client as soon as it arrives.
2. When it opens a ``function_call`` of a grammar custom tool (the name is known at
   ``output_item.added``), that frame is passed on — the client sees the call open under its ``ctc_``
   id — and the gateway opens the constrained step: ``/v1/chat/completions`` with
   ``structured_outputs: {"grammar": …}`` (or ``{"regex": …}``), given the conversation plus the
   assistant text streamed so far (vLLM's prefix cache makes that prefill cheap).
3. Once the step answers, the upstream stream is closed (vLLM aborts that generation) and the step's
   content streams into the *same* item as its input deltas (``InputContinuation``); the end of the
   step's stream is the response's terminal event. The input is checked once, when it is complete.

If the step cannot be opened (no ``/v1/chat/completions`` upstream, an HTTP error), nothing was lost:
the upstream stream is still open and is read on, and the call is checked at its end as under
``validate`` (logged, counted). Nothing here buffers beyond the frames of one read.

A call whose name arrives only after its arguments is left to the translator's bounded hold and is
checked at the end (it cannot be taken over before it is known to be a grammar call).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from gateway.enforce.constrain import InputContinuation
from gateway.enforce.validate import check_input
from gateway.protocol.events import UpstreamEvent
from gateway.protocol.ids import custom_call_item_id
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo
from gateway.upstream.chat import chat_event_batches
from gateway.upstream.client import UpstreamResponse

if TYPE_CHECKING:
    from gateway.engine.enforcer import Enforcer

log = structlog.get_logger("gateway.enforce")

__all__ = ["GrammarTakeover"]

ADDED = "response.output_item.added"

# (upstream response snapshot, assistant text streamed so far) — read off the translator's accumulator.
SoFar = Callable[[], tuple[dict[str, Any] | None, str]]
OpenStep = Callable[[ToolInfo, str], Awaitable[UpstreamResponse | None]]


class GrammarTakeover:
    """Wraps an upstream event-batch iterator; see the module docstring."""

    def __init__(self, ctx: ResolvedToolContext, enforcer: Enforcer, so_far: SoFar,
                 open_step: OpenStep | None = None, names: frozenset[str] | None = None) -> None:
        self.ctx = ctx
        self.names = names  # the grammar tools left to the takeover (None: all; the others are one-request)
        self.enforcer = enforcer
        self.so_far = so_far
        self.open_step: OpenStep = open_step or enforcer.open_input_stream
        self.checked: set[str] = set()  # client item ids of calls taken over (checked here, once)
        self.taken_over = False

    def _grammar_call(self, ev: UpstreamEvent) -> tuple[dict[str, Any], ToolInfo] | None:
        if ev.text and '"function_call"' not in ev.text:  # cheap: only call openings are parsed
            return None
        try:
            d = ev.json()
        except orjson.JSONDecodeError:
            return None  # the translator fails the response on it
        if not isinstance(d, dict):
            return None
        item = d.get("item")
        if not isinstance(item, dict) or item.get("type") != "function_call" or not item.get("name"):
            return None
        info = self.ctx.lookup(item["name"])
        if info is None or info.kind != "custom" or info.grammar is None or (
                self.names is not None and info.upstream_name not in self.names):
            return None
        if not isinstance(d.get("output_index"), int):
            return None
        return d, info

    async def run(self, batches: AsyncIterator[list[UpstreamEvent]], up: UpstreamResponse
                  ) -> AsyncIterator[list[UpstreamEvent]]:
        try:
            async for events in batches:
                for i, ev in enumerate(events):
                    if ev.event != ADDED:
                        continue
                    found = self._grammar_call(ev)
                    if found is None:
                        continue
                    # Show everything up to and including the call's opening now; the pump feeds it to
                    # the translator before we resume, so so_far() includes this batch's text.
                    yield events[: i + 1]
                    step = await self._open(found[1])
                    if step is None:  # fall back: read the upstream on; the guard checks the call at its end
                        if events[i + 1:]:
                            yield events[i + 1:]
                        async for rest in batches:
                            yield rest
                        return
                    try:
                        await up.aclose()  # vLLM aborts the generation it no longer needs
                    except BaseException:  # cancelled right here: the step, not yet read, is closed too
                        await step.aclose()
                        raise
                    self.taken_over = True
                    # The step's batches are yielded from here, not through another generator: every frame of
                    # the rest of the call passes this loop, and each generator layer costs each frame.
                    snapshot, _ = self.so_far()
                    cont = InputContinuation(found[0], snapshot, self.enforcer.usage)
                    started = time.perf_counter()
                    checked = False
                    try:
                        async with contextlib.aclosing(chat_event_batches(step, cont)) as continued:
                            async for out in continued:
                                if cont.finish_reason is not None and not checked:
                                    checked = True  # before the call's done event reaches the client (and the metric)
                                    self._check(cont, found[1], started)
                                yield out
                    finally:
                        if cont.finished:
                            await step.release()  # read to its end: the connection goes back to the pool
                        else:
                            await step.aclose()
                    return
                yield events
        finally:
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _open(self, info: ToolInfo) -> UpstreamResponse | None:
        from gateway.engine.enforcer import StepError  # runner imports this module

        _, text = self.so_far()
        started = time.perf_counter()
        try:
            return await self.open_step(info, text)
        except StepError as exc:
            self.enforcer.step_unavailable(exc.status, "input", info, started)
            return None
        except Exception as exc:  # a transport failure: the upstream stream still answers the request
            self.enforcer.note("input", "step_failed", tool=info.upstream_name, reason=type(exc).__name__,
                               started=started)
            return None

    def _check(self, cont: InputContinuation, info: ToolInfo, started: float) -> None:
        item = cont.item
        self.checked.add(custom_call_item_id(item.get("id"), item.get("call_id")))
        verdict = check_input(info, cont.text)
        cut = cont.finish_reason == "length"
        if verdict.unchecked:
            outcome, reason = "unchecked", verdict.unchecked
        elif verdict.ok and not cut:
            outcome, reason = "constrained", None
        else:
            outcome = "violated"
            reason = "the constrained input was cut at the token limit" if cut else verdict.reason
        self.enforcer.note("input", outcome, tool=info.upstream_name, reason=reason, started=started)
