"""Counting the prompt the way vLLM will (issue 20): token counts through vLLM's ``/tokenize`` and the model's
context window from ``max_model_len``; and ``truncation`` (``fit``): a prompt that does not fit is a 400
``context_length_exceeded`` (``disabled``) or loses its oldest whole items until it fits (``auto``).

Ordinary requests pay nothing: ``could_reach`` bounds the tokens from bytes (gateway.translate.context_window), and
only a request that could reach the window is counted; the window is asked once per model (``/v1/models``) and
only once a request could reach ``SMALLEST_WINDOW``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from gateway.errors import ContextLengthExceeded, GatewayError, InvalidRequest
from gateway.translate.context_window import (
    droppable_groups,
    input_token_bound,
    request_token_bound,
    tokenize_request,
)
from gateway.upstream.client import UpstreamClient

__all__ = ["SMALLEST_WINDOW", "ContextMeter", "Fitted"]

log = structlog.get_logger("gateway.context")

# The smallest window the gateway guards. A request whose byte bound (with its max_output_tokens) stays below it
# fits any model served for agents (Llama 3's 8k, Qwen's and Mistral's 32k and more), and the gateway asks nothing,
# not even the window: ordinary requests make no upstream call of their own. A model with a smaller window (the
# 2048-token test model) is guarded by its own window once that is known (asked for the first request past this
# bound, or the first with truncation "auto"); before that vLLM's own 400 stands.
SMALLEST_WINDOW = 8192
# Bounds on what the meter keeps: windows per model name, counts per rendered prompt (a digest and an int each).
MAX_MODELS = 64
MAX_COUNTS = 4096

# Builds the upstream body for (request body, history): the configured API's own builder.
Build = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Fitted:
    """A request that fits: its body and history (fewer items when truncated), the input tokens when they were
    counted, and how many items truncation dropped."""

    body: dict[str, Any]
    history: list[dict[str, Any]]
    input_tokens: int | None = None
    dropped: int = 0


class ContextMeter:
    """One per gateway (held by the engine's services); caches the window per model."""

    def __init__(self, upstream: UpstreamClient, *, max_models: int = MAX_MODELS,
                 max_counts: int = MAX_COUNTS) -> None:
        self.upstream = upstream
        self._windows: OrderedDict[str, int | None] = OrderedDict()
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._max_models = max_models
        self._max_counts = max_counts

    async def window(self, model: str, headers: Mapping[str, str]) -> int | None:
        """vLLM's ``max_model_len`` for the model (cached); None when the upstream does not say."""
        if model in self._windows:
            self._windows.move_to_end(model)
            return self._windows[model]
        try:
            status, payload = await self.upstream.get_json("/v1/models", headers)
        except GatewayError as exc:  # unreachable now: not cached, the request goes on (and fails upstream)
            log.warning("context_window_unknown", model=model, error=exc.code)
            return None
        if status in (401, 403) or status >= 500:  # not an answer about the model: asked again next time
            return None
        found: int | None = None
        data = payload.get("data") if isinstance(payload, dict) else None
        for entry in data if isinstance(data, list) else ():
            if not isinstance(entry, dict) or not isinstance(entry.get("max_model_len"), int):
                continue
            name = entry.get("id")
            if isinstance(name, str) and (name == model or not model):
                found = entry["max_model_len"]
                if model:
                    break
        self._remember(self._windows, model, found, self._max_models)
        return found

    def could_reach(self, upstream_body: Mapping[str, Any], tokens: int) -> bool:
        """Cheap bound, no I/O: False only when the rendered input surely has fewer than ``tokens`` tokens."""
        return input_token_bound(upstream_body) >= tokens

    async def count(self, upstream_body: Mapping[str, Any], headers: Mapping[str, str]) -> int:
        """Input tokens of ``upstream_body`` (the body the gateway would send upstream, history expanded) exactly
        as vLLM renders it (chat template, tools), equal to vLLM's own ``usage.input_tokens``."""
        req = tokenize_request(upstream_body)
        key = hashlib.sha256(orjson.dumps(req, option=orjson.OPT_SORT_KEYS)).digest()
        cached = self._counts.get(key)
        if cached is not None:
            self._counts.move_to_end(key)
            return cached
        status, payload = await self.upstream.post_json("/tokenize", req, headers)
        if status != 200 or not isinstance(payload, dict) or not isinstance(payload.get("count"), int):
            err = payload.get("error") if isinstance(payload, dict) else None
            err = err if isinstance(err, dict) else {}
            if status == 200:
                raise GatewayError("The upstream's /tokenize answered without a count.", status=502,
                                   type="server_error", code="upstream_error")
            raise GatewayError(str(err.get("message") or f"The upstream's /tokenize answered HTTP {status}."),
                               status=status if 400 <= status < 600 else 502, param=err.get("param"),
                               code=err.get("code"), type=err.get("type"))
        n = int(payload["count"])
        self._remember(self._counts, key, n, self._max_counts)
        return n

    async def fit(self, body: dict[str, Any], history: list[dict[str, Any]], build: Build,
                  headers: Mapping[str, str]) -> Fitted:
        """``body`` with ``history`` as they fit the model's window with ``max_output_tokens`` reserved.
        ``truncation: "auto"`` drops the fewest whole items from the start of the conversation (droppable_groups)
        until it fits; ``"disabled"`` (or nothing left to drop) raises ContextLengthExceeded."""
        truncation = body.get("truncation")
        if truncation not in (None, "auto", "disabled"):
            raise InvalidRequest("'truncation' must be 'auto' or 'disabled'.", param="truncation",
                                 code="invalid_value")
        max_out = body.get("max_output_tokens")
        # vLLM refuses a prompt of max_model_len tokens or more; with max_output_tokens it must leave that much.
        reserve = max_out if isinstance(max_out, int) and not isinstance(max_out, bool) and max_out > 0 else 1
        model = str(body["model"]) if isinstance(body.get("model"), str) else ""
        # Below SMALLEST_WINDOW nothing is asked while the model's window is unknown; once known (asked for a large
        # request, or for truncation "auto", which must not leave a small window to vLLM), the real window counts.
        known = self._windows.get(model)
        floor = min(SMALLEST_WINDOW, known) if known is not None else SMALLEST_WINDOW
        if truncation == "auto" and model not in self._windows:
            known = await self.window(model, headers)
            floor = min(SMALLEST_WINDOW, known) if known is not None else SMALLEST_WINDOW
        if request_token_bound(body, history) < floor - reserve + 1:
            return Fitted(body, history)  # an ordinary request: not even the upstream body is built for it
        upstream_body = build(body, history)
        if not self.could_reach(upstream_body, floor - reserve + 1):
            return Fitted(body, history)
        window = await self.window(model, headers)
        if window is None:
            return Fitted(body, history)
        limit = window - reserve  # the most prompt tokens that fit
        if not self.could_reach(upstream_body, limit + 1):
            return Fitted(body, history)
        try:
            n = await self.count(upstream_body, headers)
        except GatewayError as exc:  # counting failed: the upstream judges the request itself
            log.warning("context_count_failed", model=model, status=exc.status, error=exc.code)
            return Fitted(body, history)
        if n <= limit:
            return Fitted(body, history, n)
        if truncation != "auto":
            raise ContextLengthExceeded(n, reserve, window)
        return await self._truncate(body, history, build, headers, n, limit, window, reserve)

    async def _truncate(self, body: dict[str, Any], history: list[dict[str, Any]], build: Build,
                        headers: Mapping[str, str], n: int, limit: int, window: int, reserve: int) -> Fitted:
        raw = body.get("input")
        new: list[Any] = raw if isinstance(raw, list) else []
        # A string input is the newest user message: never dropped, every item before it may go.
        tail = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else []
        groups = droppable_groups([*history, *new, *tail])

        def cut(k: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            gone = {i for g in groups[:k] for i in g}
            kept_history = [h for i, h in enumerate(history) if i not in gone]
            if isinstance(raw, list):
                base = len(history)
                return {**body, "input": [x for j, x in enumerate(raw) if base + j not in gone]}, kept_history
            return body, kept_history

        async def fits(k: int) -> int | None:
            b, h = cut(k)
            up = build(b, h)
            counted = await self.count(up, headers)
            return counted if counted <= limit else None

        # The fewest groups: counts only shrink as groups go, so a binary search over how many finds it.
        if not groups or (best := await fits(len(groups))) is None:
            raise ContextLengthExceeded(n, reserve, window)
        lo, hi = 1, len(groups)  # hi fits
        while lo < hi:
            mid = (lo + hi) // 2
            counted = await fits(mid)
            if counted is not None:
                hi, best = mid, counted
            else:
                lo = mid + 1
        b, h = cut(hi)
        dropped = sum(len(g) for g in groups[:hi])
        log.info("context_truncated", model=body.get("model"), dropped_items=dropped, input_tokens=best,
                 window=window)
        return Fitted(b, h, best, dropped)

    @staticmethod
    def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, bound: int) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > bound:
            cache.popitem(last=False)

