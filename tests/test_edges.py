"""Issue 16's edges, each hit for real (uvicorn on loopback, real sockets): WebSocket slots and the connection cap,
a stalled body, the Host/Origin rules (the WebSocket handshake too), metric cardinality, the per-key background
bound, the start-up warnings."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus

from gateway.cli import startup_warnings
from gateway.config import Settings
from gateway.engine.record import RequestRecord
from gateway.server.guard import HostRule, origin_allowed
from gateway.server.metrics import GatewayMetrics
from gateway.store import SqliteResponseStore
from tests.ops_support import FakeVllm, fake_vllm, gateway, wait_for
from tests.support import running_gateway, serve_in_thread
from tests.test_background import Paced
from tests.test_websocket import gateway_with, read_response, say, ws

BODY = {"model": "tiny", "input": "hi"}
STREAM = {"model": "tiny", "input": "hi", "stream": True}
CREATE = json.dumps({"type": "response.create", "model": "tiny", "input": "hi"})


def series(text: str, family: str) -> list[dict[str, str]]:
    """The label sets of one metric family's samples in a /metrics scrape."""
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            return [s.labels for s in fam.samples if s.name.endswith("_total")]
    return []


# --- WebSocket: concurrency slots and the connection cap ----------------------------------------------------------


def test_websocket_response_create_takes_a_concurrency_slot_for_its_whole_response() -> None:
    fake = FakeVllm(stall_after=3, stall_for=30)  # the stream stays open until the gateway lets go
    with fake_vllm(fake) as (up, _), gateway(up, max_concurrency=1) as (url, app, _server):
        with ws(url) as busy, ws(url) as other:
            busy.send(CREATE)
            first = json.loads(busy.recv(10))  # its response is running, holding the only slot
            wait_for(lambda: app.state.limiter.active == 1, what="the WebSocket response to hold the slot")
            http = httpx.post(url + "/v1/responses", json=BODY, timeout=10)
            other.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi", "stream_id": "s2"}))
            refused = json.loads(other.recv(10))
        # the client left mid-response: its slot comes back
        wait_for(lambda: app.state.limiter.active == 0, what="the WebSocket slot to be released")
        after = httpx.post(url + "/v1/responses", json=BODY, timeout=10)
        text = httpx.get(url + "/metrics").text
    assert first["type"] == "response.created"
    assert http.status_code == 429 and http.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused["type"] == "error" and refused["status"] == 429 and refused["stream_id"] == "s2"
    assert refused["error"]["type"] == "rate_limit_error" and refused["error"]["code"] == "rate_limit_exceeded"
    assert after.status_code == 200
    assert len(fake.requests) == 2  # the refused create never reached the upstream (the busy one and `after` did)
    assert 'responses_gateway_rejected_requests_total{reason="concurrency"} 2.0' in text


def test_websocket_slot_is_released_when_the_response_ends_and_the_connection_stays_usable() -> None:
    with gateway_with(say("ok"), max_concurrency=1) as (url, _up), ws(url) as conn:
        for _ in range(3):  # one slot, three responses in turn on one connection: each released its slot
            conn.send(CREATE)
            assert read_response(conn)[-1]["type"] == "response.completed"
        assert httpx.post(url + "/v1/responses", json=STREAM, timeout=10).status_code == 200


def test_open_websocket_connections_are_capped_with_a_503_handshake() -> None:
    with gateway_with(say("ok"), max_websocket_connections=2) as (url, _up):
        with ws(url) as a, ws(url) as b:
            with pytest.raises(InvalidStatus) as refused:
                ws(url)
            a.send(CREATE)  # the open ones work
            assert read_response(a)[-1]["type"] == "response.completed"
            b.close()
            # a slot freed by a close is usable again
            deadline = time.monotonic() + 10
            while True:
                try:
                    third = ws(url)
                    break
                except InvalidStatus:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            with third:
                third.send(CREATE)
                assert read_response(third)[-1]["type"] == "response.completed"
        text = httpx.get(url + "/metrics").text
    response = refused.value.response
    assert response.status_code == 503
    error = json.loads(response.body)["error"]
    assert error["code"] == "too_many_websocket_connections" and error["type"] == "server_error"
    assert 'responses_gateway_rejected_requests_total{reason="websocket_connections"} 1.0' in text


