"""The end of every request: one structured log line. Metrics hook in here too (see gateway.server.metrics).

Only sizes, counts, timings and identifiers are logged: never prompts, tool inputs or credentials.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import structlog

from gateway.server.record import RequestRecord

__all__ = ["Observer", "configure_logging"]


def configure_logging(level: str = "info") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=lvl)
    # httpx logs every request line at INFO, URLs included; the access log already covers requests.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class Observer:
    def __init__(self) -> None:
        self.log = structlog.get_logger("gateway.access")
        self.listeners: list[Callable[[RequestRecord], None]] = []

    def begin(self, record: RequestRecord) -> None:
        pass

    def end(self, record: RequestRecord) -> None:
        for listener in self.listeners:
            listener(record)
        self.log.info(
            "request",
            request_id=record.request_id, route=record.route, method=record.method, model=record.model,
            status=record.status, stream=record.stream,
            ttfb_ms=None if record.ttfb is None else round(record.ttfb * 1000, 2),
            duration_ms=None if record.duration is None else round(record.duration * 1000, 2),
            response_status=record.response_status, error_code=record.error_code,
            upstream_error=record.upstream_error, disconnected=record.disconnected or None,
            input_tokens=(record.usage or {}).get("input_tokens"),
            output_tokens=(record.usage or {}).get("output_tokens"),
            tool_calls=record.tool_calls or None,
        )
        self.log.debug("payload_sizes", request_id=record.request_id, request_bytes=record.request_bytes)
