"""Connections to remote MCP servers: ``McpPool`` lists tools and runs ``tools/call`` for the gateway.

Theory of operation
-------------------
Everything MCP-protocol-level is the official SDK's (``mcp`` 2.x): ``mcp.Client`` over
``mcp.client.streamable_http.streamable_http_client`` or, for servers that only speak the older HTTP+SSE
transport, ``mcp.client.sse.sse_client``. ``Client`` negotiates the protocol era itself (``server/discover``,
falling back to the ``initialize`` handshake).

The SDK's transports are anyio task groups inside async context managers, which must be entered and exited
by the same task. So each pooled session has one **worker task** (``_Session._run``) that enters the
transport and the ``Client``, publishes the connected client on a future, and then only waits for its stop
signal. Requests never enter or exit anything: they await the future and call ``client.call_tool`` /
``client.list_tools`` from their own task, which the SDK supports (a request is a write on a memory stream
plus a wait on a per-request stream; many run concurrently on one session). The worker exits the contexts
when told to stop (idle, evicted, broken, shutdown) or when the transport's task group fails, and removes
its session from the pool; the next request opens a fresh one.

Sessions are keyed by (owner, URL, hash of the credentials): tenants never share a session of a stateful
server. They are kept LRU-ordered, bounded in number (a hard bound: an idle session is evicted to make room, and
a request finding every session busy waits for one rather than opening past the bound), and closed after
``idle_timeout`` without use.

Addresses: every new TCP connection a session's HTTP client opens (the first, a reconnect, a redirect) goes
through ``PinnedBackend``: it resolves the host itself, checks every address against the ``HostPolicy`` and
connects to exactly the address that passed, keeping the URL's host for ``Host``, TLS SNI and the certificate
check. The HTTP clients ignore ``HTTP(S)_PROXY`` (``trust_env=False``), so the check is the connection's truth.

Nothing holds a lock across I/O: the pool's dict is only touched between
awaits. Every wait a request makes is bounded by its own deadline (``timeout``); connecting is bounded by
``connect_timeout``; so a slow or dead server costs only the requests that use it.

HTTP status codes: the SDK reports a failed POST as a JSON-RPC stand-in error (404 → "Not Found",
other statuses → "Server returned an error response"). To report the real status as ``http_error.code``,
each session's HTTP client has a response hook that appends failing statuses to a list held in a
context variable the caller sets; the SDK runs each POST in a copy of the sending task's context, so the
list the hook sees is the caller's own (per request, not per session).

Secrets: headers and ``authorization`` live only in the HTTP client of their session and in the pool key's
hash. Log lines carry the server label, tool name, duration and outcome, never headers, arguments,
outputs or URLs; the SDK's and httpx2's own loggers (which log messages and URLs at debug/info) are raised
to WARNING unless the operator configured them.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import math
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

import anyio
import httpcore2
import httpx2
import structlog
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    REQUEST_TIMEOUT,
    CallToolResult,
    Implementation,
    TextContent,
    Tool,
)
from pydantic import BaseModel, ValidationError

from gateway.mcp.policy import HostPolicy, is_ip_literal, url_host_port

__all__ = ["OUTPUT_TRUNCATED_NOTE", "AddressRefused", "McpCallResult", "McpPool", "McpServerError", "McpServerRef",
           "PinSource", "PinnedBackend", "Resolver"]

log = structlog.get_logger("gateway.mcp")

OUTPUT_TRUNCATED_NOTE = "[output truncated by the gateway at 1 MiB]"
MAX_OUTPUT_BYTES = 1024 * 1024
_MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024  # one tool result event; above the output cap, which we apply later
_MAX_MESSAGE_CHARS = 2000  # error messages come from the server; keep them bounded
_SDK_TIMER_LEAD = 0.05  # the SDK's request timer is set to fire this much before the caller's deadline
_CLOSE_TIMEOUT = 2.0  # how long a stopping session may spend on its goodbye (DELETE) before it is cut
_LIST_PAGES = 100  # tools/list pagination cap: a server whose cursor never ends cannot hang a request
_KNOWN_TRANSPORTS = 256  # URLs whose working transport we remember (bounded: URLs come from requests)

TransportKind = Literal["streamable-http", "sse"]
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
_T = TypeVar("_T")

# The SDK's stand-ins for an HTTP failure (mcp/client/streamable_http.py), with the status they imply when
# the response hook saw none.
_SDK_STAND_INS: dict[tuple[int, str], int] = {
    (METHOD_NOT_FOUND, "Not Found"): 404,
    (INVALID_REQUEST, "Session terminated"): 404,
    (INTERNAL_ERROR, "Server returned an error response"): 502,
    (CONNECTION_CLOSED, "Connection closed"): 502,
}
_SESSION_TERMINATED = (INVALID_REQUEST, "Session terminated")

# Failing HTTP statuses seen by the response hook, for the request running in this context.
_STATUS_SINK: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("mcp_status_sink", default=None)


@dataclass(frozen=True)
class McpServerRef:
    """Where and as whom to connect. ``headers`` and ``authorization`` are secrets: never in repr or logs."""

    label: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)
    authorization: str | None = field(default=None, repr=False)  # sent as "Authorization: Bearer …"
    owner: str | None = None  # the caller's owner (gateway.server.auth.request_owner): sessions are per owner
    configured: bool = False  # from --mcp-servers-file: the operator named this URL, the allowlist does not apply

    def request_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.authorization is not None:
            for name in [n for n in headers if n.lower() == "authorization"]:
                del headers[name]  # the OAuth token the caller gave wins over a configured header
            headers["Authorization"] = f"Bearer {self.authorization}"
        return headers

    def pool_key(self) -> tuple[str, str, str]:
        """(owner, url, credentials hash): sessions are shared only by one owner's requests with the same
        credentials."""
        material = json.dumps(sorted((k.lower(), v) for k, v in self.request_headers().items()))
        return self.owner or "", self.url, hashlib.sha256(material.encode()).hexdigest()


@dataclass(frozen=True)
class McpCallResult:
    """Exactly one of ``output`` (the text the model sees) or ``error`` (an openai ``McpToolCallError`` dict:
    ``mcp_tool_execution_error`` / ``http_error`` / ``mcp_protocol_error``)."""

    output: str | None = None
    error: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class McpServerError(Exception):
    """Listing tools (or connecting) failed. ``error`` is an ``http_error`` or ``mcp_protocol_error`` dict;
    ``str(exc)`` is its message, fit for ``mcp_list_tools.error``."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message") or error["type"])
        self.error = error


