"""Running uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

from typing import Any

from gateway.config import Settings


def serve_until_stopped(server: Any, app: Any, settings: Settings) -> int:
    server.run()
    return 0
