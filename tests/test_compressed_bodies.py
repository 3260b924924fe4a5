"""Compressed request bodies (``Content-Encoding: zstd | gzip | deflate | br``) through a real gateway.

The gateway decodes the bodies it parses (POST /v1/responses) as a stream with the output capped at
``--max-body-bytes`` (a decompression bomb is a 413 after at most that much output), and passes proxied
bodies through untouched, compressed, with their Content-Encoding.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import struct
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import brotli
import httpx
import orjson
import pytest
import zstandard

from tests.support import replay, running_gateway

BODY = {"model": "tiny", "store": False, "max_output_tokens": 48, "input": "Say hello."}
PLAIN = orjson.dumps(BODY)
MiB = 1024 * 1024


def zstd_stream(data: bytes) -> bytes:
    """Like Codex CLI: level 3, streamed, so the frame carries no content size."""
    obj = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    return obj.compress(data) + obj.flush()


def deflate_raw(data: bytes) -> bytes:
    obj = zlib.compressobj(6, zlib.DEFLATED, -15)
    return obj.compress(data) + obj.flush()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "zstd": zstd_stream,
    "gzip": lambda d: zlib.compress(d, wbits=31),
    "deflate": zlib.compress,  # RFC 9110's deflate: zlib-wrapped
    "br": brotli.compress,
}


def encode(data: bytes, content_encoding: str) -> bytes:
    for coding in (c.strip().lower() for c in content_encoding.split(",")):
        if coding != "identity":
            data = ENCODERS[{"x-gzip": "gzip"}.get(coding, coding)](data)
    return data


def post(url: str, content: Any, encoding: str | None, **kw: Any) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if encoding is not None:
        headers["content-encoding"] = encoding
    return httpx.post(url + "/v1/responses", content=content, headers=headers, timeout=30, **kw)


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("id", "created_at")}


def error_of(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == code, err
    return err


# ---------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "deflate", "br", "x-gzip", "GZIP", "gzip, zstd", "br,gzip",
                                      "identity", "identity, zstd"])
def test_a_compressed_body_gives_the_same_answer_and_the_upstream_gets_plain_json(encoding: str) -> None:
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        plain = post(url, PLAIN, None)
        compressed = post(url, encode(PLAIN, encoding), encoding)
    assert plain.status_code == 200 and compressed.status_code == 200, compressed.text
    assert comparable(compressed.json()) == comparable(plain.json())
    assert len(transport.requests) == 2
    sent_plain, sent = transport.requests
    assert sent["body"] == sent_plain["body"] and sent["body"]["input"] == "Say hello."
    assert "content-encoding" not in sent["headers"]
    assert int(sent["headers"]["content-length"]) == len(orjson.dumps(sent["body"]))


def test_raw_deflate_is_accepted_too() -> None:
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        r = post(url, deflate_raw(PLAIN), "deflate")
    assert r.status_code == 200, r.text
    assert transport.requests[0]["body"]["input"] == "Say hello."


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "deflate", "br"])
def test_a_chunked_upload_is_decoded_incrementally(encoding: str) -> None:
    """A larger body sent in small chunks (no Content-Length): the decoder sees it piece by piece."""
    body = {**BODY, "instructions": "".join(f"rule {i}: be brief. " for i in range(20000))}
    data = encode(orjson.dumps(body), encoding)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), 777):
            yield data[i : i + 777]

    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        r = post(url, chunks(), encoding)
    assert r.status_code == 200, r.text
    # a body this large may first ask vLLM for the model's window (GET /v1/models): find the generation request
    sent = [req for req in transport.requests if req["path"] == "/v1/responses"]
    assert len(sent) == 1 and sent[0]["body"]["instructions"] == body["instructions"]


def test_concatenated_gzip_members_and_zstd_frames_are_one_body() -> None:
    half = len(PLAIN) // 2
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        for encoding in ("gzip", "zstd"):
            enc = ENCODERS[encoding]
            r = post(url, enc(PLAIN[:half]) + enc(PLAIN[half:]), encoding)
            assert r.status_code == 200, r.text
    assert [s["body"]["input"] for s in transport.requests] == ["Say hello."] * 2


def test_the_limit_applies_to_the_decoded_body() -> None:
    body = orjson.dumps({**BODY, "instructions": "x" * 20000})
    small = zlib.compress(body, wbits=31)
    assert len(small) < 1000 < len(body)
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_nonstream"),
                         max_body_bytes=len(body) - 1) as url:
        over = post(url, small, "gzip")
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_nonstream"),
                         max_body_bytes=len(body)) as url:
        at = post(url, small, "gzip")
    err = error_of(over, 413, "request_too_large")
    assert "decompressed" in err["message"]
    assert at.status_code == 200, at.text


def test_the_compressed_input_is_bounded_too() -> None:
    noise = os.urandom(4000)  # incompressible: the gzip body is larger than the limit
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_nonstream"),
                         max_body_bytes=2000) as url:
        r1 = post(url, zlib.compress(noise, wbits=31), "gzip")
        data = zlib.compress(noise, wbits=31)
        r2 = post(url, (data[i : i + 500] for i in range(0, len(data), 500)), "gzip")  # chunked: no length
    for r in (r1, r2):
        error_of(r, 413, "request_too_large")


# ---------------------------------------------------------------------------------------------- bombs


def _bomb(encoding: str, size: int = 1024 * MiB) -> bytes:
    """``size`` zero bytes compressed, made without ever holding more than 1 MiB of them."""
    chunk = bytes(MiB)
    n = size // MiB
    if encoding == "zstd":
        zobj = zstandard.ZstdCompressor(level=3).compressobj()  # streamed: no content size in the frame
        return b"".join([zobj.compress(chunk) for _ in range(n)] + [zobj.flush()])
    if encoding == "br":
        bobj = brotli.Compressor(quality=1)
        return b"".join([bobj.process(chunk) for _ in range(n)] + [bobj.finish()])
    # deflate: after a full flush the compressor starts afresh, so one flushed megabyte repeats n times.
    dobj = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = dobj.compress(chunk) + dobj.flush(zlib.Z_FULL_FLUSH)
    assert dobj.compress(chunk) + dobj.flush(zlib.Z_FULL_FLUSH) == block
    raw = block * n + dobj.flush()
    if encoding == "deflate":
        return raw
    crc = 0
    for _ in range(n):
        crc = zlib.crc32(chunk, crc)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + raw + struct.pack("<II", crc, size & 0xFFFFFFFF)


@contextlib.contextmanager
def peak_memory_growth() -> Iterator[dict[str, Any]]:
    """The process's peak RSS growth over the block (VmHWM, reset through /proc/self/clear_refs), or where
    that cannot be reset, the peak of Python's allocations (tracemalloc)."""
    out: dict[str, Any] = {}

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field)

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = status("VmRSS")
        out["how"] = "VmHWM"
    except OSError:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        out["how"] = "tracemalloc"
    start = time.perf_counter()
    try:
        yield out
    finally:
        out["seconds"] = time.perf_counter() - start
        if out["how"] == "VmHWM":
            out["growth"] = status("VmHWM") - base
        else:
            out["growth"] = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "deflate", "br"])
