"""What one request did, filled in by the handlers and read once at the end (metrics, the access log)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    route: str
    method: str = "POST"
    started: float = 0.0
    model: str | None = None
    stream: bool = False
    status: int = 0
    ttfb: float | None = None
    duration: float | None = None
    response_status: str | None = None
    error_code: str | None = None
    upstream_error: str | None = None
    usage: dict[str, Any] | None = None
    tool_calls: dict[str, int] = field(default_factory=dict)
    held_bytes_peak: int = 0
    overflowed: bool = False
    disconnected: bool = False
    request_bytes: int = 0
    response_bytes: int = 0
    enforcement: list[str] = field(default_factory=list)
    grammar_routes: list[str] = field(default_factory=list)  # how grammar tools were enforced (onerequest.ROUTES)
    grammar_conversion_failures: list[str] = field(default_factory=list)  # forms ("ebnf", "regex"), first time only
    reasoning_rejected: int = 0  # sealed reasoning blobs that did not open
    compaction_rejected: int = 0  # compaction items whose encrypted_content did not open (a 400)
    compactions: int = 0  # compaction passes run (gateway.engine.compaction)
    mcp_calls: list[tuple[str, str, float | None]] = field(default_factory=list)  # (server label, outcome, s)
    web_search_calls: list[tuple[str, str]] = field(default_factory=list)  # (provider, outcome)
