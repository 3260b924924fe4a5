"""Liveness and readiness against a real fake vLLM that refuses, then fails, then answers."""

from __future__ import annotations

import httpx

from tests.ops_support import FakeVllm, fake_vllm, gateway
from tests.support import free_port


def test_healthz_is_always_ok_even_without_an_upstream() -> None:
    with gateway(f"http://127.0.0.1:{free_port()}") as (url, _app, _server):
        r = httpx.get(url + "/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_readiness_follows_the_upstream_refused_then_503_then_ok_then_hanging() -> None:
    port = free_port()
    with gateway(f"http://127.0.0.1:{port}") as (url, app, _server):
        app.state.readiness.cache_ttl = 0.0  # every call probes, so each flip is seen at once
        app.state.readiness.timeout = 0.3

        # vLLM still loading its model: nothing listens yet
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable" and "unreachable" in r.json()["reason"]

        fake = FakeVllm(health=503)  # engine dead
        with fake_vllm(fake, port=port):
            r = httpx.get(url + "/readyz")
            assert r.status_code == 503 and "HTTP 503" in r.json()["reason"]

            fake.health = 200
            r = httpx.get(url + "/readyz")
            assert r.status_code == 200 and r.json() == {"status": "ok"}
            metrics = httpx.get(url + "/metrics").text
            assert "responses_gateway_upstream_ready 1.0" in metrics

            fake.health = "hang"  # accepts, never answers: the probe's own timeout decides
            r = httpx.get(url + "/readyz")
            assert r.status_code == 503 and "did not answer" in r.json()["reason"]
            assert "responses_gateway_upstream_ready 0.0" in httpx.get(url + "/metrics").text


def test_readiness_is_cached_between_probes() -> None:
    fake = FakeVllm(health=200)
    with fake_vllm(fake) as (up, _), gateway(up) as (url, app, _server):
        app.state.readiness.cache_ttl = 3600.0
        assert httpx.get(url + "/readyz").status_code == 200
        fake.health = 503
        for _ in range(5):
            assert httpx.get(url + "/readyz").status_code == 200  # cached answer, upstream not asked
        assert fake.health_calls == 1 and app.state.readiness.probes == 1
        app.state.readiness.cache_ttl = 0.0
        assert httpx.get(url + "/readyz").status_code == 503
        assert fake.health_calls == 2


def test_readyz_turns_503_draining_once_shutdown_began_and_new_requests_are_refused() -> None:
    with fake_vllm() as (up, _), gateway(up) as (url, app, _server):
        assert httpx.get(url + "/readyz").status_code == 200
        app.state.drain.begin()
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503 and r.json() == {"status": "unavailable", "reason": "draining"}
        assert httpx.get(url + "/healthz").status_code == 200  # still alive: do not restart it mid-drain
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "gateway_shutting_down"


def test_probes_and_metrics_need_no_key_when_gateway_auth_is_on_but_vllms_metrics_do() -> None:
    with fake_vllm() as (up, _), gateway(up, api_keys=("k1",)) as (url, _app, _server):
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.get(url + "/upstream/metrics").status_code == 401  # vLLM's, fetched with the upstream key
        r = httpx.get(url + "/upstream/metrics", headers={"authorization": "Bearer k1"})
        assert r.status_code == 200 and "vllm:num_requests_running" in r.text
