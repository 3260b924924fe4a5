"""One-request grammar enforcement, the engine's half (issue 18): is this upstream able to take it, which route each
grammar tool of a request takes (the pure decision: gateway.enforce.onerequest), and the calls it produced.

* **Knowing the upstream.** vLLM's ``GET /version`` is asked once, at the first request with a grammar tool under
  ``constrain``, and the answer cached for the upstream client; a transport failure of any model request
  (``UpstreamClient.generation``: the server may have restarted as another version) makes the next such request
  ask again. vLLM ≥ ``MIN_VLLM`` (the version the structural tags and the strict-tool pattern were verified on) can;
  anything else (an older vLLM, a server without ``/version``, no answer) keeps the takeover, which works on any
  server with Chat Completions, and ``validate`` where that is missing too.
* **Conversion failures** are reported once per grammar definition and process: one warning (no grammar text) and
  ``grammar_conversion_failures_total{form}``; the tool keeps the takeover.
* **The calls.** A one-request call arrives constrained; its input is still checked once at its end (cheap, never
  held): a call cut by ``max_output_tokens`` (or one a server did not constrain) is closed ``incomplete``, never
  handed out as a completed ``custom_tool_call`` whose input fails its grammar.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import structlog

from gateway.enforce.onerequest import GrammarRoutes, grammar_routes
from gateway.enforce.validate import check_input
from gateway.engine.record import RequestRecord
from gateway.protocol.events import UpstreamEvent
from gateway.protocol.ids import custom_call_item_id
from gateway.translate import grammar_convert
from gateway.translate.custom_input import final_input
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo
from gateway.upstream.client import UpstreamClient

log = structlog.get_logger("gateway.enforce")

__all__ = ["MIN_VLLM", "UpstreamGrammarSupport", "mark_cut_calls", "routes_for", "vllm_version_ok"]

# vLLM 0.32: structural tags with grammar content on both APIs, _apply_structural_tag's strict-tool pattern (probed).
MIN_VLLM = (0, 32)
PROBE_TIMEOUT = 5.0
_VERSION = re.compile(r"(\d+)\.(\d+)")


def vllm_version_ok(version: Any) -> bool:
    m = _VERSION.match(version) if isinstance(version, str) else None
    return m is not None and (int(m[1]), int(m[2])) >= MIN_VLLM


class UpstreamGrammarSupport:
    """Whether the upstream can constrain grammar calls in the request itself: asked once, again after a reconnect."""

    def __init__(self, upstream: UpstreamClient) -> None:
        self.upstream = upstream
        self._verdict: bool | None = None
        self._generation = -1
        self._lock = asyncio.Lock()
        self.probes = 0

    def _cached(self) -> bool | None:
        return self._verdict if self._generation == self.upstream.generation else None

    async def capable(self) -> bool:
        cached = self._cached()
        if cached is not None:
            return cached
        async with self._lock:  # concurrent first requests wait for one probe
            cached = self._cached()
            if cached is not None:
                return cached
            generation = self.upstream.generation
            self.probes += 1
            answer = await self.upstream.probe_json("/version", PROBE_TIMEOUT)
            version = answer[1].get("version") if isinstance(answer, tuple) and answer[0] == 200 and \
                isinstance(answer[1], dict) else None
            verdict = vllm_version_ok(version)
            log.info("upstream_grammar_support", one_request=verdict,
                     version=version if isinstance(version, str) else None,
                     reason=None if verdict else answer if isinstance(answer, str) else
                     f"GET /version answered {answer[0]}" if version is None else
                     f"vLLM {version} < {MIN_VLLM[0]}.{MIN_VLLM[1]}")
            self._verdict, self._generation = verdict, generation
            return verdict


_REPORTED: OrderedDict[str, None] = OrderedDict()
_REPORTED_MAX = 4096


def _report_failure(record: RequestRecord, info: ToolInfo, form: str) -> None:
    """Once per (definition, form) and process: a warning without the grammar, and the metric."""
    syntax, definition = info.grammar or ("", "")
    key = hashlib.sha256(f"{form}\0{syntax}\0{definition}".encode()).hexdigest()
    if key in _REPORTED:
        return
    _REPORTED[key] = None
    if len(_REPORTED) > _REPORTED_MAX:
        _REPORTED.popitem(last=False)
    record.grammar_conversion_failures.append(form)
    log.warning("grammar_conversion_failed", request_id=record.request_id, tool=info.upstream_name, syntax=syntax,
                form=form, grammar_sha256=key[:16],
                message="This custom tool's grammar could not be converted for the upstream; its calls fall back to "
                        "the takeover (a second, constrained request per call).")


async def routes_for(ctx: ResolvedToolContext, body: dict[str, Any], *, mode: str, parser: str,
                     support: UpstreamGrammarSupport, record: RequestRecord) -> GrammarRoutes:
    """This request's grammar routes (recorded for the metric)."""
    capable = mode == "constrain" and ctx.upstream_tool_choice == "auto" and await support.capable()
    routes = grammar_routes(
        ctx, body, mode=mode, parser=parser, capable=capable,
        to_ebnf=lambda syntax, definition, escaped: grammar_convert.to_ebnf(syntax, definition,
                                                                           json_escaped=escaped),
        # xgrammar applies a string's pattern to its JSON-escaped text between the quotes: the pattern is over that.
        to_regex=grammar_convert.to_json_pattern, on_failure=lambda info, form: _report_failure(record, info, form))
    record.grammar_routes = list(routes.used)
    return routes


