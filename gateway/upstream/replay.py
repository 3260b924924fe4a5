"""An in-process upstream that replays recorded vLLM cassettes (vcrpy YAML).

Used by ``responses-gateway demo`` (no GPU needed) and by the test suite. It is an httpx transport, so the
gateway talks to it through exactly the code path it uses for a real vLLM. Streams are sent in chunks
(``chunker`` decides the boundaries), because a recorded body in one piece would hide framing bugs.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

__all__ = ["Cassette", "CassetteTransport", "Interaction", "default_cassette_dir", "load_cassette"]

Chunker = Callable[[bytes], Iterable[bytes]]


def default_cassette_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "cassettes"


@dataclass(frozen=True, slots=True)
class Interaction:
    method: str
    path: str
    request_body: dict[str, Any] | None
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def is_stream(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")


@dataclass(frozen=True, slots=True)
class Cassette:
    name: str
    path: Path
    interactions: tuple[Interaction, ...]
    synthesized: bool


def _body_bytes(body: Any) -> bytes:
    if isinstance(body, dict):
        body = body.get("string", "")
    if body is None:
        return b""
    return body if isinstance(body, bytes) else str(body).encode()


def load_cassette(path: Path) -> Cassette:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    interactions = []
    for entry in data.get("interactions", ()):
        req, resp = entry["request"], entry["response"]
        raw = _body_bytes(req.get("body"))
        try:
            req_body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            req_body = None
        headers = {k.lower(): (v[0] if isinstance(v, list) else str(v)) for k, v in (resp.get("headers") or {}).items()}
        interactions.append(Interaction(
            method=str(req.get("method", "POST")).upper(),
            path=httpx.URL(req.get("uri", "/")).path,
            request_body=req_body if isinstance(req_body, dict) else None,
            status=int(resp["status"]["code"]),
            headers=headers,
            body=_body_bytes(resp.get("body")),
        ))
    synthesized = bool(re.search(r"^#.*synthesi[sz]ed", text, re.IGNORECASE | re.MULTILINE))
    return Cassette(path.stem, path, tuple(interactions), synthesized)


def _frames(body: bytes) -> Iterable[bytes]:
    """Default chunking: one SSE frame per chunk, as a server flushing per event sends them."""
    start = 0
    while True:
        end = body.find(b"\n\n", start)
        if end < 0:
            if start < len(body):
                yield body[start:]
            return
        yield body[start : end + 2]
        start = end + 2


class _ChunkStream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


Matcher = Callable[[httpx.Request, dict[str, Any] | None, list[Cassette]], tuple[Interaction, str | None] | None]


@dataclass
class CassetteTransport(httpx.AsyncBaseTransport):
    """Serves recorded interactions.

    With one cassette it answers each request with the next interaction recorded for that method and
    path. With many (the demo) ``matcher`` picks one per request. Every request is kept in ``requests``
    so tests can check what the gateway sent upstream.
    """

    cassettes: list[Cassette]
    chunker: Chunker = _frames
    matcher: Matcher | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    _cursor: dict[tuple[str, str], int] = field(default_factory=dict)

    @classmethod
    def from_files(cls, *paths: Path | str, chunker: Chunker = _frames) -> CassetteTransport:
        return cls([load_cassette(Path(p)) for p in paths], chunker=chunker)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        self.requests.append({"method": request.method, "path": request.url.path,
                              "body": body, "headers": dict(request.headers)})
        found = self._pick(request, body if isinstance(body, dict) else None)
        if found is None:
            return httpx.Response(404, json={"error": {"message": f"No recorded interaction for {request.method} "
                                                      f"{request.url.path}", "type": "NotFoundError",
                                                      "param": None, "code": 404}})
        interaction, rename = found
        payload = interaction.body
        if rename:
            payload = _rename_tool(payload, rename)
        headers = {k: v for k, v in interaction.headers.items()
                   if k not in ("content-length", "transfer-encoding", "content-encoding", "date", "server")}
        if interaction.is_stream:
            return httpx.Response(interaction.status, headers=headers,
                                  stream=_ChunkStream([c for c in self.chunker(payload) if c]))
        # A stream, not content=: httpx reads in-memory content eagerly, and the gateway relays raw bytes.
        return httpx.Response(interaction.status, headers=headers, stream=_ChunkStream([payload] if payload else []))

    def _pick(self, request: httpx.Request, body: dict[str, Any] | None) -> tuple[Interaction, str | None] | None:
        if self.matcher is not None:
            return self.matcher(request, body, self.cassettes)
        key = (request.method, request.url.path)
        candidates = [i for c in self.cassettes for i in c.interactions if (i.method, i.path) == key]
        if not candidates:
            return None
        n = self._cursor.get(key, 0)
        self._cursor[key] = n + 1
        return candidates[min(n, len(candidates) - 1)], None


def _rename_tool(payload: bytes, rename: str) -> bytes:
    old, new = rename.split("\x00", 1)
    return payload.replace(f'"name":"{old}"'.encode(), f'"name":"{new}"'.encode())