def _http_error(code: int, message: str) -> dict[str, Any]:
    return {"type": "http_error", "code": code, "message": message[:_MAX_MESSAGE_CHARS]}


def _protocol_error(code: int, message: str) -> dict[str, Any]:
    return {"type": "mcp_protocol_error", "code": code, "message": message[:_MAX_MESSAGE_CHARS]}


def _leaf(exc: BaseException) -> BaseException:
    """The first real failure inside (nested) exception groups: the SDK's task groups wrap everything."""
    while isinstance(exc, BaseExceptionGroup):
        real = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (real or list(exc.exceptions))[0]
    return exc


def _classify(exc: BaseException, statuses: Sequence[int]) -> dict[str, Any]:
    """Map an SDK / HTTP failure to an openai McpToolCallError dict (one place for all of it)."""
    leaf = _leaf(exc)
    if isinstance(leaf, McpServerError):
        return leaf.error
    if isinstance(leaf, MCPError):
        if leaf.code == REQUEST_TIMEOUT:
            return _http_error(504, "the MCP server did not answer in time")
        implied = _SDK_STAND_INS.get((leaf.code, leaf.message))
        if implied is None:
            return _protocol_error(leaf.code, leaf.message)  # a JSON-RPC error the server sent
        if statuses:
            return _http_error(statuses[-1], f"the MCP server answered HTTP {statuses[-1]}")
        if leaf.code == CONNECTION_CLOSED:
            return _http_error(502, "the connection to the MCP server was lost")
        if (leaf.code, leaf.message) == _SESSION_TERMINATED:
            return _http_error(404, "the MCP server no longer knows this session")
        return _http_error(implied, f"the MCP server answered HTTP {implied}")
    if isinstance(leaf, httpx2.HTTPStatusError):
        return _http_error(leaf.response.status_code, f"the MCP server answered HTTP {leaf.response.status_code}")
    if statuses:  # e.g. the SSE transport failed on a POST the hook saw fail
        return _http_error(statuses[-1], f"the MCP server answered HTTP {statuses[-1]}")
    if isinstance(leaf, httpx2.TimeoutException | TimeoutError):
        return _http_error(504, "timed out talking to the MCP server")
    if isinstance(leaf, socket.gaierror):
        return _http_error(502, "the MCP server's host name could not be resolved")
    if isinstance(leaf, httpx2.TransportError | OSError | anyio.BrokenResourceError | anyio.ClosedResourceError):
        return _http_error(502, f"the MCP server is unreachable ({type(leaf).__name__})")
    if isinstance(leaf, ValidationError):
        return _protocol_error(INTERNAL_ERROR, "the MCP server sent a malformed result")
    return _protocol_error(INTERNAL_ERROR, f"unexpected failure talking to the MCP server ({type(leaf).__name__})")


