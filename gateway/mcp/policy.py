"""Which remote MCP server URLs the gateway may connect to, and which addresses it may connect to for them.

The gateway opens connections on behalf of its callers, so a ``server_url`` in a request is an SSRF vector.
``HostPolicy`` is the allowlist (``--mcp-allowed-hosts``):

- patterns, comma-separated: ``host`` (any port), ``host:port``, ``[v6addr]``/``[v6addr]:port``, ``*.example.com``
  (any subdomain, not the apex) and ``*`` (anything);
- the scheme must be ``http`` or ``https``;
- *sensitive* destinations are refused unless a pattern names them *literally* (a wildcard, ``*`` included, never
  lets them through): loopback, unspecified, link-local, private, unique-local, CGNAT (100.64.0.0/10), the IETF
  protocol range 192.0.0.0/24, reserved and multicast addresses; every cloud metadata endpoint (169.254.169.254,
  fd00:ec2::254, 100.100.100.200, 192.0.0.192, ``metadata.google.internal``, ``metadata.goog``, ``metadata``,
  ``instance-data``, …); the same addresses embedded in IPv6 (IPv4-mapped, NAT64 ``64:ff9b::/96`` and
  ``64:ff9b:1::/48``, 6to4, Teredo); ``localhost`` names; and the gateway's own listen address;
- the hosts of ``--mcp-servers-file`` are reachable only through their labels (``reserved``): a request's own
  ``server_url`` naming one is refused unless ``--mcp-allowed-hosts`` names it literally.

``check(url)`` judges the URL text (IPv4 in the legacy forms the resolver accepts, ``2852039166``, is decoded);
``check_addresses(url, addresses)`` judges what a name resolved to. The session layer (``gateway.mcp.session``)
resolves on every new connection, checks, and connects to exactly the address that passed, so there is no
rebinding window between the check and the connection. Pure: no I/O here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["HostPattern", "HostPolicy", "is_ip_literal", "sensitive_ip", "url_host_port"]

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Metadata endpoints of the clouds (AWS, GCP, Azure, OpenStack, Oracle, Alibaba, ECS task metadata, ...).
_METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "169.254.169.123", "fd00:ec2::254", "fd00:ec2::23", "100.100.100.200",
    "192.0.0.192"))
_METADATA_NAMES = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "instance-data", "instance-data.ec2.internal",
    "metadata.azure.internal", "metadata.tencentyun.com", "metadata.platformequinix.com", "kubernetes.default.svc"})
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_IETF = ipaddress.ip_network("192.0.0.0/24")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
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


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches through a translator or tunnel (mapped, NAT64, 6to4, Teredo)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


Own = tuple[frozenset[IpAddress], int]  # the gateway's own addresses and its port


def sensitive_ip(ip: IpAddress, own: Own | None = None, port: int | None = None) -> str | None:
    """Why connecting to ``ip`` needs an explicit listing (None: a public address). ``own``: the gateway's own
    addresses and listen port."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:
            why = sensitive_ip(inner, own, port)
            return f"{why} (embedded in {ip})" if why else None
    if ip in _METADATA_ADDRESSES:
        return "a cloud metadata endpoint"
    if own is not None and port == own[1] and ip in own[0]:
        return "the gateway's own listen address"
    if ip.is_loopback or ip.is_unspecified:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if isinstance(ip, ipaddress.IPv4Address) and (ip in _CGNAT or ip in _IETF):
        return "a shared or protocol address (CGNAT, 192.0.0.0/24)"
    if ip.is_private:
        return "a private address"
    if ip.is_multicast or ip.is_reserved or not ip.is_global:
        return "a non-public address"
    return None


def _sensitive_host(host: str, port: int, own: Own | None) -> str | None:
    """Why ``host`` (normalized) needs an explicit listing, or None."""
    if host in _METADATA_NAMES:
        return "a cloud metadata endpoint"
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        return "a loopback address"
    ip = _parse_ip(host)
    return sensitive_ip(ip, own, port) if ip is not None else None


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
    # Hosts of the servers file: reachable through their labels, not by a request's own server_url.
    reserved: tuple[HostPattern, ...] = ()
    # The gateway's own listen address and port.
    own: Own | None = None

    @classmethod
    def from_settings(cls, allowed: str, servers_file_hosts: Iterable[str] = (), *,
                      listen: tuple[str, int] | None = None, local_addresses: Iterable[str] = ()) -> HostPolicy:
        """``allowed``: comma-separated patterns (``""`` allows nothing). ``servers_file_hosts``: the
        ``host:port`` of each URL in the servers file, reserved to their labels. ``listen``: the gateway's own
        host and port; ``local_addresses``: the machine's own addresses, which a wildcard listen address stands
        for (the caller looks them up). ValueError on a malformed pattern (a start-up error)."""
        texts = [t for t in allowed.split(",") if t.strip()]
        patterns = [HostPattern.parse(t) for t in texts]
        reserved = [HostPattern.parse(h) for h in servers_file_hosts]
        own = None
        if listen is not None:
            host = _normalize_host(listen[0])
            ip = _parse_ip(host) if host not in _LOCAL_NAMES else ipaddress.ip_address("127.0.0.1")
            ips = {ip} if ip is not None else set()
            if ip is None or ip.is_unspecified:
                ips |= {a for a in (_parse_ip(_normalize_host(t.split("%", 1)[0])) for t in local_addresses) if a}
            own = (frozenset(ips), listen[1])
        return cls(tuple(dict.fromkeys(patterns)), tuple(dict.fromkeys(reserved)), own)

    def _named(self, host: str, port: int) -> bool:
        return any(p.literally_names(host) and p.port in (None, port) for p in self.patterns)

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
        if self._named(host, port):
            return None
        if any(p.literally_names(host) and p.port in (None, port) for p in self.reserved):
            return f"MCP server host {host!r} is a configured server, reachable only through its server_label"
        what = _sensitive_host(host, port, self.own)
        if what is not None:
            return f"MCP server host {host!r} is {what}, which must be listed explicitly in the allowed hosts"
        return None

    def check_addresses(self, url: str, addresses: Iterable[str]) -> str | None:
        """None unless a resolved address of ``url``'s host is sensitive (see the module docstring) and neither
        the host nor that address is listed explicitly. Call it after ``check(url)`` passed."""
        _, host, port = url_host_port(url)
        if self._named(host, port):
            return None
        for address in addresses:
            ip = _parse_ip(_normalize_host(address.split("%", 1)[0]))  # drop an IPv6 zone id
            if ip is None:
                return f"MCP server host {host!r} resolved to something that is not an address"
            what = sensitive_ip(ip, self.own, port)
            if what is None or self._named(str(ip), port):
                continue
            return f"MCP server host {host!r} resolves to {what} ({ip}), which must be listed explicitly"
        return None