def test_a_decompression_bomb_is_a_413_in_bounded_memory_and_time(encoding: str) -> None:
    bomb = _bomb(encoding)  # 1 GiB of zeros
    assert len(bomb) < 2 * MiB
    transport = replay("text_nonstream")
    limit = 32 * MiB  # the default --max-body-bytes
    with running_gateway(tool_choice_enforcement="off", transport=transport, max_body_bytes=limit) as url:
        post(url, PLAIN, None)  # warm the gateway up before measuring
        with httpx.Client(timeout=60) as http:
            http.get(url + "/healthz")
            with peak_memory_growth() as mem:
                r = http.post(url + "/v1/responses", content=bomb,
                              headers={"content-type": "application/json", "content-encoding": encoding})
    err = error_of(r, 413, "request_too_large")
    assert str(limit) in err["message"]
    assert len(transport.requests) == 1  # the bomb never went upstream
    print(f"\n{encoding} bomb: {len(bomb)} bytes on the wire for 1 GiB; 413 in {mem['seconds'] * 1000:.0f} ms; "
          f"peak memory growth {mem['growth'] / MiB:.1f} MiB ({mem['how']}; limit {limit // MiB} MiB)")
    assert mem["growth"] < 50_000_000  # bytes: the held output (<= limit) plus a few MiB
    assert mem["seconds"] < 10


