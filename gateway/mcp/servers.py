"""``--mcp-servers-file``: MCP servers the operator configures by label.

Format (JSON)::

    {"servers": {"<label>": {"url": "https://…", "headers": {"X-Api-Key": "…"},
                             "allowed_tools": ["a", "b"] | {"tool_names": […], "read_only": true},
                             "require_approval": "always" | "never" | {"always": {…}, "never": {…}}}}}

``allowed_tools`` and ``require_approval`` take the same shapes as the Responses API ``mcp`` tool fields
(openai ``types/responses/tool.py``) and are kept as those plain JSON values. Every problem is reported at
start-up as one ``McpServersFileError`` naming the file and the JSON path; header *values* never appear in
an error or a repr.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gateway.mcp.policy import url_host_port
from gateway.mcp.session import McpServerRef

__all__ = ["McpServerConfig", "McpServersFileError", "load_servers_file", "parse_servers"]

_SERVER_KEYS = frozenset({"url", "headers", "allowed_tools", "require_approval"})
_FILTER_KEYS = frozenset({"tool_names", "read_only"})
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 token
_LABEL = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class McpServersFileError(ValueError):
    """The servers file is unreadable or invalid; the message says where."""


_Fail = Callable[[str, str], McpServersFileError]  # (JSON path, problem) → the error to raise


@dataclass(frozen=True)
class McpServerConfig:
    label: str
    url: str
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False, hash=False)
    allowed_tools: list[str] | dict[str, Any] | None = field(default=None, hash=False)
    require_approval: str | dict[str, Any] | None = field(default=None, hash=False)

    def ref(self, authorization: str | None = None) -> McpServerRef:
        """The connection identity for ``McpPool`` (request-supplied ``authorization`` on top, if any)."""
        return McpServerRef(label=self.label, url=self.url, headers=dict(self.headers), authorization=authorization)

    @property
    def host_pattern(self) -> str:
        """``host:port`` of the URL, to add to the ``HostPolicy`` as an explicit listing."""
        _, host, port = url_host_port(self.url)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def load_servers_file(path: str | Path) -> dict[str, McpServerConfig]:
    """Read and validate the servers file; ``McpServersFileError`` on any problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise McpServersFileError(f"--mcp-servers-file {source}: cannot read it: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise McpServersFileError(f"--mcp-servers-file {source}: not UTF-8 text") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise McpServersFileError(
            f"--mcp-servers-file {source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    return parse_servers(data, source=source)


def parse_servers(data: Any, *, source: str = "<servers>") -> dict[str, McpServerConfig]:
    """Validate the decoded JSON document; label → config."""

    def fail(where: str, problem: str) -> McpServersFileError:
        return McpServersFileError(f"--mcp-servers-file {source}: {where}: {problem}")

    if not isinstance(data, dict):
        raise fail("top level", 'expected an object {"servers": {...}}')
    extra = set(data) - {"servers"}
    if extra:
        raise fail("top level", f"unknown key(s) {sorted(extra)}; only 'servers' is allowed")
    servers = data.get("servers")
    if not isinstance(servers, dict):
        raise fail("servers", "expected an object mapping labels to server settings")
    out: dict[str, McpServerConfig] = {}
    for label, spec in servers.items():
        where = f"servers.{label}"
        if not _LABEL.match(label):
            raise fail(where, "a label is 1-128 characters of letters, digits, '_', '-' and '.'")
        if not isinstance(spec, dict):
            raise fail(where, "expected an object with at least 'url'")
        unknown = set(spec) - _SERVER_KEYS
        if unknown:
            raise fail(where, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_SERVER_KEYS)}")
        out[label] = McpServerConfig(
            label=label,
            url=_url(spec.get("url"), where, fail),
            headers=MappingProxyType(_headers(spec.get("headers"), where, fail)),
            allowed_tools=_allowed_tools(spec.get("allowed_tools"), where, fail),
            require_approval=_require_approval(spec.get("require_approval"), where, fail),
        )
    return out


def _url(value: Any, where: str, fail: _Fail) -> str:
    if not isinstance(value, str) or not value:
        raise fail(f"{where}.url", "required, a string")
    try:
        scheme, _, _ = url_host_port(value)
    except ValueError as exc:
        raise fail(f"{where}.url", f"invalid URL ({exc})") from None
    if scheme not in ("http", "https"):
        raise fail(f"{where}.url", "the scheme must be http or https")
    return value


def _headers(value: Any, where: str, fail: _Fail) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{where}.headers", "expected an object of header name → string value")
    for name, v in value.items():
        if not _HEADER_NAME.match(name):
            raise fail(f"{where}.headers", f"invalid header name {name!r}")
        # The value is a secret: say what is wrong with it, never echo it.
        if not isinstance(v, str) or any(c in v for c in "\r\n\0"):
            raise fail(f"{where}.headers.{name}", "the value must be a string without CR, LF or NUL")
    return dict(value)


def _names(value: Any, where: str, fail: _Fail) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise fail(where, "expected a list of non-empty tool names")
    return list(value)


def _tool_filter(value: Any, where: str, fail: _Fail) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) - _FILTER_KEYS:
        raise fail(where, "expected an object with 'tool_names' (a list) and/or 'read_only' (a boolean)")
    out: dict[str, Any] = {}
    if "tool_names" in value:
        out["tool_names"] = _names(value["tool_names"], f"{where}.tool_names", fail)
    if "read_only" in value:
        if not isinstance(value["read_only"], bool):
            raise fail(f"{where}.read_only", "expected true or false")
        out["read_only"] = value["read_only"]
    return out


def _allowed_tools(value: Any, where: str, fail: _Fail) -> list[str] | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, list):
        return _names(value, f"{where}.allowed_tools", fail)
    return _tool_filter(value, f"{where}.allowed_tools", fail)


def _require_approval(value: Any, where: str, fail: _Fail) -> str | dict[str, Any] | None:
    at = f"{where}.require_approval"
    if value is None:
        return None
    if value in ("always", "never"):
        return str(value)
    if not isinstance(value, dict) or not value or set(value) - {"always", "never"}:
        raise fail(at, "expected 'always', 'never' or an object with 'always' and/or 'never' tool filters")
    return {k: _tool_filter(v, f"{at}.{k}", fail) for k, v in value.items()}
