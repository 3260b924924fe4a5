"""Benchmark: the gateway's added latency, throughput and memory against a fast fake vLLM upstream.

One run starts a fake upstream (a raw asyncio HTTP/1.1 server streaming vLLM-framed ``/v1/responses``
SSE for a function call named like the client's custom tool ``apply_patch``), starts the gateway as a
subprocess in front of it, and drives the same streaming workload (a) directly against the upstream
and (b) through the gateway, with a raw asyncio HTTP/1.1 client. See bench/README.md.

    .venv/bin/python bench/bench_gateway.py            # full run (~1-2 minutes)
    .venv/bin/python bench/bench_gateway.py --quick    # short run

This is a benchmark, not a test: it prints a table with PASS/MISS against the targets of issue 2 and
writes bench/results/latest.json. It only needs the project's dependencies and psutil.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
CASSETTE = ROOT / "cassettes" / "vllm" / "custom_tool_call_strict_stream.yaml"
RESULTS = ROOT / "bench" / "results" / "latest.json"
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))  # before pinning

TARGETS = {
    "added_ttfb_p50_ms": 1.0,       # <=, one stream
    "c64_ttfb_p50_ms": 20.0,        # <=, 64 concurrent streams through the gateway
    "frames_per_s": 30_000.0,       # >=, translated frames through one worker
    "peak_rss_mb": 60.0,            # <=, gateway at 200 concurrent streams
}

REQUEST_BODY = orjson.dumps({"model": "tiny", "stream": True, "input": "x",
                             "tools": [{"type": "custom", "name": "apply_patch"}], "tool_choice": "required"})


# ---------------------------------------------------------------------------------------------- workload


def _cassette_frames() -> list[tuple[str, dict[str, Any]]]:
    """The recorded vLLM stream as ``(event, data)`` pairs (templates for the frames we generate)."""
    import yaml

    doc = yaml.safe_load(CASSETTE.read_text(encoding="utf-8"))
    body = doc["interactions"][0]["response"]["body"]["string"]
    frames = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        event = data = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if event and data:
            frames.append((event, orjson.loads(data)))
    return frames


_PATCH_LINES = [
    "*** Begin Patch\n",
    "*** Add File: src/caf\u00e9_\U0001F600/module.py\n",
    '+def greet(name: str) -> str:\n',
    '+    """Say "hello" to \\ someone."""\n',
    "+\treturn f\"h\u00e9llo, {name}!\"  # tab, quotes, backslash \\n\n",
    "+PATH = 'C:\\\\tmp\\\\x'  # \u2603 snowman, \U0001F680 rocket\n",
    "+\n",
]


@dataclass
class Workload:
    """One upstream stream: the frames vLLM would send and what the client must see as the tool input."""

    n_deltas: int
    head: list[bytes]          # created, in_progress (sent at once)
    added: bytes               # output_item.added
    deltas: list[bytes]        # function_call_arguments.delta frames
    tail: list[bytes]          # arguments.done, output_item.done, response.completed
    expected_input: str

    @property
    def upstream_frames(self) -> int:
        return len(self.head) + 1 + len(self.deltas) + len(self.tail)


def build_workload(n_deltas: int, seed: int = 7) -> Workload:
    """vLLM-framed SSE (``event: X\\ndata: {json}\\n\\n``, compact JSON, vLLM's key order) for one
    ``apply_patch`` function call whose ``{"input": ...}`` arguments are cut into ``n_deltas`` fragments,
    cut anywhere, escapes (``\\n``, ``\\"``, ``\\\\``, ``\\t``, ``\\u00e9``, surrogate pairs) included."""
    rnd = random.Random(seed)
    templates = dict(_cassette_frames())
    text_parts: list[str] = []
    args = ""
    i = 0
    while len(args) < max(4 * n_deltas, 16):
        text_parts.append(_PATCH_LINES[i % len(_PATCH_LINES)])
        if i % len(_PATCH_LINES) == len(_PATCH_LINES) - 1:
            text_parts.append("*** End Patch\n")
        i += 1
        args = json.dumps({"input": "".join(text_parts)})  # ensure_ascii: \\u escapes, surrogate pairs
    text = "".join(text_parts)
    cuts = sorted(rnd.sample(range(1, len(args)), n_deltas - 1)) if n_deltas > 1 else []
    bounds = [0, *cuts, len(args)]
    fragments = [args[a:b] for a, b in itertools.pairwise(bounds)]

    def frame(event: str, data: dict[str, Any]) -> bytes:
        return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    created = templates["response.created"]
    in_progress = templates["response.in_progress"]
    added = templates["response.output_item.added"]
    item_id = added["item"]["id"]
    seq = 3
    deltas = []
    for frag in fragments:
        deltas.append(frame("response.function_call_arguments.delta", {
            "delta": frag, "item_id": item_id, "output_index": 0, "sequence_number": seq,
            "type": "response.function_call_arguments.delta"}))
        seq += 1
    args_done = dict(templates["response.function_call_arguments.done"], arguments=args, sequence_number=seq)
    item = dict(templates["response.output_item.done"]["item"], arguments=args)
    item_done = dict(templates["response.output_item.done"], item=item, sequence_number=seq + 1)
    completed = dict(templates["response.completed"])
    completed["response"] = dict(completed["response"], output=[item])
    completed["sequence_number"] = seq + 2
    return Workload(
        n_deltas=n_deltas,
        head=[frame("response.created", created), frame("response.in_progress", in_progress)],
        added=frame("response.output_item.added", added),
        deltas=deltas,
        tail=[frame("response.function_call_arguments.done", args_done),
              frame("response.output_item.done", item_done), frame("response.completed", completed)],
        expected_input=text,
    )


# ---------------------------------------------------------------------------------------------- fake upstream

_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ndate: Sun, 29 Nov 2026 17:23:51 GMT\r\nserver: uvicorn\r\n"
             b"content-type: text/event-stream; charset=utf-8\r\nvary: Origin\r\ntransfer-encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class FakeUpstream:
    """Serves ``POST /v1/responses`` as a vLLM stream, one HTTP chunk per SSE frame (as uvicorn does).

    ``POST /_bench/mode`` with ``{"deltas": N, "delay_ms": D}`` sets the stream served next. With D == 0
    the whole stream is written at once (as fast as the gateway can read it); otherwise created and
    in_progress go out at once and every later frame D milliseconds after the previous one (the pace at
    which a model emits tokens).
    """

    def __init__(self) -> None:
        self.deltas = 24
        self.delay = 0.0
        self._workloads: dict[int, Workload] = {}
        self._bulk: dict[int, bytes] = {}

    def workload(self, n: int) -> Workload:
        w = self._workloads.get(n)
        if w is None:
            w = self._workloads[n] = build_workload(n)
            self._bulk[n] = _SSE_HEAD + b"".join(
                _chunk(f) for f in [*w.head, w.added, *w.deltas, *w.tail]) + b"0\r\n\r\n"
        return w

    def protocol(self) -> asyncio.Protocol:
        return _UpstreamConn(self)


class _UpstreamConn(asyncio.Protocol):
    def __init__(self, server: FakeUpstream) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        method, path = head[0].split(" ")[:2]
        if method == "POST" and path == "/_bench/mode":
            mode = orjson.loads(body)
            self.server.deltas = int(mode["deltas"])
            self.server.delay = float(mode["delay_ms"]) / 1000
            self.server.workload(self.server.deltas)
            self._reply(b"{}")
        elif method == "POST" and path.endswith("/responses"):
            self._stream()
        else:
            self._reply(b'{"object":"list","data":[]}')

    def _reply(self, payload: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(payload), payload))
        self._next()

    def _stream(self) -> None:
        srv = self.server
        w = srv.workload(srv.deltas)
        assert self.transport is not None
        if srv.delay <= 0:
            self.transport.write(srv._bulk[w.n_deltas])
            self._next()
            return
        self.busy = True
        asyncio.get_running_loop().create_task(self._paced(w, srv.delay))

    async def _paced(self, w: Workload, delay: float) -> None:
        t = self.transport
        assert t is not None
        try:
            t.write(_SSE_HEAD + b"".join(_chunk(f) for f in w.head))
            for frame in [w.added, *w.deltas]:
                await asyncio.sleep(delay)
                if t.is_closing():
                    return
                t.write(_chunk(frame))
            await asyncio.sleep(delay)
            t.write(b"".join(_chunk(f) for f in w.tail) + b"0\r\n\r\n")
        finally:
            self.busy = False
        if not t.is_closing():
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def run_upstream(port: int) -> None:
    """Entry point of the fake-upstream subprocess."""
    async def main() -> None:
        srv = FakeUpstream()
        srv.workload(srv.deltas)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(srv.protocol, "127.0.0.1", port, backlog=1024)
        print("ready", flush=True)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- client


@dataclass
class Result:
    ok: bool
    status: int
    ttfb: float            # request written -> first body byte (seconds)
    total: float           # request written -> end of body
    frames: int            # SSE frames ("\n\n" terminators) in the body
    body_bytes: int
    body: bytes | None = None


class ClientConn(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection that times one streamed response at a time.

    Hand-rolled (buffer + offsets, no per-chunk awaits) so that the load generator stays far cheaper
    than what it measures; the direct figures show its ceiling.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[Result] | None = None
        self.closed = asyncio.get_event_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))
        if not self.closed.done():
            self.closed.set_result(None)

    def request(self, raw: bytes, keep_body: bool = False) -> asyncio.Future[Result]:
        assert self.transport is not None and (self.waiter is None or self.waiter.done())
        self.waiter = asyncio.get_event_loop().create_future()
        self.keep_body = keep_body
        self.state = "head"
        self.status = 0
        self.chunked = False
        self.remaining = 0
        self.first_body: float | None = None
        self.frames = 0
        self.body_bytes = 0
        self.last_nl = False
        self.body = bytearray() if keep_body else None
        self.started = time.perf_counter()
        self.transport.write(raw)
        return self.waiter

    def _body(self, data: bytes, now: float) -> None:
        if not data:
            return
        if self.first_body is None:
            self.first_body = now
        self.body_bytes += len(data)
        self.frames += data.count(b"\n\n") + (1 if self.last_nl and data[0] == 10 else 0)
        self.last_nl = data[-1] == 10
        if self.body is not None:
            self.body += data

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf
        buf += data
        pos = 0
        n = len(buf)
        while self.waiter is not None and not self.waiter.done():
            st = self.state
            if st == "head":
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                lines = bytes(buf[pos:end]).split(b"\r\n")
                self.status = int(lines[0].split(b" ")[1])
                self.chunked = False
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    lname = name.strip().lower()
                    if lname == b"transfer-encoding" and b"chunked" in value.lower():
                        self.chunked = True
                    elif lname == b"content-length":
                        length = int(value)
                pos = end + 4
                if self.chunked:
                    self.state = "size"
                else:
                    self.state, self.remaining = "fixed", length
                    if length == 0:
                        self._done(now)
            elif st == "size":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(bytes(buf[pos:end]).split(b";")[0], 16)
                pos = end + 2
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.remaining = "data", size
            elif st == "data":
                take = min(self.remaining, n - pos)
                if take <= 0:
                    break
                self._body(bytes(buf[pos:pos + take]), now)
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = "crlf"
            elif st == "crlf":
                if n - pos < 2:
                    break
                pos += 2
                self.state = "size"
            elif st == "trailer":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    self._done(now)
            elif st == "fixed":
                take = min(self.remaining, n - pos)
                if take <= 0:
                    break
                self._body(bytes(buf[pos:pos + take]), now)
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self._done(now)
        del buf[:pos]

    def _done(self, now: float) -> None:
        assert self.waiter is not None
        first = self.first_body if self.first_body is not None else now
        self.waiter.set_result(Result(ok=self.status == 200, status=self.status, ttfb=first - self.started,
                                      total=now - self.started, frames=self.frames, body_bytes=self.body_bytes,
                                      body=bytes(self.body) if self.body is not None else None))
        self.waiter = None