def test_a_bomb_costs_memory_by_the_limit_not_by_its_size() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_nonstream"),
                         max_body_bytes=MiB) as url:
        bomb = _bomb("zstd", 256 * MiB)
        with peak_memory_growth() as mem:
            r = post(url, bomb, "zstd")
    error_of(r, 413, "request_too_large")
    print(f"\n256 MiB zstd bomb, 1 MiB limit: 413 in {mem['seconds'] * 1000:.0f} ms; "
          f"peak memory growth {mem['growth'] / MiB:.1f} MiB ({mem['how']})")
    assert mem["growth"] < 16 * MiB, mem


def test_a_zstd_window_over_8_mib_is_refused() -> None:
    """RFC 9659: the zstd content coding's window is at most 8 MiB; a bigger one could make the decoder
    allocate up to 128 MiB (--long) on the strength of a frame header."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=24, write_content_size=False)
    data = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = data.compress(PLAIN) + data.flush()
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        r = post(url, body, "zstd")
    error_of(r, 400, "invalid_body_encoding")
    assert transport.requests == []


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("encoding,named", [("compress", "compress"), ("snappy", "snappy"),
                                            ("gzip, lzma", "lzma"), ("zstd, gzip, br", "3")])
def test_an_unknown_encoding_is_a_415(encoding: str, named: str) -> None:
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        r = post(url, PLAIN, encoding)
    err = error_of(r, 415, "unsupported_content_encoding")
    assert named in err["message"] and all(c in err["message"] for c in ("zstd", "gzip", "deflate", "br"))
    assert r.headers["accept-encoding"] == "zstd, gzip, deflate, br"
    assert transport.requests == []


def _corruptions(encoding: str) -> dict[str, bytes]:
    good = ENCODERS[encoding](PLAIN * 50)
    out = {"garbage": b"this is not compressed at all, just text" * 3, "truncated": good[: len(good) // 2],
           "trailing": good + b"\x01garbage", "empty": b""}
    if encoding != "br":  # brotli has no checksum: a flipped byte may decode (to other bytes)
        checked = (zstandard.ZstdCompressor(level=3, write_checksum=True).compress(PLAIN * 50)
                   if encoding == "zstd" else good)
        flipped = bytearray(checked)
        flipped[len(flipped) // 2] ^= 0xFF
        out["flipped"] = bytes(flipped)
    return out


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "deflate", "br"])
def test_corrupt_bytes_are_a_400(encoding: str) -> None:
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        answers = {name: post(url, data, encoding) for name, data in _corruptions(encoding).items()}
    for name, r in answers.items():
        err = error_of(r, 400, "invalid_body_encoding")
        assert encoding in err["message"], (name, err)
        assert "Traceback" not in r.text
    assert transport.requests == []


def test_a_body_of_countless_empty_members_or_frames_is_a_400() -> None:
    """Each gzip member / zstd frame restarts the decoder: more than 1024 in one body are refused."""
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        gz = post(url, zlib.compress(b"", wbits=31) * 5000 + zlib.compress(PLAIN, wbits=31), "gzip")
        zs = post(url, zstandard.ZstdCompressor().compress(b"") * 5000 + zstd_stream(PLAIN), "zstd")
    for r in (gz, zs):
        assert "1024" in error_of(r, 400, "invalid_body_encoding")["message"]
    assert transport.requests == []


# ---------------------------------------------------------------------------------------------- proxied paths


class _Body(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


class _Recording(httpx.AsyncBaseTransport):
    """An upstream that keeps the raw bytes and headers of what it was sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[httpx.Request, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request, await request.aread()))
        answer = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}]}
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=_Body(orjson.dumps(answer)))


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "br", "snappy"])
def test_a_proxied_body_goes_through_compressed_and_untouched(encoding: str) -> None:
    plain = orjson.dumps({"model": "tiny", "input": "hello"})
    body = encode(plain, encoding) if encoding in ENCODERS else b"\x00opaque\xff" + plain
    upstream = _Recording()
    with running_gateway(tool_choice_enforcement="off", transport=upstream) as url:
        r = httpx.post(url + "/v1/embeddings", content=body,
                       headers={"content-type": "application/json", "content-encoding": encoding})
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.0, 1.0]
    (sent, raw), = upstream.requests
    assert sent.url.path == "/v1/embeddings"
    assert raw == body
    assert sent.headers["content-encoding"] == encoding
