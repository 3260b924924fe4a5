"""The only httpx user: requests to the upstream, its streams and its errors."""

from gateway.upstream.client import UpstreamClient, UpstreamResponse

__all__ = ["UpstreamClient", "UpstreamResponse"]
