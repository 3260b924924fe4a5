"""The upstream client's transport (httpx on httpx-aiohttp) against raw asyncio servers on loopback.

Each test's server answers from a script: what bytes to write, in which pieces, and whether to close, so what
the tests assert is what goes over the wire — not what aiohttp's documentation says. Most drive
``UpstreamTransport`` through httpx's own objects, as ``UpstreamClient.send_json`` does; the contract tests of
issue 16 (a ``1xx`` then the final answer, no replay of a written POST, environment proxies) go through
``UpstreamClient`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import Settings
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.upstream.client import UpstreamClient, UpstreamTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT = {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0}


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            await self.handler(reader, writer)
        with contextlib.suppress(Exception):
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


@contextlib.asynccontextmanager
async def serving(make: Callable[[Server], Handler]) -> AsyncIterator[tuple[Server, str]]:
    srv = Server(lambda r, w: asyncio.sleep(0))
    srv.handler = make(srv)
    server = await asyncio.start_server(srv._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1)


def _transport(**limits: float | int | None) -> UpstreamTransport:
    return UpstreamTransport(limits=httpx.Limits(**{"max_connections": 8, "max_keepalive_connections": 8,
                                                    "keepalive_expiry": 5.0, **limits}))


def _post(url: str, body: bytes = b'{"stream":true}', timeout: dict[str, float] | None = None) -> httpx.Request:
    return httpx.Request("POST", url + "/v1/responses", content=body, headers={"content-type": "application/json"},
                         extensions={"timeout": timeout or TIMEOUT})


async def _read(response: httpx.Response) -> bytes:
    out = b""
    async for chunk in response.stream:  # type: ignore[union-attr]
        out += chunk
    await response.aclose()
    return out


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_sequential_requests_reuse_one_connection_and_bodies_arrive_whole() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                body = await srv.read_request(reader)
                writer.write(STREAM_HEAD + _chunked(b"data: 1\n\n", b"data: " + body + b"\n\n"))
                await writer.drain()
        return handle

    async with serving(make) as (srv, url):
        t = _transport()
        for i in range(5):
            r = await t.handle_async_request(_post(url, b'{"n":%d}' % i))
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            assert await _read(r) == b'data: 1\n\ndata: {"n":%d}\n\n' % i
        assert srv.accepted == 1
        assert srv.requests[0].startswith(b"POST /v1/responses HTTP/1.1\r\n")
        assert b"host: 127.0.0.1:" in srv.requests[0].lower() and b"content-length: 7" in srv.requests[0].lower()
        await t.aclose()


async def test_a_response_closed_before_its_end_drops_the_connection() -> None:
    closed = asyncio.Event()

    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(STREAM_HEAD + b"9\r\ndata: 1\n\n\r\n")  # and never the end
            await writer.drain()
            await reader.read()  # b"" once the gateway closes: what aborts vLLM's generation
            closed.set()
        return handle

    async with serving(make) as (srv, url):
        t = _transport()
        r = await t.handle_async_request(_post(url))
        it = r.stream.__aiter__()  # type: ignore[union-attr]
        assert await it.__anext__() == b"data: 1\n\n"
        await r.aclose()
        await asyncio.wait_for(closed.wait(), 2)
        r = await t.handle_async_request(_post(url))  # a fresh connection for the next request
        await r.aclose()
        assert srv.accepted == 2
        await t.aclose()


async def test_a_pooled_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            # keep-alive was promised, but the server drops the connection once idle (its keep-alive timeout)
        return handle

    async with serving(make) as (srv, url):
        t = _transport()
        assert await _read(await t.handle_async_request(_post(url))) == b"ok"
        await asyncio.sleep(0.1)  # the server's close has arrived
        assert await _read(await t.handle_async_request(_post(url))) == b"ok"
        assert srv.accepted == 2 and len(srv.requests) == 2  # each request sent once, the second on a fresh one
        await t.aclose()


def _client(url: str) -> UpstreamClient:
    return UpstreamClient(Settings(upstream_url=url, store="none", connect_timeout=2.0, read_timeout=5.0,
                                   stream_idle_timeout=5.0))


async def test_a_post_the_server_read_before_closing_is_not_sent_again() -> None:
    """A reused connection the server closes after reading the request: the generation may have started, so
    the request fails rather than running twice (a retry on a fresh connection would be answered here)."""
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = b'{"object":"response"}'
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(body), body))
            await writer.drain()
            if srv.accepted == 1:  # the first connection reads the next request whole, then hangs up
                await srv.read_request(reader)
                return
            while True:
                await srv.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(body), body))
                await writer.drain()
        return handle

    async with serving(make) as (srv, url):
        client = _client(url)
        assert await client.post_json("/v1/responses", {"n": 1}, {}) == (200, {"object": "response"})
        with pytest.raises(UpstreamUnavailable):
            await client.post_json("/v1/responses", {"n": 2}, {})
        assert len(srv.requests) == 2 and srv.accepted == 1  # the second POST went out once
        assert await client.post_json("/v1/responses", {"n": 3}, {}) == (200, {"object": "response"})
        assert len(srv.requests) == 3 and srv.accepted == 2
        await client.aclose()


@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n",
])
async def test_an_interim_answer_is_not_the_answer_and_the_next_request_gets_its_own(interim: bytes) -> None:
    """What uvicorn does under ``Expect: 100-continue``: ``100`` first, then the final answer. Taking the ``100``
    for the answer left the final one on the pooled connection for the next request — another tenant's."""
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(interim)  # before the body is read, as uvicorn answers an Expect
                await writer.drain()
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                srv.requests.append(head + body)
                answer = b'{"echo":%b}' % body
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(answer), answer))
                await writer.drain()
        return handle

    async with serving(make) as (srv, url):
        client = _client(url)
        for n in range(3):
            status, body = await client.post_json("/v1/responses", {"n": n}, {})
            assert (status, body) == (200, {"echo": {"n": n}})
        up = await client.send_json("/v1/responses", {"n": 9}, {}, stream=False,
                                    extra_headers={"expect": "100-continue"})
        assert up.status_code == 200 and await up.response.aread() == b'{"echo":{"n":9}}'
        await up.aclose()
        assert len(srv.requests) == 4 and srv.accepted == 1
        await client.aclose()


