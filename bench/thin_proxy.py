"""The floor: the thinnest streaming proxy on the gateway's own stack, for the bench's ``floor`` column.

starlette + uvicorn (with uvloop and httptools, as the gateway runs) + httpx on the httpx-aiohttp
transport; ``POST /v1/responses`` is forwarded to the upstream's ``/v1/responses`` and its body passed back
as raw bytes: no parsing, no translation, no store, no logs. Whatever the gateway costs beyond this column is
the gateway's own work; what this column costs is the stack's. Started by ``bench_gateway.py`` with the
peer's arguments (``--llm-api-base URL --gateway-host H --gateway-port P``).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import httpx
import uvicorn
from httpx_aiohttp import AiohttpTransport
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--llm-api-base", required=True)
    p.add_argument("--gateway-host", default="127.0.0.1")
    p.add_argument("--gateway-port", type=int, required=True)
    p.add_argument("--db-url", help="ignored (the peer's argument)")
    a = p.parse_args()
    client = httpx.AsyncClient(transport=AiohttpTransport(), timeout=60)
    url = a.llm_api_base.rstrip("/") + "/responses"

    async def responses(request: Request) -> StreamingResponse:
        req = client.build_request("POST", url, content=await request.body(),
                                   headers={"content-type": "application/json"})
        up = await client.send(req, stream=True)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.aiter_raw():
                    yield chunk
            finally:
                await up.aclose()

        return StreamingResponse(body(), status_code=up.status_code, media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/responses", responses, methods=["POST"])])
    uvicorn.run(app, host=a.gateway_host, port=a.gateway_port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
