"""Prometheus metrics, one registry per app (several apps in one test process must not collide).

Under ``--workers N`` each worker writes its values to files in the directory the parent created
(prometheus-client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``) and ``/metrics``, whichever worker answers
it, sums them: counters and histograms over every worker that ever ran, gauges over the live ones (the parent
removes a dead worker's gauge files). ``in_flight_requests`` is read from the shared limiter's count at scrape
time (gateway.server.limits), as it is from the process's own limiter with one worker.

``METRICS`` is the single list of what is exported: the README table is generated from it and the
collectors below are built from it, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gateway.engine.record import RequestRecord

__all__ = ["CONTENT_TYPE_LATEST", "METRICS", "GatewayMetrics", "MetricSpec", "metrics_table"]

PREFIX = "responses_gateway_"

# Latency of LLM requests spans milliseconds (errors, cached prefixes) to many minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
# Bytes held for tool calls whose name has not arrived; the default cap is 256 KiB.
HELD_BYTES_BUCKETS = (0, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # without the _total suffix prometheus-client adds to counters
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def exported(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(PREFIX + "requests", "counter", ("route", "status", "stream"),
               "Requests answered, by route template, HTTP status and whether the client asked for a stream."),
    MetricSpec(PREFIX + "request_duration_seconds", "histogram", ("route", "stream"),
               "Time from request start to the last byte sent (streams: until the stream ended)."),
    MetricSpec(PREFIX + "time_to_first_byte_seconds", "histogram", ("route", "stream"),
               "Time from request start to the first response body byte (streams: first SSE frame)."),
    MetricSpec(PREFIX + "active_streams", "gauge", (), "Client SSE streams in progress."),
    MetricSpec(PREFIX + "in_flight_requests", "gauge", (),
               "Requests counted against --max-concurrency (streams count until they end)."),
    MetricSpec(PREFIX + "rejected_requests", "counter", ("reason",),
               "Requests refused before reaching the upstream: unauthorized, concurrency, body_too_large, "
               "body_timeout, draining, host, origin, websocket_connections, background_per_key."),
    MetricSpec(PREFIX + "upstream_errors", "counter", ("kind",),
               "Upstream failures: http_<status>, idle_timeout, stream_broken, upstream_unavailable, "
               "upstream_timeout, upstream_error (other: a status outside 100-599)."),
    MetricSpec(PREFIX + "tool_calls", "counter", ("kind",),
               "Tool calls returned to clients, by kind (custom: translated back from a function call; builtin: "
               "apply_patch, shell or local_shell calls)."),
    MetricSpec(PREFIX + "unnamed_call_held_bytes", "histogram", (),
               "Peak bytes of frames held per streamed response for tool calls whose name had not arrived."),
    MetricSpec(PREFIX + "unnamed_call_overflows", "counter", (),
               "Streamed responses that exceeded --max-unnamed-call-bytes."),
    MetricSpec(PREFIX + "client_disconnects", "counter", ("route",), "Clients that left before the response ended."),
    MetricSpec(PREFIX + "tool_choice_enforcement", "counter", ("outcome",),
               "tool_choice enforcement outcomes: pinned, picked, regenerated, violated."),
    MetricSpec(PREFIX + "grammar_enforcement", "counter", ("route",),
               "Responses with grammar custom tools, by how they were enforced: structural_tag, strict_pattern (one "
               "upstream request), takeover (a second, constrained request per call), validate (checked only)."),
    MetricSpec(PREFIX + "grammar_conversion_failures", "counter", ("form",),
               "Custom-tool grammars that could not be converted (ebnf, regex), once per definition and process; "
               "their calls fall back to the takeover."),
    MetricSpec(PREFIX + "upstream_ready", "gauge", (), "1 when the last readiness probe of the upstream passed."),
    MetricSpec(PREFIX + "streams_aborted_on_shutdown", "counter", (),
               "Streams ended with response.failed (gateway_shutting_down) after the drain period."),
    MetricSpec(PREFIX + "websocket_connections", "gauge", (), "Open WebSocket connections on /v1/responses."),
    MetricSpec(PREFIX + "websocket_messages", "counter", ("type",),
               "WebSocket messages received, by type: response.create, other (any other type), invalid (no type)."),
    MetricSpec(PREFIX + "reasoning_blobs_rejected", "counter", (),
               "Reasoning encrypted_content blobs that did not open (another key, tampered); dropped."),
    MetricSpec(PREFIX + "compaction_blobs_rejected", "counter", (),
               "Compaction items whose encrypted_content did not open (another key or owner, tampered); a 400."),
    MetricSpec(PREFIX + "compactions", "counter", (),
               "Compaction passes the upstream model ran (/v1/responses/compact, context_management, trigger)."),
    MetricSpec(PREFIX + "mcp_calls", "counter", ("server_label", "outcome"),
               "MCP tool calls the gateway ran: completed, failed (tool error, HTTP, timeout), not_run."),
    MetricSpec(PREFIX + "mcp_call_duration_seconds", "histogram", ("server_label",),
               "Duration of the MCP tool calls the gateway ran."),
    MetricSpec(PREFIX + "web_search_calls", "counter", ("provider", "outcome"),
               "Web searches the gateway ran or refused: completed, error, timeout, no_query, limit, rate_limited, "
               "not_run."),
)


def metrics_table() -> str:
    """The Markdown table for the README."""
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        rows.append(f"| `{spec.exported}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(rows)


_BUCKETS = {
    PREFIX + "request_duration_seconds": LATENCY_BUCKETS,
    PREFIX + "time_to_first_byte_seconds": TTFB_BUCKETS,
    PREFIX + "unnamed_call_held_bytes": HELD_BYTES_BUCKETS,
    PREFIX + "mcp_call_duration_seconds": LATENCY_BUCKETS,
}

# Only these error codes of the gateway's own errors are upstream failures (the rest are client errors).
_UPSTREAM_CODES = frozenset({"upstream_unavailable", "upstream_timeout", "upstream_error"})

# Label values are a closed set: anything else becomes "other", so no client (nor upstream) can mint series on an
# unauthenticated /metrics. The values below are the gateway's own constants.
OTHER = "other"
_UPSTREAM_KINDS = frozenset({"idle_timeout", "stream_broken", *_UPSTREAM_CODES,
                             *(f"http_{status}" for status in range(100, 600))})
_TOOL_KINDS = frozenset({"custom", "function", "builtin"})
_ENFORCEMENT_OUTCOMES = frozenset({"pinned", "picked", "regenerated", "violated", "valid", "unchecked",
                                   "constrained", "step_failed", "fallback_validate"})
_GRAMMAR_ROUTES = frozenset({"structural_tag", "strict_pattern", "takeover", "validate"})
_GRAMMAR_FORMS = frozenset({"ebnf", "regex"})
_SEARCH_PROVIDERS = frozenset({"searxng", "brave", "tavily", "demo"})
_SEARCH_OUTCOMES = frozenset({"completed", "error", "timeout", "no_query", "limit", "rate_limited", "not_run"})
_REJECTIONS = frozenset({"unauthorized", "concurrency", "body_too_large", "body_timeout", "draining", "host",
                         "origin", "websocket_connections", "background_per_key"})


def bounded(value: str, known: frozenset[str]) -> str:
    """``value`` when it is one of ``known``, else ``other``."""
    return value if value in known else OTHER


# How each gauge's per-worker values combine under --workers N (prometheus-client's multiprocess_mode):
# live ones only, summed; the readiness probe's latest answer, whichever worker ran it.
_GAUGE_MODES: dict[str, Literal["livesum", "livemostrecent"]] = {
    PREFIX + "active_streams": "livesum",
    PREFIX + "websocket_connections": "livesum",
    PREFIX + "upstream_ready": "livemostrecent",
}
_IN_FLIGHT = PREFIX + "in_flight_requests"


class _InFlight(Collector):
    """``in_flight_requests`` under --workers N: the shared limiter's count (a callback gauge cannot live in the
    multiprocess files)."""

    def __init__(self, help_text: str, read: Callable[[], float]) -> None:
        self.help = help_text
        self.read = read

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(_IN_FLIGHT, self.help, value=float(self.read()))


class GatewayMetrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        """``multiprocess_dir``: the workers' shared directory (the process must have been started with
        ``PROMETHEUS_MULTIPROC_DIR`` naming it); None: this process's values only."""
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        self._in_flight_read: Callable[[], float] = lambda: 0.0
        built: dict[str, Counter | Gauge | Histogram] = {}
        for spec in METRICS:
            short = spec.name.removeprefix(PREFIX)
            if spec.kind == "counter":
                built[short] = Counter(spec.name, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "gauge" and multiprocess_dir is not None and spec.name == _IN_FLIGHT:
                continue  # not a file-backed gauge: read from the shared count at scrape time (render)
            elif spec.kind == "gauge":
                built[short] = Gauge(spec.name, spec.help, spec.labels, registry=self.registry,
                                     multiprocess_mode=_GAUGE_MODES.get(spec.name, "livesum"))
            else:
                built[short] = Histogram(spec.name, spec.help, spec.labels, registry=self.registry,
                                         buckets=_BUCKETS[spec.name])
        self._m = built
        self.requests: Counter = built["requests"]  # type: ignore[assignment]
        self.duration: Histogram = built["request_duration_seconds"]  # type: ignore[assignment]
        self.ttfb: Histogram = built["time_to_first_byte_seconds"]  # type: ignore[assignment]
        self.active_streams: Gauge = built["active_streams"]  # type: ignore[assignment]
        self.in_flight: Gauge | None = built.get("in_flight_requests")  # type: ignore[assignment]
        self.rejected: Counter = built["rejected_requests"]  # type: ignore[assignment]
        self.upstream_errors: Counter = built["upstream_errors"]  # type: ignore[assignment]
        self.tool_calls: Counter = built["tool_calls"]  # type: ignore[assignment]
        self.held_bytes: Histogram = built["unnamed_call_held_bytes"]  # type: ignore[assignment]
        self.overflows: Counter = built["unnamed_call_overflows"]  # type: ignore[assignment]
        self.disconnects: Counter = built["client_disconnects"]  # type: ignore[assignment]
        self.enforcement: Counter = built["tool_choice_enforcement"]  # type: ignore[assignment]
        self.upstream_ready: Gauge = built["upstream_ready"]  # type: ignore[assignment]
        self.grammar_enforcement: Counter = built["grammar_enforcement"]  # type: ignore[assignment]
        self.grammar_conversion_failures: Counter = built["grammar_conversion_failures"]  # type: ignore[assignment]
        self.aborted_on_shutdown: Counter = built["streams_aborted_on_shutdown"]  # type: ignore[assignment]
        self.mcp_calls: Counter = built["mcp_calls"]  # type: ignore[assignment]
        self.reasoning_rejected: Counter = built["reasoning_blobs_rejected"]  # type: ignore[assignment]
        self.compaction_rejected: Counter = built["compaction_blobs_rejected"]  # type: ignore[assignment]
        self.compactions: Counter = built["compactions"]  # type: ignore[assignment]
        self.websocket_connections: Gauge = built["websocket_connections"]  # type: ignore[assignment]
        self.websocket_messages: Counter = built["websocket_messages"]  # type: ignore[assignment]
        self.mcp_duration: Histogram = built["mcp_call_duration_seconds"]  # type: ignore[assignment]
        self.web_search_calls: Counter = built["web_search_calls"]  # type: ignore[assignment]

    def reject(self, reason: str) -> None:
        """One request refused before its handler ran (``rejected_requests_total{reason}``)."""
        self.rejected.labels(bounded(reason, _REJECTIONS)).inc()

    def track_in_flight(self, read: Callable[[], float]) -> None:
        """``in_flight_requests`` reads ``read()`` (the limiter's count) at each scrape."""
        self._in_flight_read = read
        if self.in_flight is not None:
            self.in_flight.set_function(read)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        # A registry per scrape, as prometheus-client prescribes: the collector reads every worker's files.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        help_text = next(spec.help for spec in METRICS if spec.name == _IN_FLIGHT)
        registry.register(_InFlight(help_text, self._in_flight_read))
        return generate_latest(registry)

    def observe(self, record: RequestRecord) -> None:
        """Called once per finished request (after a stream's last byte)."""
        stream = "true" if record.stream else "false"
        self.requests.labels(record.route, str(record.status), stream).inc()
        if record.duration is not None:
            self.duration.labels(record.route, stream).observe(record.duration)
        if record.ttfb is not None:
            self.ttfb.labels(record.route, stream).observe(record.ttfb)
        kind = record.upstream_error or (record.error_code if record.error_code in _UPSTREAM_CODES else None)
        if kind:
            self.upstream_errors.labels(bounded(kind, _UPSTREAM_KINDS)).inc()
        for tool_kind, count in record.tool_calls.items():
            if count:
                self.tool_calls.labels(bounded(tool_kind, _TOOL_KINDS)).inc(count)
        if record.stream and record.route == "/v1/responses" and 200 <= record.status < 300:
            self.held_bytes.observe(record.held_bytes_peak)
        if record.overflowed:
            self.overflows.inc()
        if record.disconnected:
            self.disconnects.labels(record.route).inc()
        for outcome in record.enforcement:
            self.enforcement.labels(bounded(outcome, _ENFORCEMENT_OUTCOMES)).inc()
        for route in record.grammar_routes:
            self.grammar_enforcement.labels(bounded(route, _GRAMMAR_ROUTES)).inc()
        for form in record.grammar_conversion_failures:
            self.grammar_conversion_failures.labels(bounded(form, _GRAMMAR_FORMS)).inc()
        if record.reasoning_rejected:
            self.reasoning_rejected.inc(record.reasoning_rejected)
        if record.compaction_rejected:
            self.compaction_rejected.inc(record.compaction_rejected)
        if record.compactions:
            self.compactions.inc(record.compactions)
        for label, outcome, seconds in record.mcp_calls:
            self.mcp_calls.labels(label, outcome).inc()
            if seconds is not None:
                self.mcp_duration.labels(label).observe(seconds)
        for provider, outcome in record.web_search_calls:
            self.web_search_calls.labels(bounded(provider, _SEARCH_PROVIDERS), bounded(outcome, _SEARCH_OUTCOMES)).inc()