def http_request(port: int, path: str, body: bytes) -> bytes:
    return (b"POST %b HTTP/1.1\r\nhost: 127.0.0.1:%d\r\naccept: text/event-stream\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (path.encode(), port, len(body), body))


async def connect(port: int) -> ClientConn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(ClientConn, "127.0.0.1", port)
    return proto


# ---------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


def stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------- phases


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float) -> float:
    return round(x * 1000, 3)


@dataclass
class Bench:
    args: argparse.Namespace
    upstream_port: int
    gateway_port: int
    gateway_pid: int
    gateway_cpus: list[int] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    contention: dict[str, float] = field(default_factory=dict)

    def target(self, name: str) -> int:
        return self.upstream_port if name == "direct" else self.gateway_port

    async def set_mode(self, deltas: int, delay_ms: float) -> None:
        conn = await connect(self.upstream_port)
        try:
            res = await conn.request(http_request(self.upstream_port, "/_bench/mode",
                                                  orjson.dumps({"deltas": deltas, "delay_ms": delay_ms})))
            assert res.ok, res
        finally:
            assert conn.transport is not None
            conn.transport.close()

    async def one(self, conn: ClientConn, port: int, keep_body: bool = False) -> Result:
        res = await conn.request(http_request(port, "/v1/responses", REQUEST_BODY), keep_body=keep_body)
        if not res.ok:
            raise RuntimeError(f"HTTP {res.status} from port {port}")
        return res

    # -- correctness: the gateway really translates (checked once, untimed)

    async def check_translation(self) -> dict[str, Any]:
        deltas = 300
        await self.set_mode(deltas, 0)
        w = build_workload(deltas)
        conn = await connect(self.gateway_port)
        res = await self.one(conn, self.gateway_port, keep_body=True)
        self._close(conn)
        assert res.body is not None
        events = []
        for block in res.body.split(b"\n\n"):
            if block.strip():
                data = block.split(b"\ndata: ", 1)[1]
                events.append(orjson.loads(data))
        types = [e["type"] for e in events]
        pieces = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
        done = [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"]
        seqs = [e["sequence_number"] for e in events]
        ok = ("".join(pieces) == w.expected_input and done == [w.expected_input]
              and types[-1] == "response.completed" and seqs == list(range(len(seqs)))
              and events[-1]["response"]["output"][0]["type"] == "custom_tool_call")
        if not ok:
            raise RuntimeError(f"the gateway did not translate the stream as expected: {types[:6]}...{types[-3:]}")
        return {"upstream_frames": w.upstream_frames, "client_frames": len(events),
                "custom_deltas": len(pieces), "ok": ok}

    # -- added TTFB, one stream at a time

    async def ttfb_single(self) -> None:
        a = self.args
        await self.set_mode(a.ttfb_deltas, a.ttfb_delay_ms)
        out: dict[str, Any] = {"requests": a.requests, "deltas": a.ttfb_deltas, "delay_ms": a.ttfb_delay_ms}
        for name in ("direct", "gateway"):
            port = self.target(name)
            conn = await connect(port)
            for _ in range(a.warmup):
                await self.one(conn, port)
            ttfbs, totals = [], []
            cpu0, user0 = self._gateway_cpu(), self._gateway_user()
            for _ in range(a.requests):
                res = await self.one(conn, port)
                ttfbs.append(res.ttfb)
                totals.append(res.total)
            cpu, user = self._gateway_cpu() - cpu0, self._gateway_user() - user0
            self._close(conn)
            out[name] = {"ttfb_p50_ms": ms(pct(ttfbs, 50)), "ttfb_p99_ms": ms(pct(ttfbs, 99)),
                         "ttfb_mean_ms": ms(statistics.fmean(ttfbs)), "total_p50_ms": ms(pct(totals, 50))}
            if name == "gateway":
                out[name]["gateway_cpu_ms_per_request"] = round(cpu / a.requests * 1000, 3)
                out[name]["gateway_user_ms_per_request"] = round(user / a.requests * 1000, 3)
        out["added_ttfb_p50_ms"] = round(out["gateway"]["ttfb_p50_ms"] - out["direct"]["ttfb_p50_ms"], 3)
        out["added_ttfb_p99_ms"] = round(out["gateway"]["ttfb_p99_ms"] - out["direct"]["ttfb_p99_ms"], 3)
        self.results["ttfb_single"] = out

    # -- TTFB with 64 streams open at once

    async def ttfb_concurrent(self) -> None:
        a = self.args
        c = a.concurrency
        await self.set_mode(a.c_deltas, a.c_delay_ms)
        stream_s = (a.c_deltas + 2) * a.c_delay_ms / 1000
        out: dict[str, Any] = {"streams": c, "rounds": a.rounds, "deltas": a.c_deltas, "delay_ms": a.c_delay_ms}
        for name in ("direct", "gateway"):
            port = self.target(name)
            conns = await asyncio.gather(*(connect(port) for _ in range(c)))
            await asyncio.gather(*(self.one(conn, port) for conn in conns))  # warm every connection

            # burst: all streams start at the same instant
            burst = await asyncio.gather(*(self.one(conn, port) for conn in conns))
            b_ttfb = [r.ttfb for r in burst]

            # sustained: `c` closed-loop workers, starts spread over one stream duration, so `c` streams
            # are open at any time and new requests arrive while the others stream
            ttfbs: list[float] = []
            frames = 0
            cpu0, user0 = self._gateway_cpu(), self._gateway_user()
            t0 = time.perf_counter()

            async def worker(i: int, conn: ClientConn, port: int = port, ttfbs: list[float] = ttfbs) -> None:
                nonlocal frames
                await asyncio.sleep(stream_s * i / c)
                for _ in range(a.rounds):
                    res = await self.one(conn, port)
                    ttfbs.append(res.ttfb)
                    frames += res.frames

            await asyncio.gather(*(worker(i, conn) for i, conn in enumerate(conns)))
            wall = time.perf_counter() - t0
            cpu, user = self._gateway_cpu() - cpu0, self._gateway_user() - user0
            for conn in conns:
                self._close(conn)
            out[name] = {"ttfb_p50_ms": ms(pct(ttfbs, 50)), "ttfb_p99_ms": ms(pct(ttfbs, 99)),
                         "burst_ttfb_p50_ms": ms(pct(b_ttfb, 50)), "burst_ttfb_p99_ms": ms(pct(b_ttfb, 99)),
                         "frames_per_s": round(frames / wall), "requests": len(ttfbs)}
            if name == "gateway":
                out[name]["gateway_cpu_util"] = round(cpu / wall, 3)
                out[name]["gateway_cpu_us_per_frame"] = round(cpu / frames * 1e6, 2)
                out[name]["gateway_user_us_per_frame"] = round(user / frames * 1e6, 2)
        self.results["ttfb_concurrent"] = out

    # -- frames per second, one long stream written as fast as the gateway reads

    async def throughput(self) -> None:
        a = self.args
        await self.set_mode(a.deltas, 0)
        out: dict[str, Any] = {"deltas": a.deltas, "repeats": a.repeats}
        for name in ("direct", "gateway"):
            port = self.target(name)
            conn = await connect(port)
            await self.one(conn, port)  # warm-up (and the upstream builds the stream)
            best: dict[str, Any] | None = None
            cpu0, user0 = self._gateway_cpu(), self._gateway_user()
            frames = 0
            for _ in range(a.repeats):
                res = await self.one(conn, port)
                frames += res.frames
                fps = res.frames / res.total
                if best is None or fps > best["frames_per_s"]:
                    best = {"frames_per_s": round(fps), "frames": res.frames, "wall_s": round(res.total, 4),
                            "mb_per_s": round(res.body_bytes / res.total / 1e6, 2)}
                    if name == "gateway":
                        best["upstream_frames_per_s"] = round((a.deltas + 6) / res.total)
            assert best is not None
            if name == "gateway":  # CPU over all repeats: /proc's clock ticks are 10 ms
                cpu, user = self._gateway_cpu() - cpu0, self._gateway_user() - user0
                best["gateway_cpu_us_per_frame"] = round(cpu / frames * 1e6, 2)
                best["gateway_user_us_per_frame"] = round(user / frames * 1e6, 2)
            self._close(conn)
            out[name] = best
        self.results["throughput"] = out

    # -- peak RSS with 200 streams open

    async def rss(self) -> None:
        import psutil

        a = self.args
        proc = psutil.Process(self.gateway_pid)
        await self.set_mode(a.rss_deltas, a.rss_delay_ms)
        idle = proc.memory_info().rss
        peak = idle
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                with contextlib.suppress(psutil.Error):
                    peak = max(peak, proc.memory_info().rss)
                await asyncio.sleep(0.005)

        sampler = asyncio.get_running_loop().create_task(sample())
        conns = await asyncio.gather(*(connect(self.gateway_port) for _ in range(a.rss_streams)))
        t0 = time.perf_counter()
        cpu0, user0 = self._gateway_cpu(), self._gateway_user()
        results = await asyncio.gather(*(self.one(conn, self.gateway_port) for conn in conns))
        wall = time.perf_counter() - t0
        cpu, user = self._gateway_cpu() - cpu0, self._gateway_user() - user0
        sampling = False
        await sampler
        for conn in conns:
            self._close(conn)
        await asyncio.sleep(0.2)
        frames = sum(r.frames for r in results)
        ttfbs = [r.ttfb for r in results]
        self.results["rss"] = {
            "streams": a.rss_streams, "deltas": a.rss_deltas, "delay_ms": a.rss_delay_ms,
            "idle_rss_mb": round(idle / 2**20, 1), "peak_rss_mb": round(peak / 2**20, 1),
            "after_rss_mb": round(proc.memory_info().rss / 2**20, 1),
            "ttfb_p50_ms": ms(pct(ttfbs, 50)), "ttfb_p99_ms": ms(pct(ttfbs, 99)),
            "frames_per_s": round(frames / wall), "gateway_cpu_util": round(cpu / wall, 3),
            "gateway_cpu_us_per_frame": round(cpu / frames * 1e6, 2),
            "gateway_user_us_per_frame": round(user / frames * 1e6, 2),
        }

    def _other_load(self) -> tuple[float, float]:
        """(busy seconds of the gateway's cores, gateway CPU seconds): their difference over a phase is
        CPU time other processes took from the gateway's cores (a shared machine is a noisy one)."""
        import psutil

        per = psutil.cpu_times(percpu=True)
        busy = sum(per[c].user + per[c].system + per[c].nice + per[c].irq + per[c].softirq
                   for c in self.gateway_cpus if c < len(per))
        return busy, self._gateway_cpu()

    async def phase(self, name: str) -> None:
        busy0, cpu0 = self._other_load()
        t0 = time.perf_counter()
        await getattr(self, name)()
        wall = time.perf_counter() - t0
        busy1, cpu1 = self._other_load()
        other = max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / wall / max(1, len(self.gateway_cpus))
        self.contention[name] = round(other, 3)

    def _gateway_cpu(self) -> float:
        import psutil

        t = psutil.Process(self.gateway_pid).cpu_times()
        return t.user + t.system

    def _gateway_user(self) -> float:
        import psutil

        return psutil.Process(self.gateway_pid).cpu_times().user

    @staticmethod
    def _close(conn: ClientConn) -> None:
        if conn.transport is not None:
            conn.transport.close()


# ---------------------------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "affinity": ALLOWED_CPUS, "cpu": cpu,
            "python": platform.python_version(), "platform": platform.platform()}