async def _record_status(response: httpx2.Response) -> None:
    if response.status_code >= 300:
        sink = _STATUS_SINK.get()
        if sink is not None:
            sink.append(response.status_code)


def _block_dict(block: BaseModel) -> dict[str, Any]:
    dumped: dict[str, Any] = block.model_dump(by_alias=True, mode="json", exclude_none=True)
    return dumped


def _output_text(result: CallToolResult) -> str:
    """Text blocks joined by newlines; else the structured content as JSON; else the blocks as JSON."""
    texts = [block.text for block in result.content if isinstance(block, TextContent)]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False, separators=(",", ":"))
    if result.content:
        return json.dumps([_block_dict(b) for b in result.content], ensure_ascii=False, separators=(",", ":"))
    return ""


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit // 4:  # cannot exceed the limit even at 4 bytes a character
        return text
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore") + "\n" + OUTPUT_TRUNCATED_NOTE


def _quiet_sdk_loggers() -> None:
    """The SDK logs whole JSON-RPC messages (arguments, outputs) at debug and httpx2 logs URLs at info."""
    for name in ("mcp", "httpx2"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def _transport_order(url: str) -> tuple[TransportKind, ...]:
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/sse"):
        return ("sse",)  # the conventional HTTP+SSE endpoint: do not spend a POST on it first
    return ("streamable-http", "sse")


async def _default_resolver(host: str, port: int) -> Sequence[str]:
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class AddressRefused(httpcore2.ConnectError):
    """A connection the host policy refused (the name resolved to a sensitive address); never attempted."""


class PinSource(Protocol):
    """What ``PinnedBackend`` reads on each connection: an ``McpPool``, or another owner of outbound calls that
    follows the same address rules (``gateway.websearch.providers``)."""

    _policy: HostPolicy | None
    _resolver: Resolver
    _connect_timeout: float


class PinnedBackend(httpcore2.AsyncNetworkBackend):
    """httpcore's network backend for one session: each ``connect_tcp`` resolves the host, checks the addresses
    against the policy and connects to exactly those (the TLS layer above still uses the URL's host for SNI and
    the certificate). A configured server's own host:port is trusted (the operator named it); any other host
    (a redirect) is judged like a request's URL."""

    def __init__(self, pool: PinSource, url: str, configured: bool, inner: httpcore2.AsyncNetworkBackend | None = None
                 ) -> None:
        self._pool = pool
        self._scheme, host, port = url_host_port(url)
        self._trusted = (host, port) if configured else None
        self._inner = inner or httpcore2.AnyIOBackend()
        self.refused: str | None = None  # why the last connection was refused (shown to the caller as a 403)

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore2.AsyncNetworkStream:
        policy = self._pool._policy
        name = host.strip("[]").lower().rstrip(".")
        if is_ip_literal(name):
            addresses: Sequence[str] = [name]
        else:
            with anyio.fail_after(timeout or self._pool._connect_timeout):
                addresses = await self._pool._resolver(name, port)
        addresses = list(dict.fromkeys(addresses))
        if not addresses:
            raise httpcore2.ConnectError(f"no address for {name!r}")
        if policy is not None and self._trusted != (name, port):
            url = f"{self._scheme}://{f'[{name}]' if ':' in name else name}:{port}/"
            reason = policy.check(url) or policy.check_addresses(url, addresses)
            if reason is not None:
                self.refused = reason
                raise AddressRefused(reason)
        failure: Exception | None = None
        for address in addresses:  # exactly the addresses that passed, in the resolver's order
            try:
                stream = await self._inner.connect_tcp(address.split("%", 1)[0], port, timeout=timeout,
                                                       local_address=local_address, socket_options=socket_options)
                self.refused = None
                return stream
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout, OSError) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None
                                  ) -> httpcore2.AsyncNetworkStream:
        raise httpcore2.ConnectError("unix sockets are not MCP servers")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _pinned_client(backend: PinnedBackend, **kwargs: Any) -> httpx2.AsyncClient:
    """An HTTP client whose every connection goes through ``backend`` and which ignores proxy variables."""
    transport = httpx2.AsyncHTTPTransport(trust_env=False)
    transport._pool._network_backend = backend  # read on every new connection
    return httpx2.AsyncClient(transport=transport, trust_env=False, **kwargs)