# --- bodies: read before the slot, within --body-read-timeout ----------------------------------------------------


def _stalled(url: str, path: str = "/v1/responses") -> socket.socket:
    """A real connection that sends the headers of a 100-byte body, then one byte of it, then nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n{{".encode())
    return sock


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/conversations", "/v1/models"])
def test_a_stalled_body_holds_no_slot_and_gets_408(path: str) -> None:
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _), gateway(up, max_concurrency=1, body_read_timeout=1.5) as (url, app, _server):
        stalled = [_stalled(url, path), _stalled(url, path)]
        try:
            time.sleep(0.3)  # both are in the gateway, waiting on their bodies
            started = time.monotonic()
            served = [httpx.post(url + "/v1/responses", json=BODY, timeout=10) for _ in range(3)]
            # The stalled ones hold none: the count drops to 0 once the last served answer's bookkeeping ran
            # (a slot is released just after the last byte is sent, so the client may see it a moment earlier).
            deadline = time.monotonic() + 1.0
            while app.state.limiter.active and time.monotonic() < deadline:
                time.sleep(0.01)
            assert app.state.limiter.active == 0
            answers = [_read_all(s, 10) for s in stalled]
            waited = time.monotonic() - started
        finally:
            for s in stalled:
                s.close()
        text = httpx.get(url + "/metrics").text
    assert [r.status_code for r in served] == [200, 200, 200]
    assert waited < 8  # the timeout ended them, not the test's reads
    for raw in answers:
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), raw[:200]
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert 'responses_gateway_rejected_requests_total{reason="body_timeout"} 2.0' in text
    assert len(fake.requests) == 3  # only the served ones reached the upstream


def test_a_slow_body_that_arrives_in_time_is_served() -> None:
    def trickle() -> Any:
        for part in (b'{"model":', b'"tiny",', b'"input":"hi"}'):
            time.sleep(0.2)
            yield part

    fake = FakeVllm()
    with fake_vllm(fake) as (up, _), gateway(up, body_read_timeout=5) as (url, _app, _server):
        r = httpx.post(url + "/v1/responses", content=trickle(), headers={"content-type": "application/json"},
                       timeout=10)
    assert r.status_code == 200 and r.json()["object"] == "response"


# --- Host and Origin ---------------------------------------------------------------------------------------------


def test_host_rule_matching() -> None:
    rule = HostRule(["gateway.example:8443", "API.example", "::1", "[fe80::1]:9000"])
    assert rule.allows("gateway.example:8443") and rule.allows("GATEWAY.EXAMPLE:8443")
    assert not rule.allows("gateway.example:9999") and not rule.allows("gateway.example")
    assert rule.allows("api.example") and rule.allows("api.example:1234")
    assert rule.allows("[::1]:8080") and rule.allows("[::1]")
    assert rule.allows("[fe80::1]:9000") and not rule.allows("[fe80::1]:9001")
    assert not rule.allows("evil.example") and not rule.allows(None) and not rule.allows("")
    assert not rule.allows("api.example.evil.example")
    assert HostRule(["*"]).allows(None) and HostRule(["*"]).allows("anything")
    assert origin_allowed("http://App.example:3000", ["http://app.example:3000/"])
    assert not origin_allowed("http://app.example:3001", ["http://app.example:3000"])
    assert origin_allowed("null", ["*"]) and not origin_allowed("null", [])


def test_a_keyless_loopback_gateway_answers_only_loopback_hosts_but_probes_answer_any() -> None:
    # The default rule of a developer's gateway: DNS rebinding (Host: evil.example) reads nothing.
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _), gateway(up) as (url, _app, _server):
        port = url.rsplit(":", 1)[1]
        evil = {"host": f"evil.example:{port}"}
        rebound = httpx.post(url + "/v1/responses", json=BODY, headers=evil)
        rebound_get = httpx.get(url + "/v1/responses/resp_x", headers=evil)
        proxied = httpx.get(url + "/v1/models", headers=evil)
        ok = [httpx.post(url + "/v1/responses", json=BODY, headers={"host": h})
              for h in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST")]
        probes = [httpx.get(url + p, headers=evil).status_code for p in ("/healthz", "/readyz", "/metrics")]
        text = httpx.get(url + "/metrics").text
    for r in (rebound, rebound_get, proxied):
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "host_not_allowed" and r.json()["error"]["type"] == "permission_error"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert [r.status_code for r in ok] == [200, 200, 200, 200]
    assert probes == [200, 200, 200]
    assert len(fake.requests) == 4  # no refused request reached the upstream
    assert 'responses_gateway_rejected_requests_total{reason="host"} 3.0' in text


def test_with_keys_or_a_network_bind_any_host_is_answered_and_a_listed_one_is_enforced() -> None:
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _):
        with gateway(up, api_keys=("k1",)) as (url, _app, _server):
            keyed = httpx.post(url + "/v1/responses", json=BODY,
                               headers={"host": "gateway.internal", "authorization": "Bearer k1"})
        with gateway(up, host="0.0.0.0") as (url, _app, _server):  # listening on loopback here; the rule is a bind's
            networked = httpx.post(url + "/v1/responses", json=BODY, headers={"host": "10.0.0.7:8080"})
        with gateway(up, host="0.0.0.0", allowed_hosts=("gateway.example",)) as (url, _app, _server):
            listed = httpx.post(url + "/v1/responses", json=BODY, headers={"host": "gateway.example:8080"})
            unlisted = httpx.post(url + "/v1/responses", json=BODY, headers={"host": "10.0.0.7:8080"})
            probe = httpx.get(url + "/readyz", headers={"host": "10.0.0.7:8080"})
    assert keyed.status_code == 200 and networked.status_code == 200 and listed.status_code == 200
    assert unlisted.status_code == 403 and unlisted.json()["error"]["code"] == "host_not_allowed"
    assert probe.status_code == 200


def test_a_foreign_origin_is_refused_and_a_listed_or_absent_one_passes() -> None:
    fake = FakeVllm()
    evil = {"origin": "http://evil.example"}
    with fake_vllm(fake) as (up, _):
        with gateway(up) as (url, _app, _server):
            # the browser's "simple" cross-origin POST (text/plain: no preflight)
            simple = httpx.post(url + "/v1/responses", content=json.dumps(BODY),
                                headers={**evil, "content-type": "text/plain"})
            listing = httpx.get(url + "/v1/models", headers=evil)
            sdk = httpx.post(url + "/v1/responses", json=BODY)  # no Origin: SDKs, curl
        with gateway(up, allowed_origins=("http://app.example:3000",)) as (url, _app, _server):
            listed = httpx.post(url + "/v1/responses", json=BODY, headers={"origin": "http://app.example:3000"})
            other = httpx.post(url + "/v1/responses", json=BODY, headers=evil)
        with gateway(up, allowed_origins=("*",)) as (url, _app, _server):
            anyone = httpx.post(url + "/v1/responses", json=BODY, headers=evil)
    for r in (simple, listing, other):
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "origin_not_allowed" and r.json()["error"]["type"] == "permission_error"
    assert sdk.status_code == 200 and listed.status_code == 200 and anyone.status_code == 200
    assert len(fake.requests) == 3


def test_websocket_handshakes_with_a_foreign_origin_or_host_get_403() -> None:
    with gateway_with(say("ok"), allowed_origins=("http://app.example",)) as (url, upstream):
        with pytest.raises(InvalidStatus) as bad_origin:
            ws(url, origin="http://evil.example")
        with pytest.raises(InvalidStatus) as bad_host:
            ws(url, additional_headers={"Host": "evil.example"})
        with ws(url, origin="http://app.example") as conn:  # listed
            conn.send(CREATE)
            listed = read_response(conn)
        with ws(url) as conn:  # no Origin (Codex, the SDKs)
            conn.send(CREATE)
            plain = read_response(conn)
    for refused, code in ((bad_origin, "origin_not_allowed"), (bad_host, "host_not_allowed")):
        assert refused.value.response.status_code == 403
        assert json.loads(refused.value.response.body)["error"]["code"] == code
    assert listed[-1]["type"] == "response.completed" and plain[-1]["type"] == "response.completed"
    assert len(upstream.requests) == 2


# --- metric labels ------------------------------------------------------------------------------------------------


def test_unknown_websocket_message_types_do_not_mint_series() -> None:
    with gateway_with(say("ok")) as (url, _up):
        with ws(url) as conn:
            for i in range(300):
                conn.send(json.dumps({"type": f"made.up.{i}"}))
                assert json.loads(conn.recv(10))["error"]["code"] == "unknown_message_type"
            conn.send("[1]")  # JSON, but no type
            conn.recv(10)
            conn.send(CREATE)
            read_response(conn)
        text = httpx.get(url + "/metrics").text
    labels = series(text, "responses_gateway_websocket_messages")
    assert sorted(s["type"] for s in labels) == ["invalid", "other", "response.create"]
    assert 'responses_gateway_websocket_messages_total{type="other"} 300.0' in text


def test_observed_labels_outside_the_known_sets_become_other() -> None:
    m = GatewayMetrics()
    for i in range(50):
        m.observe(RequestRecord(request_id="r", route="/v1/responses", status=502, upstream_error=f"http_{1000 + i}",
                                tool_calls={f"kind{i}": 1, "function": 1}, enforcement=[f"x{i}", "pinned"]))
    m.reject("made-up")
    text = m.render().decode()
    assert {s["kind"] for s in series(text, "responses_gateway_upstream_errors")} == {"other"}
    assert {s["kind"] for s in series(text, "responses_gateway_tool_calls")} == {"other", "function"}
    assert {s["outcome"] for s in series(text, "responses_gateway_tool_choice_enforcement")} == {"other", "pinned"}
    assert {s["reason"] for s in series(text, "responses_gateway_rejected_requests")} == {"other"}
    m.observe(RequestRecord(request_id="r", route="/v1/responses", status=502, upstream_error="http_503"))
    assert 'responses_gateway_upstream_errors_total{kind="http_503"} 1.0' in m.render().decode()


# --- background: per key ------------------------------------------------------------------------------------------


def _background(url: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/responses", json={**BODY, "background": True}, headers=headers, timeout=10)


def test_one_key_cannot_take_every_background_slot(tmp_path: Any) -> None:
    fake = Paced(hold_after=2)  # runs stay in progress until released
    with serve_in_thread(fake.app()) as (up, _server):
        try:
            with running_gateway(upstream_url=up, store=SqliteResponseStore(tmp_path / "bg.db"), api_keys=("ka", "kb"),
                                 max_background_responses=8, max_background_per_key=2) as url:
                a = [_background(url, "ka") for _ in range(3)]
                b = [_background(url, "kb") for _ in range(2)]
                text = httpx.get(url + "/metrics").text
        finally:
            fake.stopping = True
            fake.release.set()
    assert [r.status_code for r in a] == [200, 200, 429]
    assert a[2].json()["error"]["type"] == "rate_limit_error" and "API key" in a[2].json()["error"]["message"]
    assert a[2].headers["retry-after"] == "1"
    assert [r.status_code for r in b] == [200, 200]  # the other key is not affected
    assert 'responses_gateway_rejected_requests_total{reason="background_per_key"} 1.0' in text


def test_without_keys_there_is_no_per_key_bound(tmp_path: Any) -> None:
    fake = Paced(hold_after=2)
    with serve_in_thread(fake.app()) as (up, _server):
        try:
            with running_gateway(upstream_url=up, store=SqliteResponseStore(tmp_path / "bg.db"),
                                 max_background_responses=3, max_background_per_key=1) as url:
                runs = [_background(url, None) for _ in range(4)]
        finally:
            fake.stopping = True
            fake.release.set()
    assert [r.status_code for r in runs] == [200, 200, 200, 429]  # only the replica's bound applies
    assert "API key" not in runs[3].json()["error"]["message"]


# --- start-up warnings --------------------------------------------------------------------------------------------


def test_a_keyless_gateway_on_the_network_warns_at_start_up() -> None:
    events = [e for e, _ in startup_warnings(Settings(host="0.0.0.0"))]
    assert events == ["keyless_gateway_on_network"]
    assert startup_warnings(Settings(host="0.0.0.0", api_keys=("k",))) == []
    assert startup_warnings(Settings(host="127.0.0.1")) == []
    assert [e for e, _ in startup_warnings(Settings(allowed_hosts=("*",)))] == ["any_host_on_loopback"]
    assert [e for e, _ in startup_warnings(Settings(host="::1", allowed_origins=("*",)))] == ["any_origin"]
