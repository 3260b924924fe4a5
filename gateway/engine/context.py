"""Counting the prompt the way vLLM will (issue 20): token counts through vLLM's ``/tokenize`` and the model's
context window from ``max_model_len``.

INTERFACE STUB: the signatures below are a contract between the helpers building issue 20 (compaction uses the
counter for ``context_management`` thresholds); the owner of this module fills it in without changing them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ContextMeter"]


class ContextMeter:
    """One per gateway (held by the engine's services); caches the window per model."""

    async def window(self, model: str, headers: Mapping[str, str]) -> int | None:
        """vLLM's ``max_model_len`` for the model (cached); None when the upstream does not say."""
        raise NotImplementedError

    def could_reach(self, upstream_body: Mapping[str, Any], tokens: int) -> bool:
        """Cheap bound, no I/O: False only when the rendered input surely has fewer than ``tokens`` tokens."""
        raise NotImplementedError

    async def count(self, upstream_body: Mapping[str, Any], headers: Mapping[str, str]) -> int:
        """Input tokens of ``upstream_body`` (the body the gateway would send upstream, history expanded) exactly
        as vLLM renders it (chat template, tools), equal to vLLM's own ``usage.input_tokens``."""
        raise NotImplementedError
