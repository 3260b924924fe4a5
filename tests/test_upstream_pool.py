"""Upstream connections on the real transport: kept alive and reused, and closed when a client leaves.

The upstream here is a raw asyncio HTTP/1.1 server on loopback (in a thread) that counts the TCP connections
it accepts and notes when each one closes, so the tests see what vLLM would see. It answers like vLLM under
uvicorn: a stream's chunked terminator comes in a write of its own, after the last frame, so the gateway
has read the terminal event before the end of the body arrives (what ``UpstreamResponse.release`` is for).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import orjson

from gateway.config import Settings
from tests.ops_support import cassette_frames, cassette_json
from tests.support import running_gateway, sse_events

TERMINAL = ("response.completed", "response.incomplete")  # the recorded stream stops at its token limit


@dataclass
class _Conn:
    opened: float
    closed: float | None = None
    requests: int = 0


@dataclass
class LoopbackUpstream:
    """``POST /v1/responses``: the recorded text stream (``"stream": true``) or JSON answer.

    ``mode``: ``"normal"``; ``"gzip"`` (the stream compressed, ``Content-Encoding: gzip``); ``"hang"`` (read the
    request, never answer: a model thinking); ``"linger"``
    (stream every frame, then neither end the body nor close: past ``release``'s time bound)."""

    mode: str = "normal"
    conns: list[_Conn] = field(default_factory=list)
    got_request: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.frames = cassette_frames("text_stream")
        self.json = cassette_json("text_nonstream")

    @property
    def accepted(self) -> int:
        return len(self.conns)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(opened=time.monotonic())
        with self.lock:
            self.conns.append(conn)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = orjson.loads(await reader.readexactly(length)) if length else {}
                conn.requests += 1
                self.got_request.set()
                if self.mode == "hang":
                    await reader.read()  # b"" once the gateway closes its end
                    return
                if not body.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(self.json), self.json))
                    await writer.drain()
                    continue
                gzip = self.mode == "gzip"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             + (b"content-encoding: gzip\r\n" if gzip else b"") + b"transfer-encoding: chunked\r\n\r\n")
                packer = zlib.compressobj(wbits=31)
                for frame in self.frames:
                    if gzip:  # one compressed piece per frame, cut anywhere in the frames' text
                        frame = packer.compress(frame) + packer.flush(zlib.Z_SYNC_FLUSH)
                    writer.write(b"%x\r\n%b\r\n" % (len(frame), frame))
                if gzip:
                    tail = packer.flush()
                    writer.write(b"%x\r\n%b\r\n" % (len(tail), tail))
                await writer.drain()
                if self.mode == "linger":
                    await reader.read()
                    return
                await asyncio.sleep(0.005)  # the end of the body comes after the terminal event, on its own
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            conn.closed = time.monotonic()
            with contextlib.suppress(Exception):
                writer.close()

    def closed_within(self, seconds: float, since: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.conns and all(c.closed is not None for c in self.conns):
                return max(c.closed for c in self.conns if c.closed is not None) - since <= seconds
            time.sleep(0.01)
        return False


@contextlib.contextmanager
def loopback_upstream(upstream: LoopbackUpstream) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    stop: list[asyncio.Event] = []

    async def main() -> None:
        server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        stop.append(asyncio.Event())
        ready.set()
        async with server:
            await stop[0].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(10)


def _settings(url: str) -> Settings:
    return Settings(upstream_url=url, store="none", tool_choice_enforcement="off")


def test_sequential_requests_reuse_a_handful_of_upstream_connections() -> None:
    upstream = LoopbackUpstream()
    with loopback_upstream(upstream) as up, running_gateway(_settings(up)) as url, httpx.Client(timeout=10) as http:
        for _ in range(50):
            r = http.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True})
            assert sse_events(r.content)[-1]["type"] in TERMINAL
        for _ in range(50):
            r = http.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"})
            assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")
    assert sum(c.requests for c in upstream.conns) == 100
    assert upstream.accepted <= 3, f"{upstream.accepted} upstream connections for 100 sequential requests"


def test_a_non_streamed_request_whose_client_leaves_closes_its_upstream_request() -> None:
    upstream = LoopbackUpstream(mode="hang")
    with loopback_upstream(upstream) as up, running_gateway(_settings(up)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = orjson.dumps({"model": "tiny", "input": "hi"})
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%b" % (len(body), body))
            assert upstream.got_request.wait(5), "the request never reached the upstream"
            time.sleep(0.2)
            assert upstream.conns[0].closed is None  # still waiting on the model
        left = time.monotonic()  # the client closed its socket
        assert upstream.closed_within(1.5, left), "the upstream request was not closed after the client left"


def test_a_streamed_request_whose_client_leaves_closes_its_upstream_request() -> None:
    upstream = LoopbackUpstream(mode="linger")
    with loopback_upstream(upstream) as up, running_gateway(_settings(up)) as url:
        upstream.frames = upstream.frames[:3]  # created, in_progress, one more: the answer is not over
        with httpx.Client(timeout=10) as http, http.stream(
                "POST", url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
            assert next(r.iter_raw()).startswith(b"event: response.created")
            left = time.monotonic()
        assert upstream.closed_within(1.5, left), "the upstream request was not closed after the client left"


def test_release_is_bounded_when_the_body_does_not_end_after_the_terminal_event() -> None:
    upstream = LoopbackUpstream(mode="linger")  # every frame, then neither the end of the body nor a close
    with loopback_upstream(upstream) as up, running_gateway(_settings(up)) as url:
        started = time.monotonic()
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}, timeout=10)
        assert sse_events(r.content)[-1]["type"] in TERMINAL
        assert upstream.closed_within(2.5, started), "release() did not give up on a body that never ended"


def test_a_compressed_upstream_stream_is_decoded_and_the_plain_one_read_as_is() -> None:
    """A plain body is read from the transport's stream directly (gateway.upstream.client.UpstreamResponse.aiter_bytes);
    one with ``Content-Encoding: gzip`` still goes through httpx's decoder: the client gets the same events."""
    events = {}
    for mode in ("normal", "gzip"):
        upstream = LoopbackUpstream(mode=mode)
        with loopback_upstream(upstream) as up, running_gateway(_settings(up)) as url:
            r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}, timeout=10)
        events[mode] = sse_events(r.content)
        assert events[mode][-1]["type"] in TERMINAL
    assert [e["type"] for e in events["gzip"]] == [e["type"] for e in events["normal"]]
    text = "".join(e["delta"] for e in events["normal"] if e["type"] == "response.output_text.delta")
    assert text and text == "".join(e["delta"] for e in events["gzip"] if e["type"] == "response.output_text.delta")