async def test_no_answer_on_a_fresh_connection_is_an_error_not_a_retry() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)  # then close without a byte
        return handle

    async with serving(make) as (srv, url):
        t = _transport()
        with pytest.raises(httpx.RemoteProtocolError):
            await t.handle_async_request(_post(url))
        assert srv.accepted == 1
        await t.aclose()


async def test_a_body_cut_short_raises_remote_protocol_error() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(STREAM_HEAD + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
        return handle

    async with serving(make) as (_, url):
        t = _transport()
        r = await t.handle_async_request(_post(url))
        with pytest.raises(httpx.RemoteProtocolError):
            await _read(r)
        await r.aclose()
        await t.aclose()


async def test_a_body_delimited_by_the_close_of_the_connection_ends_normally() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
            await writer.drain()
        return handle

    async with serving(make) as (_, url):
        t = _transport()
        assert await _read(await t.handle_async_request(_post(url))) == b"all of it"
        await t.aclose()


async def test_a_silent_upstream_times_out_between_reads() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(STREAM_HEAD + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)
        return handle

    async with serving(make) as (_, url):
        t = _transport()
        r = await t.handle_async_request(_post(url, timeout={**TIMEOUT, "read": 0.3}))
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(httpx.ReadTimeout):
            await _read(r)
        assert 0.2 < loop.time() - started < 2.0
        await r.aclose()
        await t.aclose()


async def test_invalid_http_is_a_remote_protocol_error() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)
        return handle

    async with serving(make) as (_, url):
        t = _transport()
        with pytest.raises(httpx.RemoteProtocolError):
            await t.handle_async_request(_post(url))
        await t.aclose()


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with serving(lambda srv: srv.read_request) as (_, url):  # type: ignore[arg-type,return-value]
        pass  # closed: nothing listens on the port any more
    t = _transport()
    with pytest.raises(httpx.ConnectError):
        await t.handle_async_request(_post(url))
    await t.aclose()


