"""The pass-through proxy's allow-list and cookies, and /upstream/metrics, on a real gateway and a recording
fake vLLM (both uvicorn on loopback). Paths the allow-list must refuse are sent raw, byte for byte: an HTTP
client would normalize the dot segments and encodings they are made of."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.config import DEFAULT_PROXY_PATHS, Settings
from tests.support import running_gateway, serve_in_thread

VLLM_ADMIN = ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/is_sleeping", "/start_profile",
              "/scale_elastic_ep", "/server_info", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/ping")


@dataclass
class RecordingVllm:
    """Answers every path and method, with a cookie; records what reached it."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    metrics_calls: int = 0
    metrics_delay: float = 0.0
    json_delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        async def metrics(request: Request) -> Response:
            with self.lock:
                self.metrics_calls += 1
                self.seen.append({"path": "/metrics", "headers": dict(request.headers)})
            await asyncio.sleep(self.metrics_delay)
            return PlainTextResponse(f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running "
                                     f"{self.metrics_calls}.0\n")

        async def anything(request: Request) -> Response:
            body = await request.body()
            with self.lock:
                self.seen.append({"method": request.method, "path": request.scope["raw_path"].decode(),
                                  "query": dict(request.query_params), "headers": dict(request.headers), "body": body})
            if request.url.path == "/v1/responses":
                await asyncio.sleep(self.json_delay)
            return Response(orjson.dumps({"path": request.url.path, "body": body.decode()}),
                            media_type="application/json", headers={"set-cookie": "vllm_session=s3cr3t; Path=/"})

        return Starlette(routes=[Route("/metrics", metrics),
                                 Route("/{path:path}", anything, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])

    def paths(self) -> list[str]:
        return [s["path"] for s in self.seen]


@contextlib.contextmanager
def vllm_and_gateway(fake: RecordingVllm, **overrides: Any) -> Iterator[str]:
    with serve_in_thread(fake.app()) as (up, _server):
        settings = Settings(upstream_url=up, store="none", tool_choice_enforcement="off")
        with running_gateway(settings, **overrides) as url:
            yield url


def raw_request(url: str, method: str, target: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request with ``target`` exactly as given on the request line; (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}:{port}", "connection: close", "content-length: 0",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return int(head.split(b" ")[1]), body


def test_only_the_allow_listed_paths_reach_vllm_the_rest_is_a_404_in_openais_shape() -> None:
    fake = RecordingVllm()
    with vllm_and_gateway(fake) as url:
        refused = [*VLLM_ADMIN, "/v1/models/", "/v1//models", "//v1/models", "/v1/./models", "/v1/x/../models",
                   "/v1/../sleep", "/v1/models/../../sleep", "/v1/%6dodels", "/v1/models%2F..%2F..%2Fsleep",
                   "/%2e%2e/sleep", "/V1/MODELS", "/v1/models;x", "/v1/chat/completions/"]
        for target in refused:
            for method in ("GET", "POST"):
                status, body = raw_request(url, method, target)
                assert status == 404, (method, target, status)
                error = orjson.loads(body)["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert fake.seen == []

        r = httpx.get(url + "/v1/models", params={"a": "1"})
        assert r.status_code == 200 and r.json()["path"] == "/v1/models"
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 200 and r.json() == {"path": "/v1/embeddings", "body": '{"input":"hi"}'}
        assert raw_request(url, "GET", "/tokenize?x=%2e%2e")[0] == 200  # the query is not the path
    assert fake.paths() == ["/v1/models", "/v1/embeddings", "/tokenize"]
    assert fake.seen[0]["query"] == {"a": "1"} and fake.seen[2]["query"] == {"x": ".."}


def test_the_allow_list_is_the_flag_and_defaults_to_vllms_public_inference_endpoints() -> None:
    assert "/v1/models" in DEFAULT_PROXY_PATHS and not set(VLLM_ADMIN) & set(DEFAULT_PROXY_PATHS)
    fake = RecordingVllm()
    with vllm_and_gateway(fake, proxy_paths=("/v1/models",)) as url:
        assert httpx.post(url + "/v1/embeddings", json={"input": "hi"}).status_code == 404
        assert httpx.get(url + "/v1/models").status_code == 200
    assert fake.paths() == ["/v1/models"]


def test_cookies_are_not_forwarded_either_way() -> None:
    fake = RecordingVllm()
    with vllm_and_gateway(fake) as url:
        r = httpx.get(url + "/v1/models", headers={"cookie": "gateway_session=tenant-a", "x-custom": "kept"})
        assert r.status_code == 200 and "set-cookie" not in r.headers
        r = httpx.post(url + "/v1/embeddings", json={"input": "x"}, headers={"cookie": "b=2"})
        assert r.status_code == 200 and "set-cookie" not in r.headers
    assert len(fake.seen) == 2
    assert all("cookie" not in s["headers"] for s in fake.seen)
    assert fake.seen[0]["headers"]["x-custom"] == "kept"


def _count(metrics_text: str, route: str, status: str) -> float:
    prefix = f'responses_gateway_requests_total{{route="{route}",status="{status}",stream="false"}} '
    return sum(float(line.removeprefix(prefix)) for line in metrics_text.splitlines() if line.startswith(prefix))


def test_upstream_metrics_need_a_gateway_key_send_the_upstream_key_and_are_fetched_once_a_second() -> None:
    fake = RecordingVllm(metrics_delay=0.2)  # slow enough that concurrent scrapers overlap
    with vllm_and_gateway(fake, api_keys=("k1",), upstream_api_key="up-key") as url:
        assert httpx.get(url + "/upstream/metrics").status_code == 401
        assert httpx.get(url + "/upstream/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert fake.metrics_calls == 0
        key = {"authorization": "Bearer k1"}
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: httpx.get(url + "/upstream/metrics", headers=key, timeout=10),
                                    range(16)))
        assert {r.status_code for r in answers} == {200}
        assert {r.text for r in answers} == {"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"}
        assert answers[0].headers["content-type"].startswith("text/plain")
        assert fake.metrics_calls == 1  # 16 scrapers, one upstream scrape
        time.sleep(1.1)
        assert "vllm:num_requests_running 2.0" in httpx.get(url + "/upstream/metrics", headers=key).text
        assert fake.metrics_calls == 2
        assert all(s["headers"]["authorization"] == "Bearer up-key" for s in fake.seen)
        own = httpx.get(url + "/metrics").text
        assert _count(own, "/upstream/metrics", "200") == 17  # each scrape is a request, cached or not


def test_upstream_metrics_take_a_concurrency_slot() -> None:
    fake = RecordingVllm(json_delay=1.5)
    with vllm_and_gateway(fake, max_concurrency=1) as url, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, url + "/v1/responses", json={"model": "tiny", "input": "hi"}, timeout=10)
        deadline = time.monotonic() + 5
        while not any(s.get("path") == "/v1/responses" for s in fake.seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.get(url + "/upstream/metrics")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        busy.result()
        assert fake.metrics_calls == 0


def test_expect_100_continue_through_the_proxy_each_request_gets_its_own_answer() -> None:
    """The issue's case: a client's ``Expect: 100-continue`` went on to a uvicorn upstream, whose ``100`` was taken
    for the answer; the next request on that pooled connection got the first one's answer."""
    fake = RecordingVllm()
    with vllm_and_gateway(fake) as url, httpx.Client(timeout=10) as http:
        for n in range(4):
            body = orjson.dumps({"input": f"request {n}"})
            r = http.post(url + "/v1/embeddings", content=body,
                          headers={"expect": "100-continue", "content-type": "application/json"})
            assert r.status_code == 200 and r.json() == {"path": "/v1/embeddings", "body": body.decode()}
    assert len(fake.seen) == 4 and all("expect" not in s["headers"] for s in fake.seen)
