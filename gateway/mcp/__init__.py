"""Gateway-executed remote MCP tools: the I/O layer (host policy, servers file, pooled SDK sessions)."""

from gateway.mcp.policy import HostPattern, HostPolicy
from gateway.mcp.servers import McpServerConfig, McpServersFileError, load_servers_file, parse_servers
from gateway.mcp.session import OUTPUT_TRUNCATED_NOTE, McpCallResult, McpPool, McpServerError, McpServerRef

__all__ = [
    "OUTPUT_TRUNCATED_NOTE",
    "HostPattern",
    "HostPolicy",
    "McpCallResult",
    "McpPool",
    "McpServerConfig",
    "McpServerError",
    "McpServerRef",
    "McpServersFileError",
    "load_servers_file",
    "parse_servers",
]