async def test_past_max_connections_a_request_waits_for_a_free_one_then_times_out() -> None:
    gate: asyncio.Queue[None] = asyncio.Queue()  # one item ends the body being streamed

    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await srv.read_request(reader)
                writer.write(STREAM_HEAD + b"2\r\nok\r\n")
                await writer.drain()
                await gate.get()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        return handle

    async def finish(response: httpx.Response) -> bytes:
        gate.put_nowait(None)
        return await _read(response)

    async with serving(make) as (srv, url):
        t = _transport(max_connections=1)
        first = await t.handle_async_request(_post(url))
        with pytest.raises(httpx.TimeoutException):
            await t.handle_async_request(_post(url, timeout={**TIMEOUT, "pool": 0.2}))
        waiting = asyncio.create_task(t.handle_async_request(_post(url)))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await finish(first) == b"ok"  # frees the slot: the waiter goes on, on the same connection
        assert await finish(await asyncio.wait_for(waiting, 2)) == b"ok"
        # a waiter that gives up (its client left) neither takes nor loses the slot
        held = await t.handle_async_request(_post(url))
        leaving = asyncio.create_task(t.handle_async_request(_post(url)))
        await asyncio.sleep(0.05)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert await finish(held) == b"ok"
        assert await finish(await asyncio.wait_for(t.handle_async_request(_post(url)), 2)) == b"ok"
        assert srv.accepted == 1 and len(srv.requests) == 4
        await t.aclose()


async def test_a_reader_that_falls_behind_pauses_the_socket_and_loses_nothing() -> None:
    payload = bytes(range(256)) * 131072  # 32 MiB: far more than the socket buffers and the transport's own
    sent = [0]

    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
            for i in range(0, len(payload), 65536):
                writer.write(payload[i:i + 65536])
                await writer.drain()
                sent[0] = i + 65536
        return handle

    async with serving(make) as (_, url):
        t = _transport()
        r = await t.handle_async_request(_post(url))
        it = r.stream.__aiter__()  # type: ignore[union-attr]
        got = bytearray(await it.__anext__())
        await asyncio.sleep(0.5)  # a client slower than the upstream: the transport stops reading
        assert sent[0] < len(payload) // 2, f"{sent[0]} bytes taken while nobody read them"
        async for chunk in it:
            got += chunk
        await r.aclose()
        assert len(got) == len(payload) and bytes(got) == payload
        await t.aclose()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=12), st.data())
def test_any_framing_of_a_chunked_body_arrives_intact(pieces: list[bytes], data: st.DataObject) -> None:
    wire = STREAM_HEAD + _chunked(*pieces)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(wire) - 1), max_size=10)))
    segments = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]

    async def run() -> None:
        def make(srv: Server) -> Handler:
            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await srv.read_request(reader)
                for seg in segments:  # each its own write, the loop turning between them
                    writer.write(seg)
                    await writer.drain()
                    await asyncio.sleep(0)
            return handle

        async with serving(make) as (_, url):
            t = _transport()
            assert await _read(await t.handle_async_request(_post(url))) == b"".join(pieces)
            await t.aclose()

    asyncio.run(run())


async def test_a_head_answer_has_no_body_whatever_its_content_length_says() -> None:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)
        return handle

    async with serving(make) as (_, url):
        t = _transport()
        request = httpx.Request("HEAD", url + "/v1/models", extensions={"timeout": TIMEOUT})
        r = await asyncio.wait_for(t.handle_async_request(request), 2)
        assert r.headers["content-length"] == "1000"
        assert await asyncio.wait_for(_read(r), 2) == b""
        await t.aclose()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 'localhost' (and 127.0.0.1), and its key, written to tmp."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def test_https_verifies_the_certificate_and_sends_sni(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    seen: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: seen.append(name)  # type: ignore[assignment,func-returns-value]

    accepted = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecure")
                await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        trusting = ssl.create_default_context(cafile=str(cert))
        t = UpstreamTransport(limits=httpx.Limits(max_connections=4, max_keepalive_connections=4,
                                                  keepalive_expiry=5), verify=trusting)
        for _ in range(2):
            r = await t.handle_async_request(_post(f"https://localhost:{port}"))
            assert await _read(r) == b"secure"
        assert seen == ["localhost"] and accepted == [1]  # one handshake, then kept alive
        await t.aclose()
        # the default context (certifi's bundle) does not trust a self-signed certificate: a connect error
        t = UpstreamTransport(limits=httpx.Limits(max_connections=4))
        with pytest.raises(httpx.ConnectError):
            await t.handle_async_request(_post(f"https://localhost:{port}"))
        await t.aclose()
    finally:
        server.close()


