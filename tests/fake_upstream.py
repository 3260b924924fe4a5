"""A real HTTP upstream on loopback that serves an httpx transport (recorded cassettes, slow streams).

Gateways run as subprocesses need an upstream they can reach over TCP; this wraps any
``httpx.AsyncBaseTransport`` (usually a CassetteTransport) in a small ASGI app served by uvicorn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tests.support import serve_in_thread


def asgi_for(transport: httpx.AsyncBaseTransport):  # type: ignore[no-untyped-def]
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        request = Request(scope, receive)
        body = await request.body()
        url = httpx.URL(str(request.url))
        req = httpx.Request(request.method, url, headers=request.headers.raw, content=body)
        resp = await transport.handle_async_request(req)

        async def stream():  # type: ignore[no-untyped-def]
            async for chunk in resp.stream:  # type: ignore[union-attr]
                yield chunk

        response = StreamingResponse(stream(), status_code=resp.status_code, headers=dict(resp.headers))
        await response(scope, receive, send)

    return app


@contextlib.contextmanager
def serving(transport: httpx.AsyncBaseTransport) -> Iterator[str]:
    with serve_in_thread(asgi_for(transport)) as (url, _server):
        yield url
