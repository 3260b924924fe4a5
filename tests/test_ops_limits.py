"""Each limit hit for real: body size, concurrency, stream idle timeout, upstream timeouts, TCP_NODELAY."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.ops_support import FakeVllm, fake_vllm, gateway, wait_for
from tests.support import sse_events

BODY = {"model": "tiny", "input": "hi"}
STREAM = {"model": "tiny", "input": "hi", "stream": True}


def chunked(total: int, piece: int = 1000) -> Iterator[bytes]:
    """A JSON body sent with Transfer-Encoding: chunked (no Content-Length to check up front)."""
    head = b'{"model":"tiny","input":"'
    tail = b'"}'
    filler = total - len(head) - len(tail)
    yield head
    while filler > 0:
        yield b"x" * min(piece, filler)
        filler -= piece
    yield tail


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/models"])
def test_bodies_over_the_limit_get_413_with_or_without_content_length(path: str) -> None:
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _), gateway(up, max_body_bytes=4096) as (url, _app, _server):
        declared = httpx.post(url + path, content=b"x" * 5000, headers={"content-type": "application/json"})
        streamed = httpx.post(url + path, content=chunked(6000), headers={"content-type": "application/json"})
        fits = httpx.post(url + path, content=chunked(3000), headers={"content-type": "application/json"})
        text = httpx.get(url + "/metrics").text
    for r in (declared, streamed):
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "transfer-encoding" in streamed.request.headers and "content-length" not in streamed.request.headers
    assert fits.status_code == 200
    assert 'responses_gateway_rejected_requests_total{reason="body_too_large"} 2.0' in text


def test_concurrency_limit_answers_429_with_retry_after_while_streams_are_open() -> None:
    fake = FakeVllm(stall_after=3, stall_for=30)  # streams stay open until the client leaves
    with fake_vllm(fake) as (up, _), gateway(up, max_concurrency=2) as (url, app, _server):
        with httpx.Client(timeout=10) as c1, httpx.Client(timeout=10) as c2:
            with c1.stream("POST", url + "/v1/responses", json=STREAM) as s1, \
                    c2.stream("POST", url + "/v1/responses", json=STREAM) as s2:
                it1, it2 = s1.iter_raw(), s2.iter_raw()
                next(it1), next(it2)  # both streams are running
                refused = httpx.post(url + "/v1/responses", json=BODY)
                proxied = httpx.get(url + "/v1/models")
                assert httpx.get(url + "/readyz").status_code == 200  # probes never count
                assert app.state.limiter.active == 2
        # both clients left: their slots come back once the gateway notices
        wait_for(lambda: app.state.limiter.active == 0, what="slots to be released")
        after = httpx.post(url + "/v1/responses", json=BODY)
    for r in (refused, proxied):
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "rate_limit_error",
                                     "param": None, "code": "rate_limit_exceeded"}
    assert after.status_code == 200


def test_stream_idle_timeout_ends_the_stream_with_response_failed_end_to_end() -> None:
    fake = FakeVllm(stall_after=6, stall_for=30)  # vLLM goes silent mid-answer
    with fake_vllm(fake) as (up, _), gateway(up, stream_idle_timeout=0.5) as (url, _app, _server):
        r = httpx.post(url + "/v1/responses", json=STREAM, timeout=10)
        text = httpx.get(url + "/metrics").text
    events = sse_events(r.content)
    assert r.status_code == 200
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "stream_idle_timeout"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert any(e["type"] == "response.output_text.delta" for e in events)  # what came before was relayed
    assert 'responses_gateway_upstream_errors_total{kind="idle_timeout"} 1.0' in text


def test_upstream_read_timeout_is_504_and_a_refused_connection_is_502() -> None:
    fake = FakeVllm(json_delay=30)
    with fake_vllm(fake) as (up, _), gateway(up, read_timeout=0.3) as (url, _app, _server):
        slow = httpx.post(url + "/v1/responses", json=BODY, timeout=10)
    assert slow.status_code == 504
    assert slow.json()["error"]["code"] == "upstream_timeout" and slow.json()["error"]["type"] == "server_error"
    from tests.support import free_port

    with gateway(f"http://127.0.0.1:{free_port()}") as (url, _app, _server):
        refused = httpx.post(url + "/v1/responses", json=STREAM)
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_unavailable"


class ConnectTimeoutTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)


def test_upstream_connect_timeout_is_504() -> None:
    # A real connect timeout needs an address that drops SYNs, which a test machine cannot rely on.
    with gateway(transport=ConnectTimeoutTransport()) as (url, _app, _server):
        r = httpx.post(url + "/v1/responses", json=BODY)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


def test_streamed_responses_go_out_on_a_tcp_nodelay_socket() -> None:
    fake = FakeVllm(stall_after=3, stall_for=30)
    with fake_vllm(fake) as (up, _), gateway(up) as (url, _app, server):
        with httpx.stream("POST", url + "/v1/responses", json=STREAM) as r:
            chunks = r.iter_raw()
            next(chunks)
            # the accepted connection carrying this stream, as uvicorn holds it
            socks = [conn.transport.get_extra_info("socket") for conn in server.server_state.connections]
            flags = [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks]
    assert flags and all(flags)