def _clear_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def _json_answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(body), body))


def _answering(body: bytes) -> Callable[[Server], Handler]:
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await srv.read_request(reader)
                writer.write(_json_answer(body))
                await writer.drain()
        return handle
    return make


async def test_a_forward_proxy_from_the_environment_carries_the_upstream_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``HTTP_PROXY`` is honoured for model requests, the pass-through proxy and the probes alike; httpx drops
    environment proxies when it is handed a transport, so the gateway must not hand it one."""
    _clear_proxy_env(monkeypatch)
    async with serving(_answering(b'{"via":"proxy"}')) as (proxy, proxy_url):
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        client = UpstreamClient(Settings(upstream_url="http://vllm.invalid:8000", store="none",
                                         upstream_api_key="up-key"))
        assert await client.post_json("/v1/responses", {"n": 1}, {}) == (200, {"via": "proxy"})
        up = await client.proxy("GET", "/v1/models", "", {"accept": "application/json"}, None)
        assert up.status_code == 200
        await up.aclose()
        assert (await client.http.get("/health", headers=client.auth_headers({}))).status_code == 200
        await client.aclose()
    lines = [r.split(b"\r\n")[0] for r in proxy.requests]
    assert lines == [b"POST http://vllm.invalid:8000/v1/responses HTTP/1.1",
                     b"GET http://vllm.invalid:8000/v1/models HTTP/1.1",
                     b"GET http://vllm.invalid:8000/health HTTP/1.1"]
    assert all(b"authorization: bearer up-key" in r.lower() for r in proxy.requests)


async def test_no_proxy_sends_the_upstream_requests_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_proxy_env(monkeypatch)
    async with serving(_answering(b'{"via":"proxy"}')) as (proxy, proxy_url), \
            serving(_answering(b'{"via":"direct"}')) as (upstream, upstream_url):
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
        client = _client(upstream_url)
        assert await client.post_json("/v1/responses", {"n": 1}, {}) == (200, {"via": "direct"})
        await client.aclose()
    assert proxy.requests == [] and len(upstream.requests) == 1
    assert upstream.requests[0].startswith(b"POST /v1/responses HTTP/1.1\r\n")


def test_a_proxy_aiohttp_cannot_speak_to_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_proxy_env(monkeypatch)
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(ValueError, match="socks5"):
        UpstreamClient(Settings(upstream_url="http://vllm.invalid:8000", store="none"))


async def test_the_upstream_cookies_do_not_ride_along_on_later_requests() -> None:
    """One upstream client serves every tenant: a ``Set-Cookie`` from vLLM is kept by nobody."""
    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await srv.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nset-cookie: tenant=a; Path=/\r\ncontent-type: application/json\r\n"
                             b"content-length: 2\r\n\r\n{}")
                await writer.drain()
        return handle

    async with serving(make) as (srv, url):
        client = _client(url)
        for _ in range(2):
            assert await client.post_json("/v1/responses", {}, {}) == (200, {})
            up = await client.proxy("GET", "/v1/models", "", {}, None)
            await up.response.aread()
            await up.aclose()
        await client.aclose()
    assert len(srv.requests) == 4 and not any(b"cookie" in r.lower() for r in srv.requests)


async def test_a_refused_connection_and_a_server_that_hangs_up_are_unavailable_not_timeouts() -> None:
    """httpx-aiohttp's own table maps both to ``ConnectTimeout``: the gateway would answer 504 for a vLLM
    that is down."""
    async with serving(lambda srv: srv.read_request) as (_, url):  # type: ignore[arg-type,return-value]
        pass
    client = _client(url)
    with pytest.raises(UpstreamUnavailable):
        await client.post_json("/v1/responses", {}, {})
    await client.aclose()

    def make(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)  # then close without a byte
        return handle

    async with serving(make) as (_, url):
        client = _client(url)
        with pytest.raises(GatewayError) as info:
            await client.post_json("/v1/responses", {}, {})
        assert type(info.value) is UpstreamUnavailable
        await client.aclose()
