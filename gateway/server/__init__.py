"""The HTTP app: the only starlette user. It reads requests and pumps frames; the logic lives in translate/."""

from gateway.server.app import create_app

__all__ = ["create_app"]
