"""Which remote MCP server URLs the gateway may connect to.

The gateway opens connections on behalf of its callers, so a ``server_url`` in a request is an SSRF vector.
``HostPolicy`` is the allowlist (``--mcp-allowed-hosts`` plus the hosts named in ``--mcp-servers-file``):

- patterns, comma-separated: ``host`` (any port), ``host:port``, ``[v6addr]``/``[v6addr]:port``, ``*.example.com``
  (any subdomain, not the apex) and ``*`` (anything);
- the scheme must be ``http`` or ``https``;
- link-local addresses (169.254.0.0/16, fe80::/10) and cloud metadata endpoints (169.254.169.254,
  fd00:ec2::254, metadata.google.internal) are refused unless a pattern names them *literally*: a wildcard
  (``*``, ``*.internal``) never lets them through.

``check(url)`` looks at the URL text only; IPv4 written in the legacy forms the resolver accepts (``2852039166``,
``0xa9fea9fe``) is decoded, so those cannot hide a metadata address. A *name* that resolves to such an
address is caught by ``check_addresses``, which the session layer (``gateway.mcp.session``) calls with the
result of ``getaddrinfo`` before it connects. What remains out of scope is DNS rebinding between that lookup
and the HTTP client's own lookup a moment later (closing it needs connecting to the checked address itself).
Pure: no I/O here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["HostPattern", "HostPolicy", "is_ip_literal", "url_host_port"]

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_METADATA_ADDRESSES = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})
_METADATA_NAMES = frozenset({"metadata.google.internal"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _parse_ip(host: str) -> IpAddress | None:
    """``host`` as an IP address, including the legacy IPv4 spellings ``inet_aton`` (and so getaddrinfo) takes."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not host or not all(c in "0123456789abcdefx." for c in host):
            return None
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:169.254.169.254 reaches the IPv4 address
    return ip


def _normalize_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _is_sensitive_ip(ip: IpAddress) -> bool:
    return ip in _METADATA_ADDRESSES or any(ip in net for net in _LINK_LOCAL if ip.version == net.version)


def _sensitive_host(host: str) -> str | None:
    """Why ``host`` (normalized) needs an explicit listing, or None."""
    if host in _METADATA_NAMES:
        return "a cloud metadata endpoint"
    ip = _parse_ip(host)
    if ip is not None and _is_sensitive_ip(ip):
        return "a cloud metadata endpoint" if ip in _METADATA_ADDRESSES else "a link-local address"
    return None


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` (as ``url_host_port`` returns it) is an address rather than a name to resolve."""
    return _parse_ip(host) is not None


def url_host_port(url: str) -> tuple[str, str, int]:
    """(scheme, normalized host, port) of an http(s) URL; ValueError when it has no host or a bad port."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = _normalize_host(parts.hostname or "")
    if not host:
        raise ValueError("the URL has no host")
    port = parts.port  # raises ValueError for a non-numeric or out-of-range port
    return scheme, host, port if port is not None else _DEFAULT_PORTS.get(scheme, 0)


@dataclass(frozen=True)
class HostPattern:
    """One allowlist entry. ``host`` is normalized; ``"*"`` or ``"*.suffix"`` for wildcards."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> HostPattern:
        text = text.strip().lower()
        if not text:
            raise ValueError("empty host pattern")
        if text == "*":
            return cls("*")
        port: int | None = None
        if text.startswith("["):  # [v6] or [v6]:port
            end = text.find("]")
            if end < 0:
                raise ValueError(f"bad host pattern {text!r}: unclosed '['")
            host, rest = text[1:end], text[end + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"bad host pattern {text!r}")
                port = _parse_port(rest[1:], text)
        elif text.count(":") == 1:
            host, port_text = text.split(":")
            port = _parse_port(port_text, text)
        else:  # a name, an IPv4 address, or a bare IPv6 address (two colons or more, no port)
            host = text
        host = _normalize_host(host)
        if not host or "/" in host or "@" in host or (host.count("*") and not _valid_wildcard(host)):
            raise ValueError(f"bad host pattern {text!r}")
        ip = _parse_ip(host)
        return cls(str(ip) if ip is not None else host, port)

    @property
    def is_wildcard(self) -> bool:
        return self.host.startswith("*")

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.host == "*":
            return True
        if self.host.startswith("*."):
            return host.endswith(self.host[1:])  # "*.example.com" → any subdomain, not the apex
        return self.literally_names(host)

    def literally_names(self, host: str) -> bool:
        """Whether this (non-wildcard) pattern names ``host`` itself: exact name or the same IP address."""
        if self.is_wildcard:
            return False
        if self.host == host:
            return True
        mine, theirs = _parse_ip(self.host), _parse_ip(host)
        return mine is not None and mine == theirs


def _parse_port(text: str, pattern: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port in host pattern {pattern!r}")
    return int(text)


def _valid_wildcard(host: str) -> bool:
    return host.startswith("*.") and host.count("*") == 1 and len(host) > 2


@dataclass(frozen=True)
class HostPolicy:
    """An allowlist of MCP server hosts; see the module docstring for the rules."""

    patterns: tuple[HostPattern, ...]

    @classmethod
    def from_settings(cls, allowed: str, servers_file_hosts: Iterable[str] = ()) -> HostPolicy:
        """``allowed``: comma-separated patterns (``""`` allows nothing). ``servers_file_hosts``: the
        ``host`` / ``host:port`` of each URL in the servers file; an operator wrote them, so they count as
        explicit listings. ValueError on a malformed pattern (a start-up error)."""
        texts = [t for t in allowed.split(",") if t.strip()]
        patterns = [HostPattern.parse(t) for t in texts]
        patterns.extend(HostPattern.parse(h) for h in servers_file_hosts)
        return cls(tuple(dict.fromkeys(patterns)))

    def check(self, url: str) -> str | None:
        """None when ``url`` may be connected to, else the reason it may not (safe to show the caller)."""
        try:
            scheme, host, port = url_host_port(url)
        except ValueError as exc:
            return f"invalid MCP server URL: {exc}"
        if scheme not in _DEFAULT_PORTS:
            return f"MCP server URL scheme must be http or https, not {scheme or 'missing'!r}"
        if not any(p.matches(host, port) for p in self.patterns):
            return f"MCP server host {host!r} is not in the gateway's allowed hosts"
        return self._sensitive_reason(host, port, _sensitive_host(host))

    def check_addresses(self, url: str, addresses: Iterable[str]) -> str | None:
        """None unless a resolved address of ``url``'s host is link-local or a metadata endpoint and the host
        (or that address) is not listed explicitly. Call it after ``check(url)`` passed."""
        _, host, port = url_host_port(url)
        for address in addresses:
            ip = _parse_ip(_normalize_host(address.split("%", 1)[0]))  # drop an IPv6 zone id
            if ip is None or not _is_sensitive_ip(ip):
                continue
            what = "a cloud metadata endpoint" if ip in _METADATA_ADDRESSES else "a link-local address"
            if any(p.literally_names(host) and p.port in (None, port) for p in self.patterns):
                continue
            if any(p.literally_names(str(ip)) and p.port in (None, port) for p in self.patterns):
                continue
            return f"MCP server host {host!r} resolves to {what} ({ip}), which must be listed explicitly"
        return None

    def _sensitive_reason(self, host: str, port: int, what: str | None) -> str | None:
        if what is None:
            return None
        if any(p.literally_names(host) and p.port in (None, port) for p in self.patterns):
            return None
        return f"MCP server host {host!r} is {what}, which must be listed explicitly in the allowed hosts"
