"""gateway.mcp against real MCP servers: the SDK's Python server (streamable HTTP and SSE-only) and the
TypeScript reference server ``@modelcontextprotocol/server-everything`` (see ``tests/mcp_servers.py``);
plus the host policy and the servers file, which are pure."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import structlog

from gateway.mcp import (
    OUTPUT_TRUNCATED_NOTE,
    HostPolicy,
    McpPool,
    McpServerError,
    McpServerRef,
    McpServersFileError,
    load_servers_file,
    parse_servers,
)

if TYPE_CHECKING:  # imported by pytest as a plugin (below), so that its asserts are rewritten too
    from tests.mcp_servers import McpTestServer

pytest_plugins = ["tests.mcp_servers"]


@pytest.fixture
async def pool() -> AsyncIterator[McpPool]:
    pool = McpPool(connect_timeout=3.0)
    yield pool
    await pool.aclose()


def ref(server: McpTestServer, label: str = "fx", **kwargs: Any) -> McpServerRef:
    return McpServerRef(label=label, url=server.url, **kwargs)


def mcp_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("mcp-")]


# --- listing and calling ------------------------------------------------------------------------------------


async def test_list_tools_fixture_server(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    tools = {t["name"]: t for t in await pool.list_tools(ref(mcp_fixture_server))}
    assert {"add", "echo", "fail", "sleep", "structured"} <= set(tools)
    add = tools["add"]
    assert set(add) == {"name", "description", "input_schema", "annotations"}
    assert add["description"] == "Add two integers."
    assert add["input_schema"]["properties"].keys() == {"a", "b"}
    assert add["input_schema"]["required"] == ["a", "b"]
    json.dumps(tools)  # plain JSON all the way down


async def test_list_tools_everything_server(pool: McpPool, mcp_everything_server: McpTestServer) -> None:
    tools = {t["name"]: t for t in await pool.list_tools(ref(mcp_everything_server, "everything"))}
    assert {"echo", "get-sum", "get-structured-content"} <= set(tools)
    assert tools["echo"]["input_schema"]["type"] == "object"
    assert tools["get-sum"]["annotations"]["readOnlyHint"] is True  # MCP's own spelling, as the server sent it
    json.dumps(tools)


async def test_call_add_echo_structured(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    server = ref(mcp_fixture_server)
    add = await pool.call_tool(server, "add", {"a": 2, "b": 40}, timeout=5)
    assert add.ok and add.output == "42"
    echo = await pool.call_tool(server, "echo", {"text": "héllo\nworld"}, timeout=5)
    assert echo.output == "héllo\nworld"
    structured = await pool.call_tool(server, "structured", {}, timeout=5)  # no text block: the JSON instead
    assert structured.output is not None
    assert json.loads(structured.output) == {"temperature": 21.5, "unit": "C", "tags": ["a", "b"]}
    assert pool.session_count == 1  # one pooled session served all three


async def test_call_everything_server(pool: McpPool, mcp_everything_server: McpTestServer) -> None:
    server = ref(mcp_everything_server, "everything")
    total = await pool.call_tool(server, "get-sum", {"a": 2, "b": 3}, timeout=5)
    assert total.output == "The sum of 2 and 3 is 5."
    echo = await pool.call_tool(server, "echo", {"message": "ping"}, timeout=5)
    assert echo.output == "Echo: ping"
    weather = await pool.call_tool(server, "get-structured-content", {"location": "New York"}, timeout=5)
    assert weather.output is not None and json.loads(weather.output)["conditions"]
    unknown = await pool.call_tool(server, "no-such-tool", {}, timeout=5)
    assert unknown.error is not None and unknown.error["type"] in ("mcp_tool_execution_error", "mcp_protocol_error")


async def test_fail_is_tool_execution_error(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    result = await pool.call_tool(ref(mcp_fixture_server), "fail", {"message": "boom"}, timeout=5)
    assert result.output is None
    assert result.error is not None and result.error["type"] == "mcp_tool_execution_error"
    assert result.error["content"] and result.error["content"][0]["type"] == "text"
    assert set(result.error) == {"type", "content"}


async def test_json_rpc_error_is_protocol_error(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    result = await pool.call_tool(ref(mcp_fixture_server), "protocol_error", {}, timeout=5)
    assert result.error == {"type": "mcp_protocol_error", "code": -32602,
                            "message": "protocol_error was asked to fail"}


async def test_error_shapes_match_the_openai_sdk(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    from openai.types.responses.response_output_item import McpCall

    server = ref(mcp_fixture_server)
    for name, args in (("fail", {"message": "x"}), ("protocol_error", {}), ("sleep", {"seconds": 2})):
        result = await pool.call_tool(server, name, args, timeout=0.3 if name == "sleep" else 5)
        item = McpCall.model_validate({"id": "mcp_1", "type": "mcp_call", "server_label": "fx", "name": name,
                                       "arguments": json.dumps(args), "error": result.error})
        assert item.error is not None and item.error.type == result.error["type"]  # type: ignore[index]


async def test_output_is_cut_at_one_mib(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    result = await pool.call_tool(ref(mcp_fixture_server), "big", {"size": 1_500_000}, timeout=5)
    assert result.output is not None and result.output.endswith("\n" + OUTPUT_TRUNCATED_NOTE)
    assert len(result.output.encode()) == 1024 * 1024 + 1 + len(OUTPUT_TRUNCATED_NOTE)
    small = await pool.call_tool(ref(mcp_fixture_server), "big", {"size": 1000}, timeout=5)
    assert small.output == "x" * 1000


# --- failures -----------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_server_is_http_error_quickly(pool: McpPool) -> None:
    server = McpServerRef(label="dead", url=f"http://127.0.0.1:{_closed_port()}/mcp")
    started = time.monotonic()
    result = await pool.call_tool(server, "add", {"a": 1, "b": 2}, timeout=5)
    assert time.monotonic() - started < 1.0
    assert result.error is not None and result.error["type"] == "http_error" and result.error["code"] == 502
    with pytest.raises(McpServerError) as excinfo:
        await pool.list_tools(server)
    assert excinfo.value.error["code"] == 502 and str(excinfo.value)
    assert pool.session_count == 0  # failed sessions are not kept


async def test_http_status_is_reported(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    for status in (401, 403, 500):
        server = McpServerRef(label="st", url=f"{mcp_fixture_server.base_url}/status/{status}")
        result = await pool.call_tool(server, "add", {"a": 1, "b": 2}, timeout=5)
        assert result.error is not None
        assert (result.error["type"], result.error["code"]) == ("http_error", status)
        assert set(result.error) == {"type", "code", "message"}


async def test_timeout_then_the_pool_serves_at_once(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    server = ref(mcp_fixture_server)
    await pool.call_tool(server, "echo", {"text": "warm"}, timeout=5)
    started = time.monotonic()
    slow = await pool.call_tool(server, "sleep", {"seconds": 10}, timeout=0.3)
    assert 0.25 < time.monotonic() - started < 1.5
    assert slow.error is not None and (slow.error["type"], slow.error["code"]) == ("http_error", 504)
    started = time.monotonic()
    fast = await pool.call_tool(server, "echo", {"text": "still here"}, timeout=5)
    assert fast.output == "still here" and time.monotonic() - started < 0.5
    assert pool.session_count == 1  # a timeout does not throw the session away


async def test_hung_server_does_not_block_other_calls(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    """A server that accepts the connection and never answers costs only its own callers."""
    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens, never accepts: requests just wait
        hung_ref = McpServerRef(label="hung", url=f"http://127.0.0.1:{hung.getsockname()[1]}/mcp")
        started = time.monotonic()
        stuck = asyncio.create_task(pool.call_tool(hung_ref, "add", {"a": 1, "b": 2}, timeout=1.0))
        await asyncio.sleep(0.05)
        ok = await pool.call_tool(ref(mcp_fixture_server), "add", {"a": 1, "b": 2}, timeout=5)
        assert ok.output == "3" and time.monotonic() - started < 0.8
        result = await stuck
        assert result.error is not None and result.error["code"] == 504
        assert time.monotonic() - started < 2.0


async def test_a_broken_session_is_dropped_and_reopened(pool: McpPool) -> None:
    from tests.mcp_servers import start_fixture_server

    server = start_fixture_server("streamable-http")
    port = int(server.base_url.rsplit(":", 1)[1])
    try:
        target = ref(server, "restarting")
        assert (await pool.call_tool(target, "add", {"a": 1, "b": 1}, timeout=5)).output == "2"
        server.stop()
        down = await pool.call_tool(target, "add", {"a": 1, "b": 1}, timeout=5)
        assert down.error is not None and (down.error["type"], down.error["code"]) == ("http_error", 502)
        await asyncio.sleep(0.05)
        assert pool.session_count == 0
        server = start_fixture_server("streamable-http", port=port)
        assert (await pool.call_tool(target, "add", {"a": 2, "b": 2}, timeout=5)).output == "4"
    finally:
        server.stop()


# --- credentials ------------------------------------------------------------------------------------------


def _calls_with(server: McpTestServer, marker: str) -> list[dict[str, Any]]:
    return [c for c in server.calls() if marker in json.dumps(c["arguments"])]


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
async def test_headers_and_authorization_reach_the_server(
    pool: McpPool, mcp_fixture_server: McpTestServer, mcp_sse_server: McpTestServer, transport: str
) -> None:
    server = mcp_fixture_server if transport == "streamable-http" else mcp_sse_server
    key, token, marker = secrets.token_hex(8), secrets.token_hex(8), secrets.token_hex(8)
    target = ref(server, headers={"X-Api-Key": key}, authorization=token)
    assert (await pool.call_tool(target, "echo", {"text": marker}, timeout=5)).output == marker
    [call] = _calls_with(server, marker)
    assert call["headers"]["x-api-key"] == key
    assert call["headers"]["authorization"] == f"Bearer {token}"


async def test_sessions_are_keyed_by_credentials(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    marker = secrets.token_hex(8)
    alice = ref(mcp_fixture_server, authorization="alice-" + marker)
    bob = ref(mcp_fixture_server, authorization="bob-" + marker)
    await asyncio.gather(pool.call_tool(alice, "echo", {"text": marker + "a"}, timeout=5),
                         pool.call_tool(bob, "echo", {"text": marker + "b"}, timeout=5))
    assert pool.session_count == 2
    seen = {c["arguments"]["text"][-1]: c["headers"]["authorization"] for c in _calls_with(mcp_fixture_server, marker)}
    assert seen == {"a": f"Bearer alice-{marker}", "b": f"Bearer bob-{marker}"}


async def test_authorization_overrides_a_configured_header() -> None:
    server = McpServerRef("x", "http://h/mcp", headers={"authorization": "Bearer cfg", "X-A": "1"}, authorization="t")
    assert server.request_headers() == {"X-A": "1", "Authorization": "Bearer t"}
    assert "cfg" not in repr(server) and "'t'" not in repr(server)
    assert server.pool_key() != McpServerRef("x", "http://h/mcp", headers={"X-A": "1"}).pool_key()


# --- the SSE transport ------------------------------------------------------------------------------------


async def test_sse_server_by_its_sse_path(pool: McpPool, mcp_sse_server: McpTestServer) -> None:
    server = ref(mcp_sse_server, "sse")
    with structlog.testing.capture_logs() as logs:
        assert {"add", "echo"} <= {t["name"] for t in await pool.list_tools(server)}
        assert (await pool.call_tool(server, "add", {"a": 3, "b": 4}, timeout=5)).output == "7"
    opened = [e for e in logs if e["event"] == "mcp.session.opened"]
    assert [e["transport"] for e in opened] == ["sse"]


async def test_sse_fallback_after_streamable_http_is_refused(pool: McpPool, mcp_sse_server: McpTestServer) -> None:
    server = McpServerRef(label="sse", url=mcp_sse_server.base_url + "/events")  # the POST gets 405
    with structlog.testing.capture_logs() as logs:
        assert (await pool.call_tool(server, "add", {"a": 3, "b": 4}, timeout=5)).output == "7"
        slow = await pool.call_tool(server, "sleep", {"seconds": 10}, timeout=0.3)
        assert slow.error is not None and slow.error["code"] == 504
        failed = await pool.call_tool(server, "fail", {"message": "no"}, timeout=5)
        assert failed.error is not None and failed.error["type"] == "mcp_tool_execution_error"
    assert [e["transport"] for e in logs if e["event"] == "mcp.session.opened"] == ["sse"]


# --- pool life cycle --------------------------------------------------------------------------------------


async def test_idle_sessions_are_closed(mcp_fixture_server: McpTestServer, mcp_sse_server: McpTestServer) -> None:
    pool = McpPool(idle_timeout=0.2)
    try:
        await pool.call_tool(ref(mcp_fixture_server), "add", {"a": 1, "b": 2}, timeout=5)
        await pool.call_tool(ref(mcp_sse_server, "sse"), "add", {"a": 1, "b": 2}, timeout=5)
        assert pool.session_count == 2 and len(mcp_tasks()) >= 2
        deadline = time.monotonic() + 3
        while (pool.session_count or len(mcp_tasks())) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert pool.session_count == 0 and mcp_tasks() == []  # workers and the reaper are gone
        # and the next call simply opens a new session
        assert (await pool.call_tool(ref(mcp_fixture_server), "add", {"a": 2, "b": 2}, timeout=5)).output == "4"
    finally:
        await pool.aclose()
    assert mcp_tasks() == []


async def test_pool_is_bounded_lru(mcp_fixture_server: McpTestServer) -> None:
    pool = McpPool(max_sessions=2)
    try:
        for who in ("a", "b", "c"):
            await pool.call_tool(ref(mcp_fixture_server, authorization=who), "add", {"a": 1, "b": 1}, timeout=5)
            assert pool.session_count <= 2
        keys = [k[2] for k in pool._sessions]
        assert ref(mcp_fixture_server, authorization="a").pool_key()[2] not in keys  # the oldest went
    finally:
        await pool.aclose()


async def test_busy_sessions_are_not_evicted(mcp_fixture_server: McpTestServer) -> None:
    pool = McpPool(max_sessions=1)
    try:
        busy = asyncio.create_task(pool.call_tool(ref(mcp_fixture_server, authorization="a"), "sleep",
                                                  {"seconds": 0.3}, timeout=5))
        await asyncio.sleep(0.1)
        other = await pool.call_tool(ref(mcp_fixture_server, authorization="b"), "add", {"a": 1, "b": 1}, timeout=5)
        assert other.output == "2" and (await busy).output == "slept 0.3"
    finally:
        await pool.aclose()


async def test_aclose_leaves_no_tasks(mcp_fixture_server: McpTestServer, mcp_everything_server: McpTestServer) -> None:
    pool = McpPool()
    await pool.list_tools(ref(mcp_fixture_server))
    await pool.list_tools(ref(mcp_everything_server, "everything"))
    await pool.aclose()
    assert pool.session_count == 0 and mcp_tasks() == []
    closed = await pool.call_tool(ref(mcp_fixture_server), "add", {"a": 1, "b": 1}, timeout=5)
    assert closed.error is not None and closed.error["code"] == 503


async def test_concurrent_calls_share_one_session(pool: McpPool, mcp_fixture_server: McpTestServer) -> None:
    server = ref(mcp_fixture_server)
    results = await asyncio.gather(*(pool.call_tool(server, "add", {"a": i, "b": 1}, timeout=5) for i in range(20)))
    assert [r.output for r in results] == [str(i + 1) for i in range(20)]
    assert pool.session_count == 1


# --- secrets stay out of the logs -------------------------------------------------------------------------


async def test_no_secrets_in_logs(
    mcp_fixture_server: McpTestServer, caplog: pytest.LogCaptureFixture
) -> None:
    key, token, argument = (f"{what}-{secrets.token_hex(8)}" for what in ("key", "token", "arg"))
    pool = McpPool()
    caplog.set_level(logging.DEBUG)
    try:
        with structlog.testing.capture_logs() as logs:
            target = ref(mcp_fixture_server, "secretive", headers={"X-Api-Key": key}, authorization=token)
            await pool.list_tools(target)
            assert (await pool.call_tool(target, "echo", {"text": argument}, timeout=5)).output == argument
            await pool.call_tool(target, "fail", {"message": argument}, timeout=5)
            await pool.call_tool(target, "sleep", {"seconds": 5}, timeout=0.2)
            dead = McpServerRef("dead", f"http://127.0.0.1:{_closed_port()}/mcp?k={key}", authorization=token)
            await pool.call_tool(dead, "echo", {"text": argument}, timeout=5)
    finally:
        await pool.aclose()
    events = {e["event"] for e in logs}
    assert {"mcp.session.opened", "mcp.list_tools", "mcp.call", "mcp.session.failed"} <= events
    calls = [e for e in logs if e["event"] == "mcp.call"]
    assert {(e["server_label"], e["tool"], e["outcome"]) for e in calls} >= {
        ("secretive", "echo", "ok"), ("secretive", "fail", "mcp_tool_execution_error"),
        ("secretive", "sleep", "http_error"), ("dead", "echo", "http_error")}
    assert all(isinstance(e["duration_ms"], int) for e in calls)
    text = repr(logs) + caplog.text
    for secret in (key, token, argument):
        assert secret not in text


# --- host policy ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("allowed", "url", "ok"), [
    ("*", "https://mcp.example.com/mcp", True),
    ("*", "http://127.0.0.1:8000/mcp", False),  # '*' never includes loopback
    ("127.0.0.1", "http://127.0.0.1:8000/mcp", True),
    ("mcp.example.com", "https://mcp.example.com/mcp", True),
    ("mcp.example.com", "https://MCP.Example.COM./mcp", True),
    ("mcp.example.com", "https://other.example.com/mcp", False),
    ("mcp.example.com:8443", "https://mcp.example.com:8443/mcp", True),
    ("mcp.example.com:8443", "https://mcp.example.com/mcp", False),
    ("mcp.example.com:443", "https://mcp.example.com/mcp", True),
    ("*.example.com", "https://a.b.example.com/mcp", True),
    ("*.example.com", "https://example.com/mcp", False),
    ("*.example.com", "https://badexample.com/mcp", False),
    ("a.com, b.com", "https://b.com/x", True),
    ("", "https://mcp.example.com/mcp", False),
    ("[::1]:9000", "http://[::1]:9000/mcp", True),
    ("::1", "http://[::1]:9000/mcp", True),
    ("*", "ftp://mcp.example.com/mcp", False),
    ("*", "file:///etc/passwd", False),
    ("*", "mcp.example.com/mcp", False),
    ("*", "http://mcp.example.com:99999/mcp", False),
])
def test_policy_allowlist(allowed: str, url: str, ok: bool) -> None:
    reason = HostPolicy.from_settings(allowed).check(url)
    assert (reason is None) == ok, reason


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",
    "http://169.254.1.2:8080/mcp",
    "http://[fe80::1]/mcp",
    "http://[fd00:ec2::254]/mcp",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://METADATA.google.internal./x",
    "http://[::ffff:169.254.169.254]/mcp",
    "http://2852039166/mcp",  # 169.254.169.254 in the spellings the resolver accepts
    "http://0xa9fea9fe/mcp",
    "http://169.254.43518/mcp",
])
def test_policy_refuses_metadata_and_link_local_even_under_wildcards(url: str) -> None:
    assert HostPolicy.from_settings("*, *.internal, *.google.internal").check(url) is not None


def test_policy_allows_sensitive_hosts_listed_explicitly() -> None:
    policy = HostPolicy.from_settings("169.254.169.254, metadata.google.internal, [fe80::1]:8080")
    assert policy.check("http://169.254.169.254/latest") is None
    assert policy.check("http://2852039166/latest") is None  # the same address, spelled otherwise
    assert policy.check("http://metadata.google.internal/x") is None
    assert policy.check("http://[fe80::1]:8080/mcp") is None
    assert policy.check("http://[fe80::1]:9090/mcp") is not None  # listed with another port
    assert policy.check("http://169.254.1.1/x") is not None


def test_policy_servers_file_hosts_are_reachable_only_through_their_labels() -> None:
    policy = HostPolicy.from_settings("*", ["169.254.10.10:8080", "tools.example:443"])
    assert "server_label" in (policy.check("https://tools.example/mcp") or "")
    assert policy.check("http://169.254.10.10:8080/mcp") is not None
    assert policy.check("https://tools.example:8443/mcp") is None  # another port is another server
    assert policy.check("https://other.example/mcp") is None
    explicit = HostPolicy.from_settings("tools.example", ["tools.example:443"])
    assert explicit.check("https://tools.example/mcp") is None  # named in --mcp-allowed-hosts too


def test_policy_resolved_addresses() -> None:
    policy = HostPolicy.from_settings("*, listed.example")
    assert policy.check_addresses("https://ok.example/mcp", ["93.184.215.14", "2606:2800::1"]) is None
    assert policy.check_addresses("https://evil.example/mcp", ["93.184.215.14", "169.254.169.254"]) is not None
    assert policy.check_addresses("https://evil.example/mcp", ["fe80::1%eth0"]) is not None
    assert policy.check_addresses("https://listed.example/mcp", ["169.254.169.254"]) is None


@pytest.mark.parametrize("bad", ["exa mple.com/x", "*.*.com", "a.*.com", "host:port", "host:0", "[::1", "u@h"])
def test_policy_rejects_malformed_patterns(bad: str) -> None:
    with pytest.raises(ValueError):
        HostPolicy.from_settings(bad)


async def test_pool_applies_the_policy_before_connecting(mcp_fixture_server: McpTestServer) -> None:
    pool = McpPool(policy=HostPolicy.from_settings("mcp.example.com"))
    try:
        result = await pool.call_tool(ref(mcp_fixture_server), "add", {"a": 1, "b": 1}, timeout=5)
        assert result.error is not None and (result.error["type"], result.error["code"]) == ("http_error", 403)
        with pytest.raises(McpServerError):
            await pool.list_tools(ref(mcp_fixture_server))
        assert pool.session_count == 0
    finally:
        await pool.aclose()


async def test_pool_refuses_names_resolving_to_metadata(mcp_fixture_server: McpTestServer) -> None:
    async def to_metadata(host: str, port: int) -> Sequence[str]:
        return ["169.254.169.254"]

    port = mcp_fixture_server.base_url.rsplit(":", 1)[1]
    server = McpServerRef(label="alias", url=f"http://localhost:{port}/mcp")
    async def to_loopback(host: str, port: int) -> Sequence[str]:
        assert host == "mcp.test"
        return ["127.0.0.1"]

    refusing = McpPool(policy=HostPolicy.from_settings("*"), resolver=to_metadata)
    # A name nobody else can resolve: it works only because the connection goes to the address the check saw.
    listing = McpPool(policy=HostPolicy.from_settings("mcp.test"), resolver=to_loopback)
    real_dns = McpPool(policy=HostPolicy.from_settings("localhost"))
    try:
        refused = await refusing.call_tool(server, "add", {"a": 1, "b": 1}, timeout=5)
        assert refused.error is not None and refused.error["code"] == 403
        assert "loopback" in refused.error["message"]  # localhost: refused on its name already
        alias = McpServerRef(label="alias", url=f"http://mcp.test:{port}/mcp")
        refused = await McpPool(policy=HostPolicy.from_settings("*"), resolver=to_metadata).call_tool(
            alias, "add", {"a": 1, "b": 1}, timeout=5)
        assert refused.error is not None and refused.error["code"] == 403
        assert "metadata" in refused.error["message"]
        assert (await listing.call_tool(alias, "add", {"a": 1, "b": 1}, timeout=5)).output == "2"
        assert (await real_dns.call_tool(server, "add", {"a": 1, "b": 2}, timeout=5)).output == "3"
    finally:
        await asyncio.gather(refusing.aclose(), listing.aclose(), real_dns.aclose())


# --- the servers file -------------------------------------------------------------------------------------


@pytest.fixture
def servers_file(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "servers.json"


def test_servers_file_loads(servers_file: Path) -> None:
    servers_file.write_text(json.dumps({"servers": {
        "docs": {"url": "https://docs.example.com/mcp", "headers": {"X-Api-Key": "k-123"},
                 "allowed_tools": ["search"], "require_approval": "never"},
        "calc": {"url": "http://10.0.0.5:9000/mcp",
                 "require_approval": {"never": {"tool_names": ["add"]}, "always": {"read_only": False}},
                 "allowed_tools": {"read_only": True}},
        "bare": {"url": "http://[fd12::5]:7000/mcp"},
    }}))
    servers = load_servers_file(servers_file)
    assert list(servers) == ["docs", "calc", "bare"]
    docs = servers["docs"]
    assert (docs.url, dict(docs.headers), docs.allowed_tools, docs.require_approval) == (
        "https://docs.example.com/mcp", {"X-Api-Key": "k-123"}, ["search"], "never")
    assert "k-123" not in repr(docs)
    assert servers["calc"].require_approval == {"never": {"tool_names": ["add"]}, "always": {"read_only": False}}
    assert servers["calc"].allowed_tools == {"read_only": True}
    assert servers["bare"].headers == {} and servers["bare"].allowed_tools is None
    assert [s.host_pattern for s in servers.values()] == ["docs.example.com:443", "10.0.0.5:9000", "[fd12::5]:7000"]
    policy = HostPolicy.from_settings("*", [s.host_pattern for s in servers.values()])
    assert all(policy.check(s.url) is not None for s in servers.values())  # only through their labels
    server_ref = docs.ref(authorization="tok")
    assert server_ref.request_headers() == {"X-Api-Key": "k-123", "Authorization": "Bearer tok"}


@pytest.mark.parametrize(("document", "where"), [
    ([], "top level"),
    ({"servers": {}, "extra": 1}, "unknown key"),
    ({"servers": []}, "servers"),
    ({"servers": {"a": {}}}, "servers.a.url"),
    ({"servers": {"a": {"url": 5}}}, "servers.a.url"),
    ({"servers": {"a": {"url": "ftp://x/y"}}}, "http or https"),
    ({"servers": {"a": {"url": "http:///nohost"}}}, "servers.a.url"),
    ({"servers": {"a": {"url": "http://x", "header": {}}}}, "unknown key(s) ['header']"),
    ({"servers": {"a": {"url": "http://x", "headers": {"Bad Name": "v"}}}}, "invalid header name"),
    ({"servers": {"a": {"url": "http://x", "headers": {"X-K": 5}}}}, "servers.a.headers.X-K"),
    ({"servers": {"a": {"url": "http://x", "allowed_tools": "add"}}}, "servers.a.allowed_tools"),
    ({"servers": {"a": {"url": "http://x", "allowed_tools": [""]}}}, "servers.a.allowed_tools"),
    ({"servers": {"a": {"url": "http://x", "require_approval": "sometimes"}}}, "servers.a.require_approval"),
    ({"servers": {"a": {"url": "http://x", "require_approval": {"always": {"tool_names": "x"}}}}},
     "servers.a.require_approval.always.tool_names"),
    ({"servers": {"a b": {"url": "http://x"}}}, "servers.a b"),
])
def test_servers_file_errors_say_where(document: Any, where: str) -> None:
    with pytest.raises(McpServersFileError) as excinfo:
        parse_servers(document, source="s.json")
    assert "--mcp-servers-file s.json" in str(excinfo.value) and where in str(excinfo.value)


def test_servers_file_unreadable_or_not_json(servers_file: Path) -> None:
    with pytest.raises(McpServersFileError, match="cannot read"):
        load_servers_file(servers_file)
    servers_file.write_text('{"servers": {"a": ')
    with pytest.raises(McpServersFileError, match="invalid JSON at line 1"):
        load_servers_file(servers_file)


def test_servers_file_errors_never_echo_header_values() -> None:
    secret = "sk-" + secrets.token_hex(8)
    with pytest.raises(McpServersFileError) as excinfo:
        parse_servers({"servers": {"a": {"url": "http://x", "headers": {"X-K": secret + "\n"}}}})
    assert secret not in str(excinfo.value)