def evaluate(r: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """Rows: metric, direct, gateway, added/ratio, target, verdict."""
    rows = []

    def verdict(value: float, target: float, lower_is_better: bool = True) -> str:
        return "PASS" if (value <= target if lower_is_better else value >= target) else "MISS"

    if "ttfb_single" in r:
        t = r["ttfb_single"]
        d, g = t["direct"], t["gateway"]
        rows.append(("TTFB p50, 1 stream (ms)", f"{d['ttfb_p50_ms']:.3f}", f"{g['ttfb_p50_ms']:.3f}",
                     f"+{t['added_ttfb_p50_ms']:.3f}", f"added <= {TARGETS['added_ttfb_p50_ms']:g}",
                     verdict(t["added_ttfb_p50_ms"], TARGETS["added_ttfb_p50_ms"])))
        rows.append(("TTFB p99, 1 stream (ms)", f"{d['ttfb_p99_ms']:.3f}", f"{g['ttfb_p99_ms']:.3f}",
                     f"+{t['added_ttfb_p99_ms']:.3f}", "-", "info"))
        rows.append((f"gateway CPU ms/request ({t['deltas']} deltas)", "-",
                     f"{g['gateway_cpu_ms_per_request']:.2f} (user {g['gateway_user_ms_per_request']:.2f})",
                     "-", "-", "info"))
    if "ttfb_concurrent" in r:
        t = r["ttfb_concurrent"]
        d, g = t["direct"], t["gateway"]
        c = t["streams"]
        rows.append((f"TTFB p50, {c} concurrent (ms)", f"{d['ttfb_p50_ms']:.3f}", f"{g['ttfb_p50_ms']:.3f}",
                     f"+{g['ttfb_p50_ms'] - d['ttfb_p50_ms']:.3f}", f"<= {TARGETS['c64_ttfb_p50_ms']:g}",
                     verdict(g["ttfb_p50_ms"], TARGETS["c64_ttfb_p50_ms"])))
        rows.append((f"TTFB p99, {c} concurrent (ms)", f"{d['ttfb_p99_ms']:.3f}", f"{g['ttfb_p99_ms']:.3f}",
                     f"+{g['ttfb_p99_ms'] - d['ttfb_p99_ms']:.3f}", "-", "info"))
        rows.append((f"TTFB p50, {c} burst (ms)", f"{d['burst_ttfb_p50_ms']:.3f}", f"{g['burst_ttfb_p50_ms']:.3f}",
                     f"+{g['burst_ttfb_p50_ms'] - d['burst_ttfb_p50_ms']:.3f}", "-", "info"))
    if "throughput" in r:
        t = r["throughput"]
        d, g = t["direct"], t["gateway"]
        rows.append(("frames/s, 1 long stream", f"{d['frames_per_s']:,}", f"{g['frames_per_s']:,}",
                     f"x{g['frames_per_s'] / d['frames_per_s']:.3f}", f">= {TARGETS['frames_per_s']:,.0f}",
                     verdict(g["frames_per_s"], TARGETS["frames_per_s"], lower_is_better=False)))
        rows.append(("gateway CPU us/frame (bulk)", "-",
                     f"{g['gateway_cpu_us_per_frame']:.1f} (user {g['gateway_user_us_per_frame']:.1f})", "-", "-",
                     "info"))
    if "ttfb_concurrent" in r:
        g = r["ttfb_concurrent"]["gateway"]
        rows.append((f"gateway CPU us/frame ({r['ttfb_concurrent']['streams']} paced)", "-",
                     f"{g['gateway_cpu_us_per_frame']:.1f} (user {g['gateway_user_us_per_frame']:.1f})", "-", "-",
                     "info"))
    if "rss" in r:
        t = r["rss"]
        rows.append((f"peak RSS, {t['streams']} streams (MB)", "-", f"{t['peak_rss_mb']:.1f}",
                     f"idle {t['idle_rss_mb']:.1f}", f"<= {TARGETS['peak_rss_mb']:g}",
                     verdict(t["peak_rss_mb"], TARGETS["peak_rss_mb"])))
        rows.append((f"gateway CPU us/frame ({t['streams']} paced)", "-",
                     f"{t['gateway_cpu_us_per_frame']:.1f} (user {t['gateway_user_us_per_frame']:.1f})", "-", "-",
                     "info"))
    return rows


def print_table(rows: list[tuple[str, ...]]) -> None:
    header = ("metric", "direct", "gateway", "added/ratio", "target", "")
    widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(line)
    print("  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths,
                                                                                                    strict=True))))
    print(line)
    for row in rows:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    print(line)


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run (fewer requests, shorter streams)")
    p.add_argument("--phases", default="ttfb,concurrent,throughput,rss",
                   help="comma-separated subset of: ttfb, concurrent, throughput, rss")
    p.add_argument("--requests", type=int, help="sequential single-stream requests (default 200; quick 50)")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests first")
    p.add_argument("--ttfb-deltas", type=int, default=24, help="argument deltas per single-stream request")
    p.add_argument("--ttfb-delay-ms", type=float, default=1.0, help="upstream ms between frames after the head")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, help="requests per concurrent worker (default 4; quick 2)")
    p.add_argument("--c-deltas", type=int, default=40)
    p.add_argument("--c-delay-ms", type=float, default=10.0, help="10 ms: 100 tokens/s per stream")
    p.add_argument("--deltas", type=int, help="argument deltas in the throughput stream (default 20000; quick 5000)")
    p.add_argument("--repeats", type=int, help="throughput repeats, best kept (default 5; quick 3)")
    p.add_argument("--rss-streams", type=int, default=200)
    p.add_argument("--rss-deltas", type=int, help="deltas per stream in the RSS phase (default 100; quick 50)")
    p.add_argument("--rss-delay-ms", type=float, default=10.0)
    p.add_argument("--no-pin", action="store_true", help="do not pin client+upstream and gateway to cores")
    p.add_argument("--gateway-wrap", default="",
                   help="command prefix for the gateway, e.g. 'py-spy record -o prof.svg --' (profiling)")
    p.add_argument("--enforcement", default="off", choices=("off", "validate", "constrain"),
                   help="gateway --tool-choice-enforcement (default off: with constrain, tool_choice 'required' "
                        "goes to /v1/chat/completions, which the fake upstream does not serve)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for `gateway serve`")
    p.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for the gateway (e.g. PYTHONPATH=/tmp/uvlibs to try uvloop)")
    p.add_argument("--gateway-root", type=Path, default=ROOT,
                   help="directory holding the gateway package to run (A/B runs against a scratch copy)")
    p.add_argument("--attach", default="",
                   help="command started once the gateway is up ({pid}: the gateway's pid) and stopped with SIGINT "
                        "after the phases, e.g. 'py-spy record --pid {pid} -r 500 -f speedscope -o prof.json'")
    p.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    p.add_argument("--_upstream", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    a.requests = a.requests or (50 if q else 200)
    a.rounds = a.rounds or (2 if q else 4)
    a.deltas = a.deltas or (5000 if q else 20000)
    a.repeats = a.repeats or (3 if q else 5)
    a.rss_deltas = a.rss_deltas or (50 if q else 100)
    if q:
        a.warmup = min(a.warmup, 10)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a._upstream:
        run_upstream(a._upstream)
        return 0
    phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    cpus = sorted(os.sched_getaffinity(0))
    pin = not a.no_pin and len(cpus) >= 2
    client_cpus, gateway_cpus = ({cpus[0]}, {cpus[1]}) if pin else (set(cpus), set(cpus))
    if pin:
        os.sched_setaffinity(0, client_cpus)  # the fake upstream inherits it

    up_port, gw_port = free_port(), free_port()
    upstream = gateway = attached = None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        upstream = subprocess.Popen([sys.executable, __file__, "--_upstream", str(up_port)], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE)
        wait_port(up_port, upstream)
        cmd = [*a.gateway_wrap.split(), sys.executable, "-m", "gateway", "serve",
               "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(gw_port), "--store", "none",
               "--log-level", "warning", "--tool-choice-enforcement", a.enforcement, *a.gateway_arg]
        gw_env = dict(env, **dict(kv.split("=", 1) for kv in a.gateway_env))
        gateway = subprocess.Popen(cmd, cwd=a.gateway_root, env=gw_env)
        if pin:
            os.sched_setaffinity(gateway.pid, gateway_cpus)
        wait_port(gw_port, gateway)
        gw_pid = gateway.pid
        if a.gateway_wrap:  # the wrapper's child is the gateway
            import psutil

            children = psutil.Process(gateway.pid).children(recursive=True)
            gw_pid = next((c.pid for c in children if "gateway" in " ".join(c.cmdline())), gateway.pid)
            if pin:
                for c in psutil.Process(gateway.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        c.cpu_affinity(sorted(gateway_cpus))
        bench = Bench(args=a, upstream_port=up_port, gateway_port=gw_port, gateway_pid=gw_pid,
                      gateway_cpus=sorted(gateway_cpus))
        import psutil

        time.sleep(0.5)
        startup_rss = psutil.Process(gw_pid).memory_info().rss
        if a.attach:
            attached = subprocess.Popen(a.attach.replace("{pid}", str(gw_pid)).split(), cwd=ROOT)
            if pin:
                os.sched_setaffinity(attached.pid, client_cpus)
            time.sleep(1.0)

        async def run() -> None:
            bench.results["translation_check"] = await bench.check_translation()
            steps = {"ttfb": "ttfb_single", "concurrent": "ttfb_concurrent", "throughput": "throughput",
                     "rss": "rss"}
            for name in phases:
                t0 = time.perf_counter()
                print(f"[bench] {name} ...", file=sys.stderr, flush=True)
                await bench.phase(steps[name])
                print(f"[bench] {name} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

        asyncio.run(run())
    finally:
        stop(attached, signal.SIGINT)
        stop(gateway, signal.SIGINT if a.gateway_wrap else signal.SIGTERM)
        stop(upstream)

    rows = evaluate(bench.results)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "pinning": {"client_and_upstream": sorted(client_cpus), "gateway": sorted(gateway_cpus)} if pin else None,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if not k.startswith("_")},
        "targets": TARGETS,
        "startup_rss_mb": round(startup_rss / 2**20, 1),
        "results": bench.results,
        "other_load_on_gateway_cores": bench.contention,
        "verdicts": {row[0]: row[5] for row in rows if row[5] in ("PASS", "MISS")},
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    m = doc["machine"]
    pinning = f"client+upstream cpu{sorted(client_cpus)}, gateway cpu{sorted(gateway_cpus)}" if pin else "off"
    print(f"\nresponses-gateway bench {doc['date']}  {m['cpu']}  nproc={m['nproc']}  Python {m['python']}"
          f"  pinning={pinning}{'  (quick)' if a.quick else ''}")
    print_table(rows)
    print(f"gateway RSS at startup (before any request): {doc['startup_rss_mb']} MB")
    noisy = {k: v for k, v in bench.contention.items() if v > 0.05}
    if noisy:
        print(f"WARNING: other processes used the gateway's core during: "
              f"{', '.join(f'{k} ({v:.0%})' for k, v in noisy.items())}; wall-clock figures are pessimistic "
              f"(CPU us/frame figures much less so). Rerun on a quiet machine.")
    print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
