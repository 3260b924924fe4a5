"""Binds one request's ``mcp`` tools to servers: the allowlist, the servers file, credentials, the pool.

``McpHub.bind`` runs before anything is contacted: a ``server_url`` outside ``--mcp-allowed-hosts`` is a 400
(``mcp_server_not_allowed``) naming the tool, and a label-only tool must name a server of
``--mcp-servers-file`` (whose URL, headers, ``allowed_tools`` and ``require_approval`` it then uses, the
request's own fields winning). Credentials travel in ``McpServerRef`` to the pool only: the tools echoed in the
response and stored are stripped of them (``tool_context.public_tool``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gateway.config import Settings
from gateway.errors import InvalidRequest
from gateway.mcp.policy import HostPolicy
from gateway.mcp.servers import McpServerConfig, load_servers_file
from gateway.mcp.session import McpPool, McpServerRef
from gateway.translate.mcp_items import McpCallOutcome
from gateway.translate.tool_context import ResolvedToolContext

__all__ = ["GatewayMcpHub"]


class _Executor:
    def __init__(self, pool: McpPool, refs: Mapping[str, McpServerRef], timeout: float) -> None:
        self.pool = pool
        self.refs = refs
        self.timeout = timeout

    async def list_tools(self, label: str) -> list[dict[str, Any]]:
        return await self.pool.list_tools(self.refs[label])

    async def call_tool(self, label: str, name: str, arguments: dict[str, Any]) -> McpCallOutcome:
        result = await self.pool.call_tool(self.refs[label], name, arguments, timeout=self.timeout)
        return McpCallOutcome(output=result.output, error=result.error)


class GatewayMcpHub:
    """One per process; ``aclose`` at shutdown closes the pooled sessions."""

    def __init__(self, settings: Settings, pool: McpPool | None = None) -> None:
        self.settings = settings
        self.servers: dict[str, McpServerConfig] = (load_servers_file(settings.mcp_servers_file)
                                                    if settings.mcp_servers_file else {})
        self.policy = HostPolicy.from_settings(",".join(settings.mcp_allowed_hosts),
                                               [c.host_pattern for c in self.servers.values()])
        self.pool = pool or McpPool(policy=self.policy)

    async def aclose(self) -> None:
        await self.pool.aclose()

    def bind(self, ctx: ResolvedToolContext, body: Mapping[str, Any]) -> tuple[ResolvedToolContext, _Executor]:
        raw = body.get("tools") if isinstance(body.get("tools"), list) else []
        index = {t.get("server_label"): i for i, t in enumerate(raw) if isinstance(t, dict) and t.get("type") == "mcp"}
        refs: dict[str, McpServerRef] = {}
        merged: list[Mapping[str, Any]] = []
        for tool in ctx.mcp_tools:
            label = str(tool["server_label"])
            param = f"tools[{index.get(label, 0)}]"
            url = tool.get("server_url")
            auth = tool.get("authorization") if isinstance(tool.get("authorization"), str) else None
            if url is None:
                config = self.servers.get(label)
                if config is None:
                    raise InvalidRequest(f"The mcp tool '{label}' has no server_url, and the gateway has no server "
                                         "configured under that label.", param=f"{param}.server_url",
                                         code="mcp_server_not_allowed")
                refs[label] = config.ref(authorization=auth)
                defaults = {"allowed_tools": config.allowed_tools, "require_approval": config.require_approval}
                merged.append({**{k: v for k, v in defaults.items() if v is not None}, **tool})
                continue
            reason = self.policy.check(str(url))
            if reason is not None:
                raise InvalidRequest(f"The mcp tool '{label}' names a server the gateway may not reach: {reason}.",
                                     param=f"{param}.server_url", code="mcp_server_not_allowed")
            headers = tool.get("headers") if isinstance(tool.get("headers"), dict) else {}
            refs[label] = McpServerRef(label=label, url=str(url), headers=dict(headers), authorization=auth)
            merged.append(tool)
        return dataclasses.replace(ctx, mcp_tools=tuple(merged)), _Executor(self.pool, refs,
                                                                           self.settings.mcp_call_timeout)
