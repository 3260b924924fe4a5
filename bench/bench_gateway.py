"""Benchmark: the gateway's added latency, throughput, CPU and memory against a fast fake vLLM upstream.

One run starts a fake upstream (a raw asyncio HTTP/1.1 server streaming vLLM-framed ``/v1/responses``
SSE for a function call named like the client's custom tool ``apply_patch``, and ``/v1/chat/completions``
SSE whose content is the same patch, for the gateway's constrained steps), starts the gateway with its
default flags as a subprocess in front of it, optionally agentic-api as a peer, and drives the same
streaming workload directly against the upstream and through each gateway with a raw asyncio HTTP/1.1
client. See bench/README.md.

    .venv/bin/python bench/bench_gateway.py            # full run (~2 minutes)
    .venv/bin/python bench/bench_gateway.py --quick    # short run

This is a benchmark, not a test: it prints a table with PASS/MISS against the targets of the issues and
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
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
    "frames_ratio_vs_direct": 0.5,      # >=, translated frames/s through one worker, against direct
    "frames_per_s": 30_000.0,           # >=, and at least this many
    "added_ttfb_p50_ms": 1.0,           # <=, one stream
    "c64_ttfb_vs_peer": 1.5,            # <=, TTFB p50 at 64 streams against agentic-api's
    "peak_rss_mb": 60.0,                # <=, gateway at 200 concurrent streams
    "cpu_per_1k_vs_peer": 2.5,          # <=, gateway CPU seconds per 1000 responses against agentic-api's
    "grammar_cpu_vs_floor": 1.5,        # <=, issue 18: CPU per grammar-tool response against the floor's
    "grammar_added_ttfb_ms": 0.3,       # <=, issue 18: added TTFB p50 at one stream, over the floor's added TTFB
    "fanout_fps_vs_peer": 0.9,          # >=, issue 18: frames/s to 64 clients, upstream back to back, vs agentic-api
}

# Codex's apply_patch grammar (codex-rs, tools/handlers/apply_patch.lark): what Codex sends as the format
# of its freeform `apply_patch` tool.
APPLY_PATCH_LARK = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
_TOOL_DESCRIPTION = "Edit files with a patch. Freeform: write the patch itself, not JSON."
CUSTOM_TOOL = {"type": "custom", "name": "apply_patch", "description": _TOOL_DESCRIPTION,
               "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}}
# The peer (agentic-api) gets the function form of the tool: the call it passes through is the same stream.
FUNCTION_TOOL = {"type": "function", "name": "apply_patch", "description": _TOOL_DESCRIPTION, "strict": True,
                 "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                                "additionalProperties": False}}

REQUEST_BODY = orjson.dumps({"model": "tiny", "stream": True, "store": False, "input": "Fix the bug.",
                             "tools": [CUSTOM_TOOL], "tool_choice": "auto"})
PEER_REQUEST_BODY = orjson.dumps({"model": "tiny", "stream": True, "store": False, "input": "Fix the bug.",
                                  "tools": [FUNCTION_TOOL], "tool_choice": "auto"})


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


_PATCH_HEAD = "*** Begin Patch\n*** Add File: src/caf\u00e9_\U0001F600/module.py\n"
_PATCH_LINES = [
    '+def greet(name: str) -> str:\n',
    '+    """Say "hello" to \\ someone."""\n',
    "+\treturn f\"h\u00e9llo, {name}!\"  # tab, quotes, backslash \\n\n",
    "+PATH = 'C:\\\\tmp\\\\x'  # \u2603 snowman, \U0001F680 rocket\n",
    "+\n",
]
_PATCH_TAIL = "*** End Patch\n"


def _json_len(s: str) -> int:
    return len(json.dumps(s)) - 2


def _cut(text: str, n: int, rnd: random.Random) -> list[str]:
    cuts = sorted(rnd.sample(range(1, len(text)), n - 1)) if n > 1 else []
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@dataclass
class Workload:
    """One upstream answer: the frames vLLM would send on either API and what the client must see as the
    tool input (one valid Codex patch)."""

    n_deltas: int
    head: list[bytes]          # created, in_progress (sent at once)
    added: bytes               # output_item.added
    deltas: list[bytes]        # function_call_arguments.delta frames
    tail: list[bytes]          # arguments.done, output_item.done, response.completed
    chat_head: bytes           # the role chunk
    chat_deltas: list[bytes]   # content chunks (the constrained step's tokens)
    chat_tail: list[bytes]     # finish_reason, usage, [DONE]
    chat_json: bytes           # the same answer, not streamed
    expected_input: str

    @property
    def upstream_frames(self) -> int:
        return len(self.head) + 1 + len(self.deltas) + len(self.tail)


def build_workload(n_deltas: int, seed: int = 7) -> Workload:
    """vLLM-framed SSE (``event: X\\ndata: {json}\\n\\n``, compact JSON, vLLM's key order) for one
    ``apply_patch`` function call whose ``{"input": ...}`` arguments are cut into ``n_deltas`` fragments,
    cut anywhere, escapes (``\\n``, ``\\"``, ``\\\\``, ``\\t``, ``\\u00e9``, surrogate pairs) included; and the
    chat-completions stream of the same patch as ``n_deltas`` content pieces."""
    rnd = random.Random(seed)
    templates = dict(_cassette_frames())
    parts = [_PATCH_HEAD]
    size = _json_len(_PATCH_HEAD) + _json_len(_PATCH_TAIL) + 12
    i = 0
    while size < max(4 * n_deltas, 16) or i < len(_PATCH_LINES):
        line = _PATCH_LINES[i % len(_PATCH_LINES)]
        parts.append(line)
        size += _json_len(line)
        i += 1
    parts.append(_PATCH_TAIL)
    text = "".join(parts)
    args = json.dumps({"input": text})  # ensure_ascii: \\u escapes, surrogate pairs
    fragments = _cut(args, n_deltas, rnd)

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

    # /v1/chat/completions, vLLM's framing: `data: {chunk}\n\n` ... `data: [DONE]\n\n`
    cid, created_at = "chatcmpl-b3nch0000000000", 1795973040

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({"id": cid, "object": "chat.completion.chunk", "created": created_at,
                                         "model": "tiny", "choices": choices, **extra}) + b"\n\n"

    pieces = _cut(text, n_deltas, rnd)
    usage = {"prompt_tokens": 21, "total_tokens": 21 + n_deltas, "completion_tokens": n_deltas}
    chat_json = orjson.dumps({
        "id": cid, "object": "chat.completion", "created": created_at, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                     "logprobs": None, "finish_reason": "stop", "stop_reason": None}], "usage": usage})
    return Workload(
        n_deltas=n_deltas,
        head=[frame("response.created", created), frame("response.in_progress", in_progress)],
        added=frame("response.output_item.added", added),
        deltas=deltas,
        tail=[frame("response.function_call_arguments.done", args_done),
              frame("response.output_item.done", item_done), frame("response.completed", completed)],
        chat_head=chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], prompt_token_ids=None, prompt_text=None),
        chat_deltas=[chunk([{"index": 0, "delta": {"content": p}, "logprobs": None, "finish_reason": None,
                             "token_ids": None}]) for p in pieces],
        chat_tail=[chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                           "token_ids": None}]),
                   chunk([], usage=usage, system_fingerprint="vllm-0.32.0-b3nch"),
                   b"data: [DONE]\n\n"],
        chat_json=chat_json,
        expected_input=text,
    )


# ---------------------------------------------------------------------------------------------- fake upstream

_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 09:00:00 GMT\r\nserver: uvicorn\r\n"
             b"content-type: text/event-stream; charset=utf-8\r\nvary: Origin\r\ntransfer-encoding: chunked\r\n\r\n")
_CHUNKED_END = b"0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class FakeUpstream:
    """Serves ``POST /v1/responses`` and ``POST /v1/chat/completions`` as vLLM does, one HTTP chunk per SSE
    frame (as uvicorn sends them).

    ``POST /_bench/mode`` with ``{"deltas": N, "delay_ms": D, "pacing": "step"|"whole"}`` sets the answer
    served next. Pacing ``step`` (the default) writes every frame on its own (TCP_NODELAY, and the next
    frame only once the socket took the previous one and the loop turned once), so each frame is its own TCP
    segment, as an engine writing per token sends them; with D > 0 the frames after the head go out one
    every D ms. ``whole`` with D == 0 writes the whole stream in one go (as fast as the reader can take it).
    ``GET /_bench/stats`` answers how many connections were accepted and requests served per path.
    """

    def __init__(self) -> None:
        # GET /version: vLLM 0.32 by default, so the gateway enforces the grammar tool in the request itself
        # (issue 18); --upstream-version none answers {} (an upstream it cannot tell: the takeover, 2 requests).
        version = os.environ.get("BENCH_UPSTREAM_VERSION", "0.32.0")
        self.version = b"{}" if version == "none" else orjson.dumps({"version": version})
        self.deltas = 24
        self.delay = 0.0
        self.pacing = "step"
        self.connections = 0
        self.requests: dict[str, int] = {}
        self._workloads: dict[int, Workload] = {}
        self._bulk: dict[tuple[int, str], bytes] = {}

    def workload(self, n: int) -> Workload:
        w = self._workloads.get(n)
        if w is None:
            w = self._workloads[n] = build_workload(n)
            self._bulk[n, "responses"] = _SSE_HEAD + b"".join(
                _chunk(f) for f in [*w.head, w.added, *w.deltas, *w.tail]) + _CHUNKED_END
            self._bulk[n, "chat"] = _SSE_HEAD + b"".join(
                _chunk(f) for f in [w.chat_head, *w.chat_deltas, *w.chat_tail]) + _CHUNKED_END
        return w

    def protocol(self) -> asyncio.Protocol:
        return _UpstreamConn(self)


class _UpstreamConn(asyncio.Protocol):
    def __init__(self, server: FakeUpstream) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # pause_writing() as soon as anything stays buffered: `_flush` then waits for the socket to take it
        self.transport.set_write_buffer_limits(high=0)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    async def _flush(self) -> None:
        """Between two frames: let the socket take the last one, and the loop turn at least once."""
        if self.writable is not None:
            await self.writable
        else:
            await asyncio.sleep(0)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _request(self) -> tuple[list[str], bytes] | None:
        """One complete request (head lines, body) taken off the buffer, or None while it is incomplete."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        length, chunked = 0, False
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        pos = end + 4
        if not chunked:
            if len(self.buf) < pos + length:
                return None
            body = bytes(self.buf[pos:pos + length])
            del self.buf[:pos + length]
            return head, body
        body = bytearray()
        while True:
            eol = self.buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(self.buf[pos:eol]).split(b";")[0], 16)
            if len(self.buf) < eol + 2 + size + 2:
                return None
            body += self.buf[eol + 2:eol + 2 + size]
            pos = eol + 2 + size + 2
            if size == 0:
                del self.buf[:pos]
                return head, bytes(body)

    def _next(self) -> None:
        req = self._request()
        if req is None:
            return
        head, body = req
        method, path = head[0].split(" ")[:2]
        srv = self.server
        srv.requests[path] = srv.requests.get(path, 0) + 1
        if method == "POST" and path == "/_bench/mode":
            mode = orjson.loads(body)
            srv.deltas = int(mode["deltas"])
            srv.delay = float(mode["delay_ms"]) / 1000
            srv.pacing = str(mode.get("pacing", srv.pacing))
            srv.workload(srv.deltas)
            self._reply(b"{}")
        elif path == "/_bench/stats":
            self._reply(orjson.dumps({"connections": srv.connections, "requests": srv.requests}))
        elif method == "POST" and path.endswith("/chat/completions"):
            try:
                streamed = bool(orjson.loads(body).get("stream"))
            except (orjson.JSONDecodeError, AttributeError):
                streamed = False
            if streamed:
                self._stream("chat")
            else:
                self._reply(srv.workload(srv.deltas).chat_json)
        elif method == "POST" and path.endswith("/responses"):
            self._stream("responses")
        elif path == "/version":
            self._reply(srv.version)
        elif path.endswith("/models"):
            self._reply(b'{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"vllm"}]}')
        else:
            self._reply(b"{}")

    def _reply(self, payload: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(payload), payload))
        self._next()

    def _stream(self, api: str) -> None:
        srv = self.server
        w = srv.workload(srv.deltas)
        assert self.transport is not None
        if srv.delay <= 0 and srv.pacing == "whole":
            self.transport.write(srv._bulk[w.n_deltas, api])
            self._next()
            return
        self.busy = True
        if api == "chat":
            head, body, tail = [w.chat_head], w.chat_deltas, w.chat_tail
        else:
            head, body, tail = w.head, [w.added, *w.deltas], w.tail
        asyncio.get_running_loop().create_task(self._paced(head, body, tail, srv.delay))

    async def _paced(self, head: list[bytes], body: list[bytes], tail: list[bytes], delay: float) -> None:
        t = self.transport
        assert t is not None
        try:
            if delay > 0:  # a model's token rate: the head at once, then one frame every `delay` seconds
                t.write(_SSE_HEAD + b"".join(_chunk(f) for f in head))
                for frame in body:
                    await asyncio.sleep(delay)
                    if t.is_closing():
                        return
                    t.write(_chunk(frame))
                await asyncio.sleep(delay)
                t.write(b"".join(_chunk(f) for f in tail) + _CHUNKED_END)
            else:  # step: every frame its own segment, as fast as the reader takes them
                t.write(_SSE_HEAD)
                for frame in [*head, *body, *tail]:
                    t.write(_chunk(frame))
                    await self._flush()
                    if t.is_closing():
                        return
                t.write(_CHUNKED_END)
        finally:
            self.busy = False
        if not t.is_closing():
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)


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
class Target:
    """Where a workload is sent: ``direct`` (the fake upstream itself), ``gateway`` or ``agentic`` (the peer)."""

    name: str
    port: int
    body: bytes
    pid: int | None = None  # the proxy's process (CPU and RSS are read from it and its children)

    def procs(self) -> list[Any]:
        import psutil

        if self.pid is None:
            return []
        try:
            p = psutil.Process(self.pid)
            return [p, *p.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu(self) -> tuple[float, float]:
        """(user+system, user) CPU seconds of the proxy so far."""
        import psutil

        total = user = 0.0
        for p in self.procs():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
                user += t.user
        return total, user

    def rss(self) -> int:
        import psutil

        out = 0
        for p in self.procs():
            with contextlib.suppress(psutil.Error):
                out += p.memory_info().rss
        return out


@dataclass
class Bench:
    args: argparse.Namespace
    upstream_port: int
    targets: list[Target]
    proxy_cpus: list[int] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    contention: dict[str, float] = field(default_factory=dict)

    @property
    def proxies(self) -> list[Target]:
        return [t for t in self.targets if t.pid is not None]

    def target(self, name: str) -> Target:
        return next(t for t in self.targets if t.name == name)

    async def _upstream_call(self, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        conn = await connect(self.upstream_port)
        try:
            raw = (http_request(self.upstream_port, path, orjson.dumps(payload)) if payload is not None else
                   b"GET %b HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n" % path.encode())
            res = await conn.request(raw, keep_body=True)
            assert res.ok and res.body is not None, res
            return orjson.loads(res.body)
        finally:
            assert conn.transport is not None
            conn.transport.close()

    async def set_mode(self, deltas: int, delay_ms: float) -> None:
        await self._upstream_call("/_bench/mode", {"deltas": deltas, "delay_ms": delay_ms,
                                                   "pacing": self.args.pacing})

    async def upstream_connections(self) -> int:
        return int((await self._upstream_call("/_bench/stats"))["connections"]) - 1  # less the stats call's own

    async def one(self, conn: ClientConn, t: Target, keep_body: bool = False) -> Result:
        res = await conn.request(http_request(t.port, "/v1/responses", t.body), keep_body=keep_body)
        if not res.ok:
            detail = f": {res.body[:300]!r}" if res.body else ""
            raise RuntimeError(f"HTTP {res.status} from {t.name}{detail}")
        return res

    # -- correctness: the gateway really translates (checked once, untimed)

    async def check_translation(self) -> dict[str, Any]:
        deltas = 300
        await self.set_mode(deltas, 0)
        w = build_workload(deltas)
        out: dict[str, Any] = {"upstream_frames": w.upstream_frames}
        for t in self.proxies:
            conn = await connect(t.port)
            res = await self.one(conn, t, keep_body=True)
            self._close(conn)
            assert res.body is not None
            events = []
            for block in res.body.split(b"\n\n"):
                if b"\ndata: " in block:
                    events.append(orjson.loads(block.split(b"\ndata: ", 1)[1]))
            types = [e["type"] for e in events]
            seqs = [e["sequence_number"] for e in events]
            output = events[-1]["response"]["output"] if types and "response" in events[-1] else []
            if t.name == "gateway":
                pieces = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
                done = [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"]
                ok = ("".join(pieces) == w.expected_input and done == [w.expected_input]
                      and types[-1] == "response.completed" and seqs == list(range(len(seqs)))
                      and [i["type"] for i in output] == ["custom_tool_call"])
                out["gateway"] = {"client_frames": len(events), "custom_deltas": len(pieces), "ok": ok}
            else:  # the peer passes the function call through
                args = [i.get("arguments") for i in output if i.get("type") == "function_call"]
                ok = types[-1] == "response.completed" and len(args) == 1 and \
                    orjson.loads(args[0])["input"] == w.expected_input
                out[t.name] = {"client_frames": len(events), "ok": ok}
            if not ok:
                raise RuntimeError(f"{t.name} did not answer the stream as expected: {types[:6]}...{types[-3:]}")
        return out

    # -- added TTFB, one stream at a time

    async def ttfb_single(self) -> None:
        a = self.args
        await self.set_mode(a.ttfb_deltas, a.ttfb_delay_ms)
        out: dict[str, Any] = {"requests": a.requests, "deltas": a.ttfb_deltas, "delay_ms": a.ttfb_delay_ms}
        for t in self.targets:
            conn = await connect(t.port)
            for _ in range(a.warmup):
                await self.one(conn, t)
            ttfbs, totals = [], []
            conns0 = await self.upstream_connections()
            cpu0, user0 = t.cpu()
            for _ in range(a.requests):
                res = await self.one(conn, t)
                ttfbs.append(res.ttfb)
                totals.append(res.total)
            cpu1, user1 = t.cpu()
            conns = await self.upstream_connections() - conns0
            self._close(conn)
            r = out[t.name] = {"ttfb_p50_ms": ms(pct(ttfbs, 50)), "ttfb_p99_ms": ms(pct(ttfbs, 99)),
                               "ttfb_mean_ms": ms(statistics.fmean(ttfbs)), "total_p50_ms": ms(pct(totals, 50)),
                               "upstream_connections_opened": conns}
            if t.pid is not None:
                r["cpu_ms_per_request"] = round((cpu1 - cpu0) / a.requests * 1000, 3)
                r["user_ms_per_request"] = round((user1 - user0) / a.requests * 1000, 3)
                r["added_ttfb_p50_ms"] = round(r["ttfb_p50_ms"] - out["direct"]["ttfb_p50_ms"], 3)
                r["added_ttfb_p99_ms"] = round(r["ttfb_p99_ms"] - out["direct"]["ttfb_p99_ms"], 3)
        self.results["ttfb_single"] = out

    # -- issue 18's workload: default flags, a Lark custom tool, short and long responses, beside the floor

    async def grammar(self) -> None:
        a = self.args
        out: dict[str, Any] = {"requests": a.requests, "delay_ms": a.ttfb_delay_ms}
        for deltas in (24, 200):
            await self.set_mode(deltas, a.ttfb_delay_ms)
            per: dict[str, Any] = {}
            out[str(deltas)] = per
            for t in self.targets:
                conn = await connect(t.port)
                for _ in range(a.warmup):
                    await self.one(conn, t)
                stats0 = await self._upstream_call("/_bench/stats")
                cpu0, _ = t.cpu()
                ttfbs = []
                for _ in range(a.requests):
                    ttfbs.append((await self.one(conn, t)).ttfb)
                cpu1, _ = t.cpu()
                stats1 = await self._upstream_call("/_bench/stats")
                self._close(conn)
                generation = sum(v - stats0["requests"].get(k, 0) for k, v in stats1["requests"].items()
                                 if k.endswith(("/responses", "/chat/completions")))
                r = per[t.name] = {"ttfb_p50_ms": ms(pct(ttfbs, 50)),
                                   "upstream_requests_per_response": round(generation / a.requests, 3),
                                   "upstream_connections_opened": stats1["connections"] - stats0["connections"] - 1}
                if t.pid is not None:
                    r["cpu_ms_per_response"] = round((cpu1 - cpu0) / a.requests * 1000, 3)
                    r["added_ttfb_p50_ms"] = round(r["ttfb_p50_ms"] - per["direct"]["ttfb_p50_ms"], 3)
        self.results["grammar"] = out

    # -- TTFB with 64 streams open at once

    async def ttfb_concurrent(self) -> None:
        a = self.args
        c = a.concurrency
        await self.set_mode(a.c_deltas, a.c_delay_ms)
        stream_s = (a.c_deltas + 2) * a.c_delay_ms / 1000
        out: dict[str, Any] = {"streams": c, "rounds": a.rounds, "deltas": a.c_deltas, "delay_ms": a.c_delay_ms}
        for t in self.targets:
            conns = await asyncio.gather(*(connect(t.port) for _ in range(c)))
            await asyncio.gather(*(self.one(conn, t) for conn in conns))  # warm every connection

            # burst: all streams start at the same instant
            burst = await asyncio.gather(*(self.one(conn, t) for conn in conns))
            b_ttfb = [r.ttfb for r in burst]

            # sustained: `c` closed-loop workers, starts spread over one stream duration, so `c` streams
            # are open at any time and new requests arrive while the others stream
            ttfbs: list[float] = []
            frames = 0
            cpu0, user0 = t.cpu()
            t0 = time.perf_counter()

            async def worker(i: int, conn: ClientConn, t: Target = t, ttfbs: list[float] = ttfbs) -> None:
                nonlocal frames
                await asyncio.sleep(stream_s * i / c)
                for _ in range(a.rounds):
                    res = await self.one(conn, t)
                    ttfbs.append(res.ttfb)
                    frames += res.frames

            await asyncio.gather(*(worker(i, conn) for i, conn in enumerate(conns)))
            wall = time.perf_counter() - t0
            cpu1, user1 = t.cpu()
            for conn in conns:
                self._close(conn)
            r = out[t.name] = {"ttfb_p50_ms": ms(pct(ttfbs, 50)), "ttfb_p99_ms": ms(pct(ttfbs, 99)),
                               "burst_ttfb_p50_ms": ms(pct(b_ttfb, 50)), "burst_ttfb_p99_ms": ms(pct(b_ttfb, 99)),
                               "frames_per_s": round(frames / wall), "requests": len(ttfbs)}
            if t.pid is not None:
                cpu, user = cpu1 - cpu0, user1 - user0
                r["cpu_util"] = round(cpu / wall, 3)
                r["cpu_us_per_frame"] = round(cpu / frames * 1e6, 2)
                r["user_us_per_frame"] = round(user / frames * 1e6, 2)
                r["cpu_s_per_1000_responses"] = round(cpu / len(ttfbs) * 1000, 3)
        self.results["ttfb_concurrent"] = out

    # -- frames per second, one long stream written as fast as the proxy reads it

    async def fanout(self) -> None:
        """Issue 18: frames/s delivered to ``concurrency`` clients at once while the upstream writes every stream's
        frames back to back (one per TCP segment, no pacing delay): the proxy's aggregate throughput."""
        a = self.args
        c = a.concurrency
        await self.set_mode(a.fanout_deltas, 0)
        out: dict[str, Any] = {"streams": c, "deltas": a.fanout_deltas, "rounds": a.rounds}
        for t in self.targets:
            conns = await asyncio.gather(*(connect(t.port) for _ in range(c)))
            await asyncio.gather(*(self.one(conn, t) for conn in conns))  # warm every connection
            counts: list[int] = []
            cpu0, _ = t.cpu()
            t0 = time.perf_counter()

            async def worker(conn: ClientConn, t: Target = t, counts: list[int] = counts) -> None:
                for _ in range(a.rounds):
                    res = await self.one(conn, t)
                    counts.append(res.frames)

            await asyncio.gather(*(worker(conn) for conn in conns))
            wall = time.perf_counter() - t0
            cpu1, _ = t.cpu()
            for conn in conns:
                self._close(conn)
            frames = sum(counts)
            r = out[t.name] = {"frames_per_s": round(frames / wall), "frames": frames, "wall_s": round(wall, 3)}
            if t.pid is not None:
                r["cpu_us_per_frame"] = round((cpu1 - cpu0) / frames * 1e6, 2)
        self.results["fanout"] = out

    async def throughput(self) -> None:
        a = self.args
        await self.set_mode(a.deltas, 0)
        out: dict[str, Any] = {"deltas": a.deltas, "repeats": a.repeats, "pacing": a.pacing}
        for t in self.targets:
            conn = await connect(t.port)
            await self.one(conn, t)  # warm-up (and the upstream builds the stream)
            best: dict[str, Any] | None = None
            cpu0, user0 = t.cpu()
            frames = 0
            for _ in range(a.repeats):
                res = await self.one(conn, t)
                frames += res.frames
                fps = res.frames / res.total
                if best is None or fps > best["frames_per_s"]:
                    best = {"frames_per_s": round(fps), "frames": res.frames, "wall_s": round(res.total, 4),
                            "mb_per_s": round(res.body_bytes / res.total / 1e6, 2)}
            assert best is not None
            if t.pid is not None:  # CPU over all repeats: /proc's clock ticks are 10 ms
                cpu1, user1 = t.cpu()
                best["cpu_us_per_frame"] = round((cpu1 - cpu0) / frames * 1e6, 2)
                best["user_us_per_frame"] = round((user1 - user0) / frames * 1e6, 2)
            self._close(conn)
            out[t.name] = best
        self.results["throughput"] = out

    # -- peak RSS with 200 streams open

    async def rss(self) -> None:
        a = self.args
        await self.set_mode(a.rss_deltas, a.rss_delay_ms)
        out: dict[str, Any] = {"streams": a.rss_streams, "deltas": a.rss_deltas, "delay_ms": a.rss_delay_ms}
        for t in self.proxies:
            idle = t.rss()
            peak = [idle]
            sampling = asyncio.Event()

            async def sample(t: Target = t, peak: list[int] = peak, sampling: asyncio.Event = sampling) -> None:
                while not sampling.is_set():
                    peak[0] = max(peak[0], t.rss())
                    await asyncio.sleep(0.005)

            sampler = asyncio.get_running_loop().create_task(sample())
            conns = await asyncio.gather(*(connect(t.port) for _ in range(a.rss_streams)))
            t0 = time.perf_counter()
            cpu0, user0 = t.cpu()
            results = await asyncio.gather(*(self.one(conn, t) for conn in conns))
            wall = time.perf_counter() - t0
            cpu1, user1 = t.cpu()
            sampling.set()
            await sampler
            for conn in conns:
                self._close(conn)
            await asyncio.sleep(0.2)
            frames = sum(r.frames for r in results)
            ttfbs = [r.ttfb for r in results]
            out[t.name] = {
                "idle_rss_mb": round(idle / 2**20, 1), "peak_rss_mb": round(peak[0] / 2**20, 1),
                "after_rss_mb": round(t.rss() / 2**20, 1),
                "ttfb_p50_ms": ms(pct(ttfbs, 50)), "ttfb_p99_ms": ms(pct(ttfbs, 99)),
                "frames_per_s": round(frames / wall), "cpu_util": round((cpu1 - cpu0) / wall, 3),
                "cpu_us_per_frame": round((cpu1 - cpu0) / frames * 1e6, 2),
                "user_us_per_frame": round((user1 - user0) / frames * 1e6, 2),
            }
        self.results["rss"] = out

    def _other_load(self) -> tuple[float, float]:
        """(busy seconds of the proxies' cores, the proxies' CPU seconds): their difference over a phase is
        CPU time other processes took from those cores (a shared machine is a noisy one)."""
        import psutil

        per = psutil.cpu_times(percpu=True)
        busy = sum(per[c].user + per[c].system + per[c].nice + per[c].irq + per[c].softirq
                   for c in self.proxy_cpus if c < len(per))
        return busy, sum(t.cpu()[0] for t in self.proxies)

    async def phase(self, name: str) -> None:
        busy0, cpu0 = self._other_load()
        t0 = time.perf_counter()
        await getattr(self, name)()
        wall = time.perf_counter() - t0
        busy1, cpu1 = self._other_load()
        other = max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / wall / max(1, len(self.proxy_cpus))
        self.contention[name] = round(other, 3)

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


# metric, direct, gateway, floor, agentic, ratio/added, target, verdict
Row = tuple[str, str, str, str, str, str, str, str]


def evaluate(r: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []

    def get(phase: str, name: str, key: str) -> float | None:
        v = r.get(phase, {}).get(name, {}).get(key)
        return float(v) if isinstance(v, int | float) else None

    def fmt(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else "PASS" if ok else "MISS"

    def cols(phase: str, key: str, spec: str = ".3f", direct: bool = True) -> tuple[str, str, str, str]:
        """direct, gateway, floor, agentic."""
        return (fmt(get(phase, "direct", key), spec) if direct else "-",
                *(fmt(get(phase, n, key), spec) for n in ("gateway", "floor", "agentic")))  # type: ignore[return-value]

    T = TARGETS
    if "throughput" in r:
        d, g = get("throughput", "direct", "frames_per_s"), get("throughput", "gateway", "frames_per_s")
        ratio = g / d if g and d else None
        ok = None if ratio is None or g is None else ratio >= T["frames_ratio_vs_direct"] and g >= T["frames_per_s"]
        rows.append((f"frames/s, 1 long stream ({r['throughput']['pacing']})",
                     *cols("throughput", "frames_per_s", ",.0f"),
                     f"x{ratio:.3f} direct" if ratio else "-",
                     f">= {T['frames_ratio_vs_direct']:g}x direct, >= {T['frames_per_s']:,.0f}", verdict(ok)))
        rows.append(("CPU us/frame, long stream", *cols("throughput", "cpu_us_per_frame", ".1f", False), "-", "-",
                     "info"))
    if "fanout" in r:
        f = r["fanout"]
        g, p = get("fanout", "gateway", "frames_per_s"), get("fanout", "agentic", "frames_per_s")
        ratio = g / p if g and p else None
        rows.append((f"frames/s, {f['streams']} streams back to back ({f['deltas']} deltas)",
                     *cols("fanout", "frames_per_s", ",.0f"), f"x{ratio:.3f} agentic" if ratio else "-",
                     f">= {T['fanout_fps_vs_peer']:g}x agentic",
                     verdict(None if ratio is None else ratio >= T["fanout_fps_vs_peer"])))
        rows.append((f"CPU us/frame ({f['streams']} back to back)", *cols("fanout", "cpu_us_per_frame", ".1f", False),
                     "-", "-", "info"))
    if "ttfb_single" in r:
        t = r["ttfb_single"]
        added = get("ttfb_single", "gateway", "added_ttfb_p50_ms")
        rows.append(("TTFB p50, 1 stream (ms)", *cols("ttfb_single", "ttfb_p50_ms"),
                     f"+{added:.3f}" if added is not None else "-", f"added <= {T['added_ttfb_p50_ms']:g}",
                     verdict(None if added is None else added <= T["added_ttfb_p50_ms"])))
        rows.append(("TTFB p99, 1 stream (ms)", *cols("ttfb_single", "ttfb_p99_ms"), "-", "-", "info"))
        rows.append((f"CPU ms/request, 1 stream ({t['deltas']} deltas)",
                     *cols("ttfb_single", "cpu_ms_per_request", ".2f", False), "-", "-", "info"))
        rows.append((f"upstream connections opened, {t['requests']} sequential",
                     *cols("ttfb_single", "upstream_connections_opened", ".0f", False), "-", "-", "info"))
    for deltas, per in (r.get("grammar") or {}).items():
        if not isinstance(per, dict):
            continue

        def g(name: str, key: str, per: dict[str, Any] = per) -> float | None:
            v = per.get(name, {}).get(key)
            return float(v) if isinstance(v, int | float) else None

        def four(key: str, spec: str, direct: bool = True) -> tuple[str, str, str, str]:
            return (fmt(g("direct", key), spec) if direct else "-",
                    *(fmt(g(n, key), spec) for n in ("gateway", "floor", "agentic")))  # type: ignore[return-value]

        gw, fl = g("gateway", "cpu_ms_per_response"), g("floor", "cpu_ms_per_response")
        ratio = gw / fl if gw is not None and fl else None
        rows.append((f"grammar tool, {deltas} deltas: CPU ms/response", *four("cpu_ms_per_response", ".2f", False),
                     f"x{ratio:.2f} floor" if ratio else "-", f"<= {T['grammar_cpu_vs_floor']:g}x floor",
                     verdict(None if ratio is None else ratio <= T["grammar_cpu_vs_floor"])))
        gw, fl = g("gateway", "added_ttfb_p50_ms"), g("floor", "added_ttfb_p50_ms")
        ok = None if gw is None or fl is None else gw <= fl + T["grammar_added_ttfb_ms"]
        rows.append((f"grammar tool, {deltas} deltas: TTFB p50 (ms)", *four("ttfb_p50_ms", ".3f"),
                     f"+{gw:.3f} (floor +{fl:.3f})" if gw is not None and fl is not None else "-",
                     f"added <= floor's + {T['grammar_added_ttfb_ms']:g}", verdict(ok)))
        rows.append((f"grammar tool, {deltas} deltas: upstream requests/response",
                     *four("upstream_requests_per_response", ".2f", False), "-", "1 (one request)",
                     verdict(None if g("gateway", "upstream_requests_per_response") is None else
                             g("gateway", "upstream_requests_per_response") == 1.0)))
        rows.append((f"grammar tool, {deltas} deltas: upstream connections opened",
                     *four("upstream_connections_opened", ".0f", False), "-", "<= 8", verdict(
                         None if g("gateway", "upstream_connections_opened") is None else
                         (g("gateway", "upstream_connections_opened") or 0) <= 8)))
    if "ttfb_concurrent" in r:
        c = r["ttfb_concurrent"]["streams"]
        g, p = (get("ttfb_concurrent", n, "ttfb_p50_ms") for n in ("gateway", "agentic"))
        ratio = g / p if g is not None and p else None
        rows.append((f"TTFB p50, {c} concurrent (ms)", *cols("ttfb_concurrent", "ttfb_p50_ms"),
                     f"x{ratio:.2f} agentic" if ratio else "-", f"<= {T['c64_ttfb_vs_peer']:g}x agentic",
                     verdict(None if ratio is None else ratio <= T["c64_ttfb_vs_peer"])))
        rows.append((f"TTFB p99, {c} concurrent (ms)", *cols("ttfb_concurrent", "ttfb_p99_ms"), "-", "-", "info"))
        rows.append((f"TTFB p50, {c} burst (ms)", *cols("ttfb_concurrent", "burst_ttfb_p50_ms"), "-", "-", "info"))
        g, p = (get("ttfb_concurrent", n, "cpu_s_per_1000_responses") for n in ("gateway", "agentic"))
        ratio = g / p if g is not None and p else None
        rows.append((f"CPU s per 1000 responses ({c} paced)",
                     *cols("ttfb_concurrent", "cpu_s_per_1000_responses", ".2f", False),
                     f"x{ratio:.2f} agentic" if ratio else "-", f"<= {T['cpu_per_1k_vs_peer']:g}x agentic",
                     verdict(None if ratio is None else ratio <= T["cpu_per_1k_vs_peer"])))
        rows.append((f"CPU us/frame ({c} paced)", *cols("ttfb_concurrent", "cpu_us_per_frame", ".1f", False), "-", "-",
                     "info"))
    if "rss" in r:
        s = r["rss"]["streams"]
        g = get("rss", "gateway", "peak_rss_mb")
        rows.append((f"peak RSS, {s} streams (MB)", *cols("rss", "peak_rss_mb", ".1f", False),
                     f"idle {fmt(get('rss', 'gateway', 'idle_rss_mb'), '.1f')}", f"<= {T['peak_rss_mb']:g}",
                     verdict(None if g is None else g <= T["peak_rss_mb"])))
        rows.append((f"CPU us/frame ({s} paced)", *cols("rss", "cpu_us_per_frame", ".1f", False), "-", "-", "info"))
    return rows


def print_table(rows: list[Row]) -> None:
    header = ("metric", "direct", "gateway", "floor", "agentic", "ratio/added", "target", "")
    widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)

    def show(row: tuple[str, ...]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    print(line)
    print(show(header))
    print(line)
    for row in rows:
        print(show(row))
    print(line)


# ---------------------------------------------------------------------------------------------- main


def find_peer(path: str | None) -> str | None:
    if path == "none":
        return None
    for candidate in (path, shutil.which("agentic-server"), "/tmp/agentic-venv/bin/agentic-server"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run (fewer requests, shorter streams)")
    p.add_argument("--phases", default="ttfb,grammar,concurrent,fanout,rss,throughput",
                   help="comma-separated subset of: ttfb, grammar (issue 18: a Lark custom tool, 24 and 200 deltas, "
                        "beside the floor), concurrent, fanout (issue 18: 64 streams, the upstream writing back to "
                        "back), rss, throughput (in this order by default: the "
                        "long throughput stream runs last so that its allocations do not inflate the RSS phase)")
    p.add_argument("--pacing", default="step", choices=("step", "whole"),
                   help="how the fake upstream writes an unpaced stream: step (default: one frame per TCP segment, "
                        "as an engine writes per token) or whole (the whole stream in one write)")
    p.add_argument("--requests", type=int, help="sequential single-stream requests (default 200; quick 50)")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests first")
    p.add_argument("--ttfb-deltas", type=int, default=24, help="argument deltas per single-stream request")
    p.add_argument("--ttfb-delay-ms", type=float, default=1.0, help="upstream ms between frames after the head")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--fanout-deltas", type=int, help="deltas per stream in the fanout phase (default 200; quick 100)")
    p.add_argument("--rounds", type=int, help="requests per concurrent worker (default 4; quick 2)")
    p.add_argument("--c-deltas", type=int, default=40)
    p.add_argument("--c-delay-ms", type=float, default=10.0, help="10 ms: 100 tokens/s per stream")
    p.add_argument("--deltas", type=int, help="argument deltas in the throughput stream (default 20000; quick 5000)")
    p.add_argument("--repeats", type=int, help="throughput repeats, best kept (default 5; quick 3)")
    p.add_argument("--rss-streams", type=int, default=200)
    p.add_argument("--rss-deltas", type=int, help="deltas per stream in the RSS phase (default 100; quick 50)")
    p.add_argument("--rss-delay-ms", type=float, default=10.0)
    p.add_argument("--no-pin", action="store_true", help="do not pin client+upstream and the proxies to cores")
    p.add_argument("--gateway-wrap", default="",
                   help="command prefix for the gateway, e.g. 'py-spy record -o prof.svg --' (profiling)")
    p.add_argument("--enforcement", default=None, choices=("off", "validate", "constrain"),
                   help="gateway --tool-choice-enforcement (default: the gateway's default, constrain)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for `gateway serve`")
    p.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for the gateway (e.g. PYTHONPATH=/tmp/uvlibs to try uvloop)")
    p.add_argument("--gateway-root", type=Path, default=ROOT,
                   help="directory holding the gateway package to run (A/B runs against a scratch copy)")
    p.add_argument("--peer", default=None,
                   help="agentic-server executable for the peer column (default: agentic-server on PATH or in "
                        "/tmp/agentic-venv; 'none' skips the peer)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the floor column (bench/thin_proxy.py: the thinnest proxy on the gateway's own stack)")
    p.add_argument("--attach", default="",
                   help="command started once the gateway is up ({pid}: the gateway's pid) and stopped with SIGINT "
                        "after the phases, e.g. 'py-spy record --pid {pid} -r 500 -f speedscope -o prof.json'")
    p.add_argument("--upstream-version", default="0.32.0",
                   help="what the fake upstream's GET /version says: a vLLM version (0.32.0: the gateway enforces "
                        "a grammar tool in one request) or 'none' (answers {}: the takeover, as before issue 18)")
    p.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    p.add_argument("--_upstream", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    a.requests = a.requests or (50 if q else 200)
    a.rounds = a.rounds or (2 if q else 4)
    a.deltas = a.deltas or (5000 if q else 20000)
    a.fanout_deltas = a.fanout_deltas or (100 if q else 200)
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
    client_cpus, proxy_cpus = ({cpus[0]}, {cpus[1]}) if pin else (set(cpus), set(cpus))
    if pin:
        os.sched_setaffinity(0, client_cpus)  # the fake upstream inherits it
    peer = find_peer(a.peer)

    up_port, gw_port, peer_port, floor_port = free_port(), free_port(), free_port(), free_port()
    upstream = gateway = agentic = floor = attached = None
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_UPSTREAM_VERSION=a.upstream_version)
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    logs = a.json.parent
    logs.mkdir(parents=True, exist_ok=True)
    try:
        upstream = subprocess.Popen([sys.executable, __file__, "--_upstream", str(up_port)], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE)
        wait_port(up_port, upstream)
        # The gateway's default flags: enforcement constrain, a SQLite store (in a scratch folder), info logs.
        cmd = [*a.gateway_wrap.split(), sys.executable, "-m", "gateway", "serve",
               "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(gw_port),
               "--store", f"sqlite:///{tmp / 'gateway.db'}",
               *(["--tool-choice-enforcement", a.enforcement] if a.enforcement else []), *a.gateway_arg]
        gw_env = dict(env, **dict(kv.split("=", 1) for kv in a.gateway_env))
        gw_log = (logs / "gateway.log").open("wb")
        gateway = subprocess.Popen(cmd, cwd=a.gateway_root, env=gw_env, stdout=gw_log, stderr=subprocess.STDOUT)
        if pin:
            os.sched_setaffinity(gateway.pid, proxy_cpus)
        wait_port(gw_port, gateway)
        gw_pid = gateway.pid
        if a.gateway_wrap:  # the wrapper's child is the gateway
            import psutil

            children = psutil.Process(gateway.pid).children(recursive=True)
            gw_pid = next((c.pid for c in children if "gateway" in " ".join(c.cmdline())), gateway.pid)
            if pin:
                for c in psutil.Process(gateway.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        c.cpu_affinity(sorted(proxy_cpus))
        targets = [Target("direct", up_port, REQUEST_BODY), Target("gateway", gw_port, REQUEST_BODY, gw_pid)]
        if not a.no_floor:
            floor = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "thin_proxy.py"), "--llm-api-base", f"http://127.0.0.1:{up_port}/v1",
                 "--gateway-port", str(floor_port)], cwd=ROOT, env=env, stdout=(logs / "floor.log").open("wb"),
                stderr=subprocess.STDOUT)
            if pin:
                os.sched_setaffinity(floor.pid, proxy_cpus)
            wait_port(floor_port, floor)
            targets.append(Target("floor", floor_port, PEER_REQUEST_BODY, floor.pid))
        if peer:
            agentic = subprocess.Popen(
                [peer, "--llm-api-base", f"http://127.0.0.1:{up_port}/v1", "--gateway-host", "127.0.0.1",
                 "--gateway-port", str(peer_port), "--db-url", f"sqlite://{tmp / 'agentic.db'}"],
                cwd=tmp, env=dict(env, HOME=str(tmp)), stdout=(logs / "agentic.log").open("wb"),
                stderr=subprocess.STDOUT)
            if pin:
                os.sched_setaffinity(agentic.pid, proxy_cpus)
            wait_port(peer_port, agentic)
            targets.append(Target("agentic", peer_port, PEER_REQUEST_BODY, agentic.pid))
        else:
            print("[bench] no agentic-server found: the peer column is skipped (see bench/README.md)",
                  file=sys.stderr)
        bench = Bench(args=a, upstream_port=up_port, targets=targets, proxy_cpus=sorted(proxy_cpus))

        time.sleep(0.5)
        startup_rss = {t.name: round(t.rss() / 2**20, 1) for t in bench.proxies}
        if a.attach:
            attached = subprocess.Popen(a.attach.replace("{pid}", str(gw_pid)).split(), cwd=ROOT)
            if pin:
                os.sched_setaffinity(attached.pid, client_cpus)
            time.sleep(1.0)

        async def run() -> None:
            bench.results["translation_check"] = await bench.check_translation()
            steps = {"ttfb": "ttfb_single", "grammar": "grammar", "concurrent": "ttfb_concurrent",
                     "fanout": "fanout", "throughput": "throughput", "rss": "rss"}
            for name in phases:
                t0 = time.perf_counter()
                print(f"[bench] {name} ...", file=sys.stderr, flush=True)
                await bench.phase(steps[name])
                print(f"[bench] {name} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

        asyncio.run(run())
    finally:
        stop(attached, signal.SIGINT)
        stop(gateway, signal.SIGINT if a.gateway_wrap else signal.SIGTERM)
        stop(agentic, signal.SIGINT)
        stop(floor, signal.SIGINT)
        stop(upstream)
        shutil.rmtree(tmp, ignore_errors=True)

    rows = evaluate(bench.results)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "pinning": {"client_and_upstream": sorted(client_cpus), "proxies": sorted(proxy_cpus)} if pin else None,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if not k.startswith("_")},
        "peer": peer,
        "targets": TARGETS,
        "startup_rss_mb": startup_rss,
        "results": bench.results,
        "other_load_on_proxy_cores": bench.contention,
        "verdicts": {row[0]: row[7] for row in rows if row[7] in ("PASS", "MISS")},
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    m = doc["machine"]
    pinning = f"client+upstream cpu{sorted(client_cpus)}, proxies cpu{sorted(proxy_cpus)}" if pin else "off"
    print(f"\nresponses-gateway bench {doc['date']}  {m['cpu']}  nproc={m['nproc']}  Python {m['python']}"
          f"  pacing={a.pacing}  pinning={pinning}{'  (quick)' if a.quick else ''}")
    print_table(rows)
    print(f"RSS at startup (before any request): {startup_rss} MB")
    noisy = {k: v for k, v in bench.contention.items() if v > 0.05}
    if noisy:
        print(f"WARNING: other processes used the proxies' core during: "
              f"{', '.join(f'{k} ({v:.0%})' for k, v in noisy.items())}; wall-clock figures are pessimistic "
              f"(CPU figures much less so). Rerun on a quiet machine.")
    print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