DONE = "response.output_item.done"
Note = Callable[..., None]


async def mark_cut_calls(batches: AsyncIterator[list[UpstreamEvent]], ctx: ResolvedToolContext,
                         names: frozenset[str], checked: set[str], note: Note
                         ) -> AsyncIterator[list[UpstreamEvent]]:
    """Pass every batch on at once; a one-request grammar call's ``output_item.done`` is checked against its grammar
    (the call itself streamed live already) and, if its input does not match, closed ``incomplete``."""
    try:
        async for events in batches:
            for k, ev in enumerate(events):
                if ev.event != DONE or (ev.text and '"function_call"' not in ev.text):
                    continue
                marked = _checked_done(ev, ctx, names, checked, note)
                if marked is not None:
                    events[k] = marked
            yield events
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()


def _checked_done(ev: UpstreamEvent, ctx: ResolvedToolContext, names: frozenset[str], checked: set[str],
                  note: Note) -> UpstreamEvent | None:
    try:
        d = ev.json()
    except orjson.JSONDecodeError:
        return None  # the translator fails the response on it
    item = d.get("item") if isinstance(d, dict) else None
    if not isinstance(item, dict) or item.get("type") != "function_call" or item.get("name") not in names:
        return None
    info = ctx.lookup(str(item["name"]))
    if info is None:
        return None
    checked.add(custom_call_item_id(item.get("id"), item.get("call_id")))
    if one_request_input_ok(info, final_input(str(item.get("arguments") or "")), note):
        return None
    return UpstreamEvent.built({**d, "item": {**item, "status": "incomplete"}})


def one_request_input_ok(info: ToolInfo, value: str, note: Note) -> bool:
    """The one check of a call its upstream request constrained (streamed or not), counted: False when the input
    does not match its grammar — the call was cut (``max_output_tokens``) and is closed ``incomplete``, never
    regenerated (that would be the second request the route exists to avoid). Unchecked grammars pass."""
    verdict = check_input(info, value)
    if verdict.unchecked:
        note("check", "unchecked", tool=info.upstream_name, reason=verdict.unchecked)
        return True
    if verdict.ok:
        note("check", "constrained", tool=info.upstream_name)
        return True
    note("check", "violated", tool=info.upstream_name,
         reason=f"the call ended before its input matched the grammar ({verdict.reason}); closed incomplete")
    return False
