"""What start-up and every request need of web search without loading a provider: the per-key rate and the
start-up log line's fields. Kept apart from ``providers.py`` so a gateway that searches nothing (or only starts
up) never imports the providers' HTTP stack and the MCP address rules they connect through."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from gateway.config import Settings
from gateway.errors import RateLimited

__all__ = ["BRAVE_URL", "PROVIDERS", "TAVILY_URL", "WebSearchRateLimited", "WebSearchRateLimiter", "startup_fields"]

PROVIDERS = ("searxng", "brave", "tavily", "demo")
BRAVE_URL = "https://api.search.brave.com/res/v1/web/search"
TAVILY_URL = "https://api.tavily.com/search"


def startup_fields(settings: Settings) -> dict[str, Any]:
    """The start-up log line's fields: on or off, which provider, which host (never a key, path or query)."""
    kind = settings.web_search_provider
    if kind is None:
        return {"enabled": False, "message": "No --web-search-provider: web_search tools are passed upstream "
                                             "unchanged (vLLM ignores them)."}
    fields: dict[str, Any] = {"enabled": True, "provider": kind}
    if kind != "demo":
        url = settings.web_search_url or {"brave": BRAVE_URL, "tavily": TAVILY_URL}.get(kind, "")
        fields["host"] = urlsplit(url).hostname if url else None
    fields.update(max_results=settings.web_search_max_results,
                  max_calls_per_response=settings.web_search_max_calls_per_response,
                  per_key_per_minute=settings.web_search_per_key_per_minute)
    return fields



# --- the per-key rate -----------------------------------------------------------------------------------------

class WebSearchRateLimited(RateLimited):
    """429: the caller's key ran ``--web-search-per-key-per-minute`` searches in the last minute."""


class WebSearchRateLimiter:
    """Searches per owner (API key) in a sliding minute. The engine calls ``check(owner)`` before each search;
    ``owner`` None (a keyless gateway) is one shared budget. Bounded: at most ``max_owners`` owners tracked
    (least recently used dropped first, idle ones before busy ones), at most ``per_minute`` stamps each."""

    def __init__(self, per_minute: int, *, max_owners: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.max_owners = max(1, max_owners)
        self._clock = clock
        self._stamps: OrderedDict[str, deque[float]] = OrderedDict()

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> WebSearchRateLimiter:
        """The limiter of one process. The windows are per process, so under ``--workers N`` each worker gets
        ``per_minute // N`` (at least 1): a key's total stays within the flag (within N when the flag is below N),
        however SO_REUSEPORT spreads its connections."""
        per_minute = settings.web_search_per_key_per_minute
        if per_minute > 0 and settings.workers > 1:
            per_minute = max(1, per_minute // settings.workers)
        return cls(per_minute, **kwargs)

    def _window(self, owner: str | None, now: float) -> deque[float]:
        key = owner or ""
        stamps = self._stamps.get(key)
        if stamps is None:
            self._evict(now)
            stamps = self._stamps[key] = deque(maxlen=max(1, self.per_minute))
        self._stamps.move_to_end(key)
        while stamps and now - stamps[0] >= 60.0:
            stamps.popleft()
        return stamps

    def _evict(self, now: float) -> None:
        if len(self._stamps) < self.max_owners:
            return
        idle = [k for k, s in self._stamps.items() if not s or now - s[-1] >= 60.0]
        for key in idle:
            del self._stamps[key]
        while len(self._stamps) >= self.max_owners:
            self._stamps.popitem(last=False)

    def retry_after(self, owner: str | None) -> int:
        """Seconds until ``owner`` may search again (0: now)."""
        if self.per_minute <= 0:
            return 0
        now = self._clock()
        stamps = self._window(owner, now)
        if len(stamps) < self.per_minute:
            return 0
        return max(1, int(60.0 - (now - stamps[0]) + 0.999))

    def allow(self, owner: str | None) -> bool:
        """Count one search for ``owner`` if its budget allows; False (nothing counted) when it does not."""
        if self.per_minute <= 0:
            return True
        now = self._clock()
        stamps = self._window(owner, now)
        if len(stamps) >= self.per_minute:
            return False
        stamps.append(now)
        return True

    def check(self, owner: str | None) -> None:
        """``allow`` or raise ``WebSearchRateLimited`` (429 in OpenAI's error shape, with ``Retry-After``)."""
        if not self.allow(owner):
            wait = self.retry_after(owner)
            raise WebSearchRateLimited(
                f"This API key ran its {self.per_minute} web searches of the last minute "
                f"(--web-search-per-key-per-minute); retry in {wait} s.", headers={"Retry-After": str(wait)})
