"""Binds one request's ``mcp`` tools to servers: the allowlist, the servers file, credentials, the pool.

``McpHub.bind`` runs before anything is contacted: a request naming more than ``--max-mcp-servers-per-request``
distinct servers is a 400 naming the tool that goes over; a ``server_url`` outside ``--mcp-allowed-hosts`` is a
400 (``mcp_server_not_allowed``) naming the tool; a label of ``--mcp-servers-file`` binds to that entry.

A servers-file entry is a ceiling: the request may narrow it, never widen it. Its ``allowed_tools`` is intersected
with the file's (``null`` or absent: the file's), its ``require_approval`` can only add approvals (the file's
absent ``require_approval`` means ``always``, OpenAI's default), and it may not bring its own ``headers`` or
``authorization`` for that server, nor point the label at another URL. Credentials travel in ``McpServerRef`` to
the pool only: the tools echoed in the response and stored are stripped of them (``tool_context.public_tool``).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from typing import Any

from gateway.config import Settings
from gateway.errors import InvalidRequest
from gateway.mcp.policy import HostPolicy
from gateway.mcp.servers import McpServerConfig, load_servers_file
from gateway.mcp.session import McpPool, McpServerRef
from gateway.translate.mcp_items import CEILING_APPROVAL, McpCallOutcome, allowed_names
from gateway.translate.tool_context import ResolvedToolContext

__all__ = ["GatewayMcpHub"]


class _Executor:
    def __init__(self, pool: McpPool, refs: Mapping[str, McpServerRef], timeout: float,
                 configured: Mapping[str, Any]) -> None:
        self.pool = pool
        self.refs = refs
        self.timeout = timeout
        self.configured = configured

    def metric_label(self, label: str) -> str:
        """A server label as a metric label value: the operator's labels only, else ``other``."""
        return label if label in self.configured else "other"

    async def list_tools(self, label: str) -> list[dict[str, Any]]:
        return await self.pool.list_tools(self.refs[label])

    async def call_tool(self, label: str, name: str, arguments: dict[str, Any]) -> McpCallOutcome:
        result = await self.pool.call_tool(self.refs[label], name, arguments, timeout=self.timeout)
        return McpCallOutcome(output=result.output, error=result.error)


def _local_addresses(listen_host: str) -> list[str]:
    """The machine's own addresses when the gateway listens on all of them (best effort, at start-up)."""
    if listen_host.strip("[]") not in ("0.0.0.0", "::", ""):
        return []
    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)]
    except OSError:
        return []


def _narrowed(configured: Any, requested: Any) -> Any:
    """``allowed_tools`` of a servers-file entry narrowed by the request's: names intersected, ``read_only`` if
    either says so. None: every tool."""
    file_names = allowed_names({"allowed_tools": configured})
    asked = allowed_names({"allowed_tools": requested})
    names = file_names if asked is None else asked if file_names is None else file_names & asked
    read_only = any(isinstance(v, dict) and v.get("read_only") is True for v in (configured, requested))
    ordered = None if names is None else sorted(names)
    if not read_only:
        return ordered
    return {"read_only": True} if ordered is None else {"tool_names": ordered, "read_only": True}


class GatewayMcpHub:
    """One per process; ``aclose`` at shutdown closes the pooled sessions."""

    def __init__(self, settings: Settings, pool: McpPool | None = None) -> None:
        self.settings = settings
        self.servers: dict[str, McpServerConfig] = (load_servers_file(settings.mcp_servers_file)
                                                    if settings.mcp_servers_file else {})
        self.policy = HostPolicy.from_settings(",".join(settings.mcp_allowed_hosts),
                                               [c.host_pattern for c in self.servers.values()],
                                               listen=(settings.host, settings.port),
                                               local_addresses=_local_addresses(settings.host))
        self.pool = pool or McpPool(policy=self.policy)

    async def aclose(self) -> None:
        await self.pool.aclose()

    def bind(self, ctx: ResolvedToolContext, body: Mapping[str, Any], owner: str | None = None
             ) -> tuple[ResolvedToolContext, _Executor]:
        raw = tools if isinstance(tools := body.get("tools"), list) else []
        index = {t.get("server_label"): i for i, t in enumerate(raw) if isinstance(t, dict) and t.get("type") == "mcp"}
        refs: dict[str, McpServerRef] = {}
        merged: list[Mapping[str, Any]] = []
        distinct: set[str] = set()
        for tool in ctx.mcp_tools:
            label = str(tool["server_label"])
            param = f"tools[{index.get(label, 0)}]"
            url = tool.get("server_url")
            config = self.servers.get(label)
            distinct.add(f"file:{label}" if config is not None else f"url:{url}")
            if len(distinct) > self.settings.max_mcp_servers_per_request:
                raise InvalidRequest(f"This request names more than {self.settings.max_mcp_servers_per_request} MCP "
                                     "servers (--max-mcp-servers-per-request).", param=param,
                                     code="too_many_mcp_servers")
            if config is not None:
                merged.append(self._bind_configured(config, tool, param))
                refs[label] = dataclasses.replace(config.ref(), owner=owner, configured=True)
                continue
            if url is None:
                raise InvalidRequest(f"The mcp tool '{label}' has no server_url, and the gateway has no server "
                                     "configured under that label.", param=f"{param}.server_url",
                                     code="mcp_server_not_allowed")
            reason = self.policy.check(str(url))
            if reason is not None:
                raise InvalidRequest(f"The mcp tool '{label}' names a server the gateway may not reach: {reason}.",
                                     param=f"{param}.server_url", code="mcp_server_not_allowed")
            auth = tool.get("authorization") if isinstance(tool.get("authorization"), str) else None
            headers = given if isinstance(given := tool.get("headers"), dict) else {}
            refs[label] = McpServerRef(label=label, url=str(url), headers=dict(headers), authorization=auth,
                                       owner=owner)
            merged.append(tool)
        return dataclasses.replace(ctx, mcp_tools=tuple(merged)), _Executor(
            self.pool, refs, self.settings.mcp_call_timeout, self.servers)

    @staticmethod
    def _bind_configured(config: McpServerConfig, tool: Mapping[str, Any], param: str) -> dict[str, Any]:
        """The request's tool under the servers file's ceiling (see the module docstring)."""
        label = config.label
        url = tool.get("server_url")
        if url is not None and str(url) != config.url:
            raise InvalidRequest(f"The server_label '{label}' is a server the gateway configures; a request cannot "
                                 "point it at another server_url.", param=f"{param}.server_url",
                                 code="mcp_server_not_allowed")
        for key in ("headers", "authorization"):
            if tool.get(key) is not None:
                raise InvalidRequest(f"The server_label '{label}' is a server the gateway configures with its own "
                                     f"credentials; a request cannot send '{key}' to it.", param=f"{param}.{key}",
                                     code="mcp_server_not_allowed")
        bound = {k: v for k, v in tool.items() if k not in ("allowed_tools", "require_approval")}
        bound["allowed_tools"] = _narrowed(config.allowed_tools, tool.get("allowed_tools"))
        requested = tool.get("require_approval")
        bound["require_approval"] = requested if requested is not None else config.require_approval or "always"
        bound[CEILING_APPROVAL] = config.require_approval or "always"
        return bound
