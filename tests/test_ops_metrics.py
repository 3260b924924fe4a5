"""Prometheus metrics move with real requests (scraped from /metrics and parsed with prometheus-client)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.engine.record import RequestRecord
from gateway.server.metrics import METRICS, GatewayMetrics, metrics_table
from tests.ops_support import FakeVllm, fake_vllm, gateway, wait_for
from tests.support import replay, sse_events

APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/s'}}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_counters_and_histograms_move_after_real_requests() -> None:
    transport = replay("text_stream", "text_nonstream", "custom_tool_call_strict_stream",
                       "error_unknown_model_nonstream")
    with gateway(transport=transport) as (url, _app, _server):
        before = scrape(httpx.get(url + "/metrics").text)
        assert value(before, "responses_gateway_requests_total", route="/v1/responses", status="200",
                     stream="true") == 0
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True})
        assert r.status_code == 200 and sse_events(r.content)[-1]["type"] == "response.incomplete"  # max tokens
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"})
        assert r.status_code == 200
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "patch", "stream": True,
                                                    "tools": [APPLY_PATCH]})
        assert [e["item"]["type"] for e in sse_events(r.content) if e["type"] == "response.output_item.done"] \
            == ["custom_tool_call"]
        r = httpx.post(url + "/v1/responses", json={"model": "nope", "input": "hi"})
        assert r.status_code == 404
        assert httpx.get(url + "/v1/responses/resp_x").status_code == 404  # store disabled: a client error
        after = scrape(httpx.get(url + "/metrics").text)

    def req(status: str, stream: str, route: str = "/v1/responses") -> float:
        return value(after, "responses_gateway_requests_total", route=route, status=status, stream=stream)

    assert req("200", "true") == 2 and req("200", "false") == 1 and req("404", "false") == 1
    assert req("404", "false", route="/v1/responses/{id}") == 1
    assert value(after, "responses_gateway_request_duration_seconds_count", route="/v1/responses", stream="true") == 2
    assert value(after, "responses_gateway_time_to_first_byte_seconds_count", route="/v1/responses",
                 stream="true") == 2
    assert value(after, "responses_gateway_tool_calls_total", kind="custom") == 1
    assert value(after, "responses_gateway_upstream_errors_total", kind="http_404") == 1
    assert value(after, "responses_gateway_unnamed_call_held_bytes_count") == 2
    assert value(after, "responses_gateway_active_streams") == 0
    assert value(after, "responses_gateway_in_flight_requests") == 0


def test_active_streams_and_client_disconnects() -> None:
    fake = FakeVllm(frame_delay=0.05)
    with fake_vllm(fake) as (up, _), gateway(up) as (url, app, _server):
        with httpx.stream("POST", url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
            chunks = r.iter_raw()  # kept referenced: a collected iterator would close the connection
            next(chunks)
            samples = scrape(httpx.get(url + "/metrics").text)
            assert value(samples, "responses_gateway_active_streams") == 1
            assert value(samples, "responses_gateway_in_flight_requests") == 1
        # the client left after the first frame
        def counted() -> bool:
            return value(scrape(app.state.metrics.render().decode()), "responses_gateway_client_disconnects_total",
                         route="/v1/responses") == 1
        wait_for(counted, what="the disconnect to be counted")
        samples = scrape(httpx.get(url + "/metrics").text)
        assert value(samples, "responses_gateway_active_streams") == 0


def test_upstream_connection_errors_are_counted_by_kind() -> None:
    from tests.support import free_port

    with gateway(f"http://127.0.0.1:{free_port()}") as (url, _app, _server):
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
        samples = scrape(httpx.get(url + "/metrics").text)
    assert value(samples, "responses_gateway_upstream_errors_total", kind="upstream_unavailable") == 1


def test_tool_choice_enforcement_outcomes_are_read_from_the_record() -> None:
    metrics = GatewayMetrics()
    record = RequestRecord(request_id="r", route="/v1/responses", status=200,
                           enforcement=["pinned", "regenerated", "regenerated", "violated"])
    metrics.observe(record)
    samples = scrape(metrics.render().decode())
    name = "responses_gateway_tool_choice_enforcement_total"
    assert value(samples, name, outcome="pinned") == 1 and value(samples, name, outcome="regenerated") == 2
    assert value(samples, name, outcome="violated") == 1


def test_each_app_has_its_own_registry_and_every_declared_metric_is_exported() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe(RequestRecord(request_id="r", route="/v1/responses", status=200))
    assert value(scrape(a.render().decode()), "responses_gateway_requests_total", route="/v1/responses",
                 status="200", stream="false") == 1
    assert value(scrape(b.render().decode()), "responses_gateway_requests_total", route="/v1/responses",
                 status="200", stream="false") == 0
    families = {f.name for f in text_string_to_metric_families(a.render().decode())}
    assert {spec.name for spec in METRICS} <= families
    table = metrics_table()
    assert all(f"`{spec.exported}`" in table for spec in METRICS)


def test_upstream_metrics_are_proxied_with_the_upstream_key_only() -> None:
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _), gateway(up) as (url, _app, _server):
        r = httpx.get(url + "/upstream/metrics", headers={"authorization": "Bearer scraper"})
    assert r.status_code == 200 and "vllm:num_requests_running 0.0" in r.text
    assert r.headers["content-type"].startswith("text/plain")
