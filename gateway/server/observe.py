"""The end of every request: one structured JSON log line, and the listeners (metrics) that read the record.

Only sizes, counts, timings and identifiers are logged: never prompts, tool inputs, headers or credentials.
The log line is built from an explicit list of ``RequestRecord`` fields, so a new field cannot leak into
the log by accident.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

import orjson
import structlog

from gateway.engine.record import RequestRecord

__all__ = ["Observer", "configure_logging", "ensure_logging"]

_configured_by_us = False


def _dumps(event: Any, **kw: Any) -> str:
    """JSONRenderer's serializer: orjson (the stdlib encoder was a visible share of a short response's CPU)."""
    return orjson.dumps(event, default=kw.get("default") or str, option=orjson.OPT_NON_STR_KEYS).decode()


_pid = os.getpid()


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def _add_pid(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Every line says which process wrote it (``--workers N``: which worker); cached, refreshed on fork."""
    event["pid"] = _pid
    return event


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr for structlog *and* the standard library (uvicorn, httpx), so a log collector
    sees one format; each carries the writing process's ``pid``."""
    global _configured_by_us
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_pid,
    ]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer(serializer=_dumps)],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_gateway", False)]:
        root.removeHandler(old)
    handler._gateway = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(lvl)
    # httpx logs every request line at INFO, URLs included; the access log already covers requests.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(serializer=_dumps)],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured_by_us = True


def ensure_logging(level: str = "info") -> None:
    """Configure once: leave a configuration alone that the CLI, a test or an embedding app already made."""
    if not _configured_by_us and not structlog.is_configured():
        configure_logging(level)


class Observer:
    def __init__(self) -> None:
        self.log = structlog.get_logger("gateway.access")
        self.listeners: list[Callable[[RequestRecord], None]] = []

    def begin(self, record: RequestRecord) -> None:
        pass

    def end(self, record: RequestRecord) -> None:
        for listener in self.listeners:
            try:
                listener(record)
            except Exception as exc:  # a metrics bug must not lose the access log line
                self.log.error("observer_listener_failed", error=type(exc).__name__)
        usage = record.usage or {}
        self.log.info(
            "request",
            request_id=record.request_id, route=record.route, method=record.method,
            model=record.model[:128] if record.model else None,  # client-chosen: bounded
            status=record.status, stream=record.stream,
            ttfb_ms=None if record.ttfb is None else round(record.ttfb * 1000, 2),
            duration_ms=None if record.duration is None else round(record.duration * 1000, 2),
            response_status=record.response_status, error_code=record.error_code,
            upstream_error=record.upstream_error, disconnected=record.disconnected or None,
            input_tokens=usage.get("input_tokens"), output_tokens=usage.get("output_tokens"),
            tool_calls=record.tool_calls or None, enforcement=record.enforcement or None,
        )
        self.log.debug("payload_sizes", request_id=record.request_id, request_bytes=record.request_bytes,
                       response_bytes=record.response_bytes)
