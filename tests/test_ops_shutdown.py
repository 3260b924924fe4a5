"""SIGTERM with a stream in flight: the gateway runs as a real process (``python -m gateway serve``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.ops_support import FakeVllm, fake_vllm, wait_for
from tests.support import ROOT, free_port, sse_events

STREAM = {"model": "tiny", "input": "hi", "stream": True}


@contextmanager
def gateway_process(upstream: str, **env: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    full_env = {**os.environ, "GATEWAY_UPSTREAM_URL": upstream, "GATEWAY_PORT": str(port),
                "GATEWAY_HOST": "127.0.0.1", "GATEWAY_STORE": "none", **env}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode() if proc.stderr else "gateway exited")
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, timeout=20, what="the gateway process to serve")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(url + "/healthz", timeout=1)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        # refused, or accepted into the backlog at the moment the listener closed and then reset: not served
        return True
    return False


class StreamReader(threading.Thread):
    """Reads a gateway stream in the background; ``first`` is set once a frame arrived."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first = threading.Event()
        self.raw = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/responses", json=self.body, timeout=60) as r:
                for chunk in r.iter_raw():
                    self.raw += chunk
                    self.first.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first.set()


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_0() -> None:
    fake = FakeVllm(frame_delay=0.04)  # ~2 s of frames
    with fake_vllm(fake) as (up, _), gateway_process(up, GATEWAY_DRAIN_TIMEOUT="30") as (url, proc):
        reader = StreamReader(url, STREAM)
        reader.start()
        assert reader.first.wait(10) and reader.error is None
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: refuses_connections(url) or not reader.is_alive(), what="the listener to close")
        still_streaming = reader.is_alive()
        reader.join(30)
        assert proc.wait(30) == 0
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert still_streaming, "the stream should outlive the listener"
    assert reader.error is None
    events = sse_events(reader.raw)
    assert events[-1]["type"] == "response.incomplete"  # the recorded answer's own end (max_output_tokens)
    assert not any(e["type"] == "response.failed" for e in events)
    assert '"event":"draining"' in stderr and "drain_timeout_reached" not in stderr


@pytest.mark.parametrize("upstream_api", ["responses", "chat"])
def test_streams_still_running_after_the_drain_end_with_response_failed_and_exit_is_0(upstream_api: str) -> None:
    fake = FakeVllm(stall_after=5, stall_for=60)  # the model "thinks" far longer than the drain
    with fake_vllm(fake) as (up, _), gateway_process(up, GATEWAY_DRAIN_TIMEOUT="0.5",
                                                     GATEWAY_UPSTREAM_API=upstream_api) as (url, proc):
        reader = StreamReader(url, STREAM)
        reader.start()
        assert reader.first.wait(10)
        proc.send_signal(signal.SIGTERM)
        reader.join(20)
        assert not reader.is_alive() and reader.error is None
        assert proc.wait(20) == 0
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert fake.requests[0]["body"].get("messages" if upstream_api == "chat" else "input")
    events = sse_events(reader.raw)
    final = events[-1]
    assert final["type"] == "response.failed"
    assert final["response"]["status"] == "failed"
    assert final["response"]["error"]["code"] == "gateway_shutting_down"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(line["event"] == "drain_timeout_reached" for line in lines)
    access = [line for line in lines if line["event"] == "request"]
    assert access and access[-1]["response_status"] == "failed" and access[-1]["status"] == 200


def test_sigterm_when_idle_exits_0_promptly() -> None:
    with fake_vllm() as (up, _), gateway_process(up) as (url, proc):
        assert httpx.get(url + "/readyz").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