class _Session:
    """One pooled connection, owned by its worker task (see the module docstring)."""

    def __init__(self, pool: McpPool, key: tuple[str, str, str], server: McpServerRef) -> None:
        self.pool = pool
        self.key = key
        self.label = server.label
        self.url = server.url
        self.inflight = 0
        self.last_used = time.monotonic()
        self.stopping = False
        self.reused = False
        self.transport: TransportKind | None = None
        self._headers = server.request_headers()
        self.backend = PinnedBackend(pool, server.url, server.configured)
        self._stop = asyncio.Event()
        self._stop_reason = "shutdown"
        self._scope: anyio.CancelScope | None = None  # the worker's; cancelled to abandon a pending connect
        self.ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        # Mark an unawaited connect failure as retrieved: every caller may already have timed out.
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.task = asyncio.create_task(self._run(), name=f"mcp-session:{server.label}")

    @property
    def usable(self) -> bool:
        return not self.stopping and not self.task.done()

    def stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping = True
            self._stop_reason = reason
            self._stop.set()
            if self._scope is not None and not self.ready.done():
                self._scope.cancel()  # nobody needs the connect any more (eviction, shutdown)
        self.pool._forget(self)

    async def _run(self) -> None:
        started = time.monotonic()
        failure: dict[str, Any] | None = None
        try:
            kinds = self.pool._known_transport(self.url) or _transport_order(self.url)
            for index, kind in enumerate(kinds):
                sink: list[int] = []
                _STATUS_SINK.set(sink)  # this task's own context: the connect requests
                try:
                    await self._serve(kind, started)
                    return
                except Exception as exc:
                    failure = self.refusal() or _classify(exc, sink)
                    fall_back = index + 1 < len(kinds) and any(s in (404, 405) for s in sink)
                    if self.ready.done() or not fall_back:
                        break
        except Exception as exc:
            failure = self.refusal() or _classify(exc, ())
        finally:
            self.stopping = True
            self.pool._forget(self)
            if not self.ready.done():
                self.ready.set_exception(McpServerError(failure or _http_error(502, "the MCP session closed")))
                log.warning("mcp.session.failed", server_label=self.label, outcome=(failure or {}).get("type"),
                            code=(failure or {}).get("code"), duration_ms=round((time.monotonic() - started) * 1e3))
            else:
                reason = self._stop_reason if failure is None else "broken"
                log.info("mcp.session.closed", server_label=self.label, reason=reason, transport=self.transport)

    def refusal(self) -> dict[str, Any] | None:
        """The policy's refusal of this session's last connection, as the caller's error."""
        return _http_error(403, self.backend.refused) if self.backend.refused else None

    async def _serve(self, kind: TransportKind, started: float) -> None:
        """Connect over ``kind``, publish the client, hold the contexts open until told to stop."""
        pool = self.pool
        with anyio.CancelScope() as scope:
            self._scope = scope
            # One scope for the whole life, so the SDK's task groups nest inside it (a fail_after around the
            # connect alone would be exited while they are still open).
            scope.deadline = anyio.current_time() + pool._connect_timeout
            async with AsyncExitStack() as stack:
                transport = await self._transport(kind, stack)
                client = await stack.enter_async_context(
                    Client(transport, cache=None, client_info=pool._client_info))
                scope.deadline = math.inf
                self.transport = kind
                pool._remember_transport(self.url, kind)
                self.ready.set_result(client)
                log.info("mcp.session.opened", server_label=self.label, transport=kind,
                         duration_ms=round((time.monotonic() - started) * 1e3))
                await self._stop.wait()
                scope.deadline = anyio.current_time() + _CLOSE_TIMEOUT  # bound the goodbye (DELETE)
        if scope.cancelled_caught and not self.ready.done():
            if self.stopping:
                raise McpServerError(_http_error(503, "the MCP session was closed before it connected"))
            raise TimeoutError("connecting to the MCP server timed out")

    async def _transport(self, kind: TransportKind, stack: AsyncExitStack) -> Any:
        pool = self.pool
        hooks = {"response": [_record_status]}
        if kind == "sse":

            def factory(
                headers: dict[str, str] | None = None,
                timeout: httpx2.Timeout | None = None,
                auth: httpx2.Auth | None = None,
            ) -> httpx2.AsyncClient:
                return _pinned_client(self.backend, headers=headers, timeout=timeout, auth=auth, event_hooks=hooks)

            return sse_client(self.url, headers=self._headers, timeout=pool._connect_timeout,
                              sse_read_timeout=pool._read_timeout, httpx_client_factory=factory)
        # The session's one HTTP client, reused by every request on it. The transport leaves a client it was
        # given open, so the exit stack closes it, after the Client and transport above it have exited.
        http = await stack.enter_async_context(_pinned_client(
            self.backend, headers=self._headers, timeout=httpx2.Timeout(pool._connect_timeout, read=pool._read_timeout),
            event_hooks=hooks))
        return streamable_http_client(self.url, http_client=http, max_sse_event_size=_MAX_SSE_EVENT_BYTES)


