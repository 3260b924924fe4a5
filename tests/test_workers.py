"""``--workers 2``: real processes (``python -m gateway serve``) on one port, sharing metrics, limits, background
runs and key material.

Which worker serves a connection is the kernel's choice (SO_REUSEPORT), so a test that needs a given worker
opens keep-alive connections until one lands there: each connection's first request is a 404 whose access line
(every log line carries its ``pid``) says which worker answered it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.ops_support import wait_for
from tests.support import ROOT, free_port, serve_in_thread, sse_events
from tests.vllm_frames import VllmStream

THOUGHT = "SECRET-THOUGHT: the user wants a patch for utils.py"
DELTAS = 40


@dataclass
class Upstream:
    """A fake vLLM on loopback: a reasoning item and a message of ``DELTAS`` deltas, ``delay`` seconds apart."""

    delay: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            s = VllmStream().start().reasoning("rs_00000000000000f1", [THOUGHT[:15], THOUGHT[15:]])
            s.message("msg_00000000000000f2", [f"w{n} " for n in range(DELTAS)]).complete()
            if not body.get("stream"):
                return Response(s.nonstream_body(), media_type="application/json")
            frames = [part + b"\n\n" for part in s.body().split(b"\n\n") if part.strip()]

            async def gen() -> AsyncIterator[bytes]:
                for n, frame in enumerate(frames):
                    if n > 2 and self.delay:
                        await asyncio.sleep(self.delay)
                    yield frame

            return StreamingResponse(gen(), media_type="text/event-stream")

        async def health(request: Request) -> Response:
            return Response(status_code=200)

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]), Route("/health", health)])


@contextmanager
def upstream(delay: float = 0.0) -> Iterator[tuple[str, Upstream]]:
    fake = Upstream(delay=delay)
    with serve_in_thread(fake.app()) as (url, _server):
        yield url, fake


class Gateway:
    """``python -m gateway serve --workers N``; its JSON log lines go to a file the test reads."""

    def __init__(self, upstream_url: str, folder: Path, workers: int = 2, port: int | None = None,
                 **env: str) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"gateway-{self.port}-{uuid.uuid4().hex[:6]}.log"
        full_env = {**os.environ, "GATEWAY_UPSTREAM_URL": upstream_url, "GATEWAY_PORT": str(self.port),
                    "GATEWAY_HOST": "127.0.0.1", "GATEWAY_WORKERS": str(workers),
                    "GATEWAY_STORE": f"sqlite:///{folder / 'responses.db'}", **env}
        full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], cwd=ROOT, env=full_env,
                                         stdout=subprocess.DEVNULL, stderr=out)
        self.clients: list[httpx.Client] = []
        self.workers = workers

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.log.read_text().splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        return out

    def worker_pids(self) -> set[int]:
        return {line["pid"] for line in self.lines() if line.get("event") == "Application startup complete."}

    def wait_ready(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(self.log.read_text())
            return len(self.worker_pids()) == self.workers

        wait_for(up, timeout=40, what="every worker to start")

    def pid_of(self, request_id: str) -> int:
        """The pid of the worker that answered ``request_id`` (its access line, written once it ended)."""
        found: list[int] = []

        def logged() -> bool:
            found[:] = [line["pid"] for line in self.lines()
                        if line.get("event") == "request" and line.get("request_id") == request_id]
            return bool(found)

        wait_for(logged, timeout=20, what=f"the access line of {request_id}")
        return found[0]

    def client_on(self, pid: int) -> httpx.Client:
        """A keep-alive client whose connection a worker ``pid`` accepted."""
        for _ in range(60):
            client = httpx.Client(base_url=self.url, timeout=60, limits=httpx.Limits(max_connections=1))
            rid = "probe-" + uuid.uuid4().hex
            assert client.get("/v1/responses/resp_probe", headers={"x-request-id": rid}).status_code == 404
            if self.pid_of(rid) == pid:
                self.clients.append(client)
                return client
            client.close()
        raise AssertionError(f"no connection landed on worker {pid}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def gateway(upstream_url: str, folder: Path, **kwargs: Any) -> Iterator[Gateway]:
    gw = Gateway(upstream_url, folder, **kwargs)
    try:
        gw.wait_ready()
        yield gw
    finally:
        gw.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        series, _, rest = key.partition("{")
        if series != name:
            continue
        got = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part) if rest else {}
        if {k: v.strip('"') for k, v in got.items()} == labels:
            return float(value)
    return 0.0


REQUEST = {"model": "tiny", "input": "hi"}


def test_requests_spread_over_both_workers_and_metrics_sum_them(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    with upstream() as (up_url, _up), gateway(up_url, tmp_path, TMPDIR=str(scratch)) as gw:
        pids = gw.worker_pids()
        assert gw.proc.pid not in pids  # the parent serves nothing
        # The parent's folder for the metrics files and the shared limits: private.
        (private,) = scratch.iterdir()
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert {p.name for p in private.iterdir()} == {"metrics", "limits"}
        ids = []
        for n in range(16):  # a new connection each: the kernel picks the worker
            rid = f"spread-{n}"
            r = httpx.post(gw.url + "/v1/responses", json=REQUEST, headers={"x-request-id": rid}, timeout=30)
            assert r.status_code == 200, r.text
            ids.append(rid)
        served = [gw.pid_of(rid) for rid in ids]
        assert set(served) == pids, served
        # Any worker's /metrics counts every worker's requests.
        for _ in range(4):
            text = httpx.get(gw.url + "/metrics", timeout=10).text
            assert metric(text, "responses_gateway_requests_total", route="/v1/responses", status="200",
                          stream="false") == 16
            assert metric(text, "responses_gateway_in_flight_requests") == 0
            assert 'pid="' not in text  # summed, not one series per worker
        assert gw.stop() == 0
    assert list(scratch.iterdir()) == []  # removed by the parent on its way out


def test_background_run_is_resumed_and_cancelled_through_the_other_worker(tmp_path: Path) -> None:
    with upstream(delay=0.1) as (up_url, _up), gateway(up_url, tmp_path) as gw:
        a, b = sorted(gw.worker_pids())
        on_a, on_b = gw.client_on(a), gw.client_on(b)
        # Resumed on B while A runs it: every event, in order, to the terminal one.
        created = on_a.post("/v1/responses", json={**REQUEST, "background": True},
                            headers={"x-request-id": "bg-create-1"})
        assert created.status_code == 200 and created.json()["status"] == "queued"
        rid = created.json()["id"]
        resumed = on_b.get(f"/v1/responses/{rid}", params={"stream": "true"}, headers={"x-request-id": "bg-follow"})
        assert resumed.status_code == 200
        events = sse_events(resumed.content)
        assert events[-1]["type"] == "response.completed"
        seqs = [e["sequence_number"] for e in events]
        assert seqs == list(range(len(seqs)))
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
            "".join(f"w{n} " for n in range(DELTAS))
        assert (gw.pid_of("bg-create-1"), gw.pid_of("bg-follow")) == (a, b)
        # Resumed from a cursor, on B again: the rest only.
        tail = on_b.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": str(seqs[-3])})
        assert [e["sequence_number"] for e in sse_events(tail.content)] == seqs[-2:]

        # Cancelled on B while A runs it: A stops it (its upstream request closed) and the row says cancelled.
        on_a, on_b = gw.client_on(a), gw.client_on(b)
        created = on_a.post("/v1/responses", json={**REQUEST, "background": True},
                            headers={"x-request-id": "bg-create-2"})
        rid = created.json()["id"]
        wait_for(lambda: on_b.get(f"/v1/responses/{rid}").json()["status"] == "in_progress", timeout=20,
                 what="the run to start")
        cancelled = on_b.post(f"/v1/responses/{rid}/cancel", headers={"x-request-id": "bg-cancel"})
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert (gw.pid_of("bg-create-2"), gw.pid_of("bg-cancel")) == (a, b)
        ended = [line for line in gw.lines() if line.get("event") == "background_ended"
                 and line.get("response_id") == rid]
        wait_for(lambda: any(line.get("event") == "background_ended" and line.get("response_id") == rid
                             for line in gw.lines()), timeout=20, what="worker A to stop the run")
        ended = [line for line in gw.lines() if line.get("event") == "background_ended"
                 and line.get("response_id") == rid]
        assert ended[0]["pid"] == a and ended[0]["stop"] == "cancel"
        stream = on_b.get(f"/v1/responses/{rid}", params={"stream": "true"})
        events = sse_events(stream.content)
        assert events and events[-1]["type"] != "response.completed"  # it ended where the cancel stopped it
        assert on_a.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        assert gw.stop() == 0


def test_the_concurrency_limit_holds_across_workers(tmp_path: Path) -> None:
    with upstream(delay=0.15) as (up_url, _up), \
            gateway(up_url, tmp_path, GATEWAY_MAX_CONCURRENCY="2") as gw:
        a, b = sorted(gw.worker_pids())
        on_b = gw.client_on(b)
        streams = [StreamReader(gw.client_on(a)) for _ in range(2)]  # both slots, on worker A
        for reader in streams:
            reader.start()
        for reader in streams:
            assert reader.first.wait(20)
        refused = on_b.post("/v1/responses", json=REQUEST, headers={"x-request-id": "over"})
        assert refused.status_code == 429, refused.text  # per worker it would have had a free slot
        assert refused.json()["error"]["code"] == "rate_limit_exceeded" or refused.json()["error"]["type"]
        assert gw.pid_of("over") == b
        text = on_b.get("/metrics").text
        assert metric(text, "responses_gateway_in_flight_requests") == 2
        assert metric(text, "responses_gateway_rejected_requests_total", reason="concurrency") == 1
        for reader in streams:
            reader.join(30)
            assert reader.error is None and b"response.completed" in reader.raw
        # The slots came back: B answers again.
        assert on_b.post("/v1/responses", json=REQUEST).status_code == 200
        assert gw.stop() == 0


def test_background_and_websocket_caps_hold_across_workers(tmp_path: Path) -> None:
    with upstream(delay=0.15) as (up_url, _up), \
            gateway(up_url, tmp_path, GATEWAY_MAX_BACKGROUND_RESPONSES="1",
                    GATEWAY_MAX_WEBSOCKET_CONNECTIONS="1") as gw:
        a, b = sorted(gw.worker_pids())
        on_a = gw.client_on(a)
        created = on_a.post("/v1/responses", json={**REQUEST, "background": True})
        assert created.status_code == 200
        refused = gw.client_on(b).post("/v1/responses", json={**REQUEST, "background": True},
                                       headers={"x-request-id": "bg-over"})
        assert refused.status_code == 429 and gw.pid_of("bg-over") == b
        gw.client_on(b).post(f"/v1/responses/{created.json()['id']}/cancel")
        from websockets.sync.client import connect

        ws_url = gw.url.replace("http://", "ws://") + "/v1/responses"
        with connect(ws_url):
            refusals = 0
            for _ in range(6):  # whichever worker each handshake lands on, the one open connection is the cap
                try:
                    with connect(ws_url):
                        pass
                except Exception as exc:
                    assert "503" in str(exc), exc
                    refusals += 1
            assert refusals == 6
        assert gw.stop() == 0


def test_a_worker_that_dies_is_replaced_and_its_slots_freed(tmp_path: Path) -> None:
    with upstream(delay=0.3) as (up_url, _up), \
            gateway(up_url, tmp_path, GATEWAY_MAX_CONCURRENCY="2") as gw:
        a, b = sorted(gw.worker_pids())
        on_b = gw.client_on(b)
        streams = [StreamReader(gw.client_on(a)) for _ in range(2)]
        for reader in streams:
            reader.start()
        for reader in streams:
            assert reader.first.wait(20)
        assert on_b.post("/v1/responses", json=REQUEST).status_code == 429
        os.kill(a, signal.SIGKILL)  # its two slots die with it, unreleased
        wait_for(lambda: len(gw.worker_pids() - {a}) == 2, timeout=30, what="a replacement worker")
        assert any(line.get("event") == "worker_died" and line.get("worker_pid") == a for line in gw.lines())
        for reader in streams:
            reader.join(10)
        assert httpx.post(gw.url + "/v1/responses", json=REQUEST, timeout=30).status_code == 200
        assert metric(httpx.get(gw.url + "/metrics").text, "responses_gateway_in_flight_requests") == 0
        assert gw.stop() == 0


class StreamReader(threading.Thread):
    """Reads a streamed response through ``client`` in the background; ``first`` is set once bytes arrived."""

    def __init__(self, client: httpx.Client) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.first = threading.Event()
        self.raw = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.client.stream("POST", "/v1/responses", json={**REQUEST, "stream": True}) as r:
                for chunk in r.iter_raw():
                    self.raw += chunk
                    self.first.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first.set()


def test_sigterm_drains_both_workers_and_the_parent_exits_0(tmp_path: Path) -> None:
    with upstream(delay=0.05) as (up_url, _up), gateway(up_url, tmp_path, GATEWAY_DRAIN_TIMEOUT="20") as gw:
        a, b = sorted(gw.worker_pids())
        readers = [StreamReader(gw.client_on(a)), StreamReader(gw.client_on(b))]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.first.wait(20)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(60) == 0
        for reader in readers:  # both streams ran to their end during the drain
            reader.join(10)
            assert reader.error is None
            assert sse_events(reader.raw)[-1]["type"] == "response.completed"
        lines = gw.lines()
        assert {line["pid"] for line in lines if line.get("event") == "draining"} == {a, b}
        assert any(line.get("event") == "stopped" and line["pid"] == gw.proc.pid for line in lines)
        with pytest.raises(httpx.TransportError):
            httpx.get(gw.url + "/healthz", timeout=2)


def test_a_sealed_reasoning_blob_opens_in_the_other_worker_and_after_a_restart(tmp_path: Path) -> None:
    sealed_turn = {**REQUEST, "store": False, "include": ["reasoning.encrypted_content"]}
    with upstream() as (up_url, up):
        port = free_port()
        with gateway(up_url, tmp_path, port=port) as gw:
            a, b = sorted(gw.worker_pids())
            first = gw.client_on(a).post("/v1/responses", json=sealed_turn)
            reasoning = next(i for i in first.json()["output"] if i["type"] == "reasoning")
            assert reasoning["encrypted_content"] and THOUGHT not in reasoning["encrypted_content"]
            replay = {**sealed_turn, "input": [reasoning, {"role": "user", "content": "go on"}]}
            assert gw.client_on(b).post("/v1/responses", json=replay).status_code == 200
            assert THOUGHT in json.dumps(up.bodies[-1])  # B opened A's blob: vLLM got the reasoning back
            assert metric(httpx.get(gw.url + "/metrics").text, "responses_gateway_reasoning_blobs_rejected_total") == 0
            assert gw.stop() == 0
        key_file = tmp_path / "responses.db.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_bytes()
        with gateway(up_url, tmp_path, port=port, workers=1) as gw:  # a restart, and one worker now
            up.bodies.clear()
            assert httpx.post(gw.url + "/v1/responses", json=replay, timeout=30).status_code == 200
            assert THOUGHT in json.dumps(up.bodies[-1])
            assert gw.stop() == 0
        assert key_file.read_bytes() == key


def test_without_a_store_the_workers_of_one_start_share_a_key(tmp_path: Path) -> None:
    sealed_turn = {**REQUEST, "store": False, "include": ["reasoning.encrypted_content"]}
    with upstream() as (up_url, up), gateway(up_url, tmp_path, GATEWAY_STORE="none") as gw:
        a, b = sorted(gw.worker_pids())
        reasoning = next(i for i in gw.client_on(a).post("/v1/responses", json=sealed_turn).json()["output"]
                         if i["type"] == "reasoning")
        replay = {**sealed_turn, "input": [reasoning, {"role": "user", "content": "go on"}]}
        assert gw.client_on(b).post("/v1/responses", json=replay).status_code == 200
        assert THOUGHT in json.dumps(up.bodies[-1])
        assert any(line.get("event") == "reasoning_key_per_start" for line in gw.lines())
        assert gw.stop() == 0


def test_shared_tally_counts_every_workers_row_and_forgets_a_cleared_one(tmp_path: Path) -> None:
    from gateway.server.limits import BACKGROUND, CONCURRENCY, WEBSOCKETS, SharedTally

    parent = SharedTally.create(str(tmp_path), workers=2, owner_entries=4)
    assert stat.S_IMODE((tmp_path / "limits").stat().st_mode) == 0o600
    one, two = SharedTally(parent.path, 2, 4), SharedTally(parent.path, 2, 4)
    one.attach(0)
    two.attach(1)
    assert one.take(CONCURRENCY, 2) is None and two.take(CONCURRENCY, 2) is None
    assert one.take(CONCURRENCY, 2) == "total" and two.take(CONCURRENCY, 2) == "total"
    assert two.take(WEBSOCKETS, None) is None and one.total(WEBSOCKETS) == 1  # None: no bound
    # Per owner: counted across workers, and apart from other owners.
    assert one.take(BACKGROUND, 10, "key-a", 2) is None and two.take(BACKGROUND, 10, "key-a", 2) is None
    assert one.take(BACKGROUND, 10, "key-a", 2) == "owner"
    assert one.take(BACKGROUND, 10, "key-b", 2) is None and two.owned("key-a") == 2
    two.give(BACKGROUND, "key-a")
    assert one.owned("key-a") == 1 and one.take(BACKGROUND, 10, "key-a", 2) is None
    # Worker 0 dies holding a request slot, two runs and their owners: the parent frees them.
    parent.clear(0)
    assert two.total(CONCURRENCY) == 1 and two.total(BACKGROUND) == 0 and two.owned("key-a") == 0
    assert two.take(CONCURRENCY, 2) is None
    for tally in (one, two, parent):
        tally.close()


def test_a_worker_that_cannot_start_stops_the_gateway_with_status_1(tmp_path: Path) -> None:
    import socket

    gw = Gateway("http://127.0.0.1:9", tmp_path, GATEWAY_STORE="postgresql://gateway@127.0.0.1:1/none")
    try:
        assert gw.proc.wait(60) == 1  # the store is unreachable: no worker serves, none is respawned
        assert not any(line.get("event") == "worker_died" for line in gw.lines())
    finally:
        gw.close()
    with socket.socket() as taken:  # a port someone else holds (without SO_REUSEPORT): a clear line, status 1
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gw = Gateway("http://127.0.0.1:9", tmp_path, port=taken.getsockname()[1])
        try:
            assert gw.proc.wait(60) == 1
            assert "cannot listen on" in gw.log.read_text()
        finally:
            gw.close()