class McpPool:
    """Pooled MCP client sessions; one per process, closed with ``aclose()`` at shutdown.

    ``list_tools`` raises ``McpServerError``; ``call_tool`` never raises for server trouble, it returns an
    ``McpCallResult`` with ``error``. With a ``policy``, every URL (but a servers-file server's) is checked
    before connecting, and every connection goes to an address the policy accepts (``PinnedBackend``).
    """

    def __init__(
        self,
        *,
        policy: HostPolicy | None = None,
        idle_timeout: float = 60.0,
        max_sessions: int = 32,
        connect_timeout: float = 10.0,
        read_timeout: float = 300.0,
        list_timeout: float = 30.0,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        resolver: Resolver | None = None,
        client_info: Implementation | None = None,
    ) -> None:
        self._policy = policy
        self._idle_timeout = idle_timeout
        self._max_sessions = max(1, max_sessions)
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._list_timeout = list_timeout
        self._max_output_bytes = max_output_bytes
        self._resolver: Resolver = resolver or _default_resolver
        self._client_info = client_info or Implementation(name="responses-gateway", version="0.1.0")
        self._sessions: OrderedDict[tuple[str, str, str], _Session] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._transports: OrderedDict[str, TransportKind] = OrderedDict()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        _quiet_sdk_loggers()

    # --- public API -----------------------------------------------------------------------------------------

    async def list_tools(self, server: McpServerRef, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every tool the server lists (all pages), as ``{name, description, input_schema, annotations}``."""
        started = time.monotonic()

        async def fetch(client: Client) -> list[dict[str, Any]]:
            tools: list[dict[str, Any]] = []
            cursor: str | None = None
            for _ in range(_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools.extend(_tool_dict(tool) for tool in page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            return tools

        try:
            tools = await self._run(server, fetch, timeout or self._list_timeout, idempotent=True)
        except McpServerError as exc:
            log.info("mcp.list_tools", server_label=server.label, outcome=exc.error["type"],
                     code=exc.error.get("code"), duration_ms=_ms(started))
            raise
        log.info("mcp.list_tools", server_label=server.label, outcome="ok", tools=len(tools), duration_ms=_ms(started))
        return tools

    async def call_tool(
        self, server: McpServerRef, name: str, arguments: dict[str, Any], timeout: float
    ) -> McpCallResult:
        """Run ``tools/call``; the whole call (connecting included) is bounded by ``timeout`` seconds."""
        started = time.monotonic()
        deadline = started + timeout

        async def call(client: Client) -> CallToolResult:
            # The SDK's own timer fires just before ours and sends the server a cancellation for the call.
            remaining = deadline - time.monotonic() - _SDK_TIMER_LEAD
            return await client.call_tool(name, arguments, read_timeout_seconds=max(0.01, remaining))

        try:
            result = await self._run(server, call, timeout, idempotent=False)
        except McpServerError as exc:
            outcome = McpCallResult(error=exc.error)
        else:
            if result.is_error:
                outcome = McpCallResult(error={"type": "mcp_tool_execution_error",
                                               "content": [_block_dict(b) for b in result.content]})
            else:
                outcome = McpCallResult(output=_truncate(_output_text(result), self._max_output_bytes))
        error = outcome.error or {}
        log.info("mcp.call", server_label=server.label, tool=name, outcome=error.get("type", "ok"),
                 code=error.get("code"), duration_ms=_ms(started))
        return outcome

    async def aclose(self) -> None:
        """Close every session and wait for the worker tasks (cancelling any that will not finish)."""
        self._closed = True
        for session in list(self._sessions.values()):
            session.stop("shutdown")
        if self._reaper is not None:
            self._reaper.cancel()
        tasks = [t for t in (*self._tasks, self._reaper) if t is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT + 1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._reaper = None

    @property
    def session_count(self) -> int:
        """Open (or opening) pooled sessions."""
        return len(self._sessions)

    # --- internals ------------------------------------------------------------------------------------------

    async def _run(
        self, server: McpServerRef, op: Callable[[Client], Awaitable[_T]], timeout: float, *, idempotent: bool
    ) -> _T:
        """Run ``op`` on a pooled session within ``timeout``; McpServerError on any failure."""
        if self._closed:
            raise McpServerError(_http_error(503, "the gateway is shutting down"))
        if self._policy is not None and not server.configured and (reason := self._policy.check(server.url)):
            raise McpServerError(_http_error(403, reason))
        try:
            async with asyncio.timeout(timeout):
                for attempt in range(2):
                    session = self._session_for(server)
                    sink: list[int] = []
                    token = _STATUS_SINK.set(sink)
                    session.inflight += 1
                    try:
                        client = await asyncio.shield(session.ready)
                        return await op(client)
                    except McpServerError:
                        raise  # connecting failed; the worker classified it
                    except Exception as exc:
                        error = session.refusal() or _classify(exc, sink)
                        if error["type"] == "http_error" and error["code"] != 504:
                            session.stop("broken")  # unusable (e.g. session lost, connection gone)
                        if attempt == 0 and session.reused and _retryable(exc, idempotent):
                            continue  # a stale pooled session: once more on a fresh one
                        raise McpServerError(error) from None
                    finally:
                        session.inflight -= 1
                        session.last_used = time.monotonic()
                        session.reused = True
                        _STATUS_SINK.reset(token)
                        if len(self._sessions) > self._max_sessions:
                            self._evict_over_limit(keep=None)  # one request's many servers do not stay open
        except TimeoutError:
            raise McpServerError(_http_error(504, f"the MCP server did not answer within {timeout:g}s")) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _session_for(self, server: McpServerRef) -> _Session:
        key = server.pool_key()
        session = self._sessions.get(key)
        if session is None or not session.usable:
            session = _Session(self, key, server)
            self._sessions[key] = session
            self._tasks.add(session.task)
            session.task.add_done_callback(self._tasks.discard)
            self._evict_over_limit(keep=session)
            if self._reaper is None or self._reaper.done():
                self._reaper = asyncio.create_task(self._reap(), name="mcp-pool-reaper")
        self._sessions.move_to_end(key)
        return session

    def _evict_over_limit(self, keep: _Session | None) -> None:
        for session in list(self._sessions.values()):  # least recently used first
            if len(self._sessions) <= self._max_sessions:
                return
            if session.inflight == 0 and session is not keep:
                session.stop("evicted")
        # All busy: over the bound only while they run; each one trims the pool as it finishes (McpPool._run).

    def _forget(self, session: _Session) -> None:
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]

    async def _reap(self) -> None:
        interval = max(0.05, min(self._idle_timeout / 2, 10.0))
        while self._sessions:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if session.inflight == 0 and now - session.last_used >= self._idle_timeout:
                    session.stop("idle")

    def _known_transport(self, url: str) -> tuple[TransportKind, ...] | None:
        kind = self._transports.get(url)
        return (kind,) if kind is not None else None

    def _remember_transport(self, url: str, kind: TransportKind) -> None:
        self._transports[url] = kind
        self._transports.move_to_end(url)
        while len(self._transports) > _KNOWN_TRANSPORTS:
            self._transports.popitem(last=False)


def _retryable(exc: BaseException, idempotent: bool) -> bool:
    """Worth one retry on a fresh session: the server forgot our session (it never ran the request), or, for
    an idempotent request, the pooled connection broke."""
    leaf = _leaf(exc)
    if isinstance(leaf, MCPError) and (leaf.code, leaf.message) == _SESSION_TERMINATED:
        return True
    return idempotent and isinstance(leaf, MCPError) and (leaf.code, leaf.message) in _SDK_STAND_INS


def _tool_dict(tool: Tool) -> dict[str, Any]:
    annotations = None
    if tool.annotations is not None:  # MCP's wire spelling (readOnlyHint, ...), as the server sent it
        annotations = tool.annotations.model_dump(by_alias=True, mode="json", exclude_none=True)
    return {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema,
            "annotations": annotations}


def _ms(started: float) -> int:
    return round((time.monotonic() - started) * 1e3)
