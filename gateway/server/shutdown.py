"""Graceful shutdown: SIGTERM -> not ready, stop accepting, drain, then end what is left, exit 0.

Sequence on the first SIGTERM/SIGINT:

1. ``Drain.begin()`` (from the signal handler: only flags are set there): ``/readyz`` answers 503
   ``draining`` and new gateway requests on still-open connections get 503.
2. uvicorn closes its listening sockets (no new connections) and asks keep-alive connections to close.
3. In-flight streams get ``drain_timeout`` seconds to finish on their own.
4. Then ``Drain.abort()`` cancels the upstream read of every stream still running; the pump catches
   ``ShuttingDown`` and sends ``response.failed`` (code ``gateway_shutting_down``), so clients get a
   well-formed end instead of a reset connection.
5. Requests still running ``ABORT_GRACE`` seconds later (non-streamed ones waiting on the upstream) are
   cancelled by uvicorn, the lifespan closes the upstream client and the store, and the process exits 0.

Background responses (gateway.engine.background) belong to no connection: the lifespan's shutdown gives them
what is left of the same period (``drain_timeout`` + ``ABORT_GRACE`` from ``Drain.began_at``; their upstream
reads are aborted with the streams' in step 4, so they end ``response.failed``), then stops the ones still
going and marks them failed (``gateway_stopped``) in the store before it closes.

A second signal forces an immediate exit (operators pressing Ctrl-C twice).

Under ``--workers N`` the parent forwards the signal to every worker (gateway.server.workers); each drains as
above, and the parent exits 0 once all of them did.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Generator
from types import FrameType
from typing import Any

import structlog
import uvicorn

from gateway.config import Settings
from gateway.engine.drain import ABORT_GRACE, Drain, ShuttingDown

log = structlog.get_logger("gateway.shutdown")

__all__ = ["ABORT_GRACE", "Drain", "DrainingServer", "ShuttingDown", "serve_until_stopped"]

class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the captured signal after its shutdown, which would end the process with
        # status 143 instead of 0; install the handlers without that step.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.drain.begin()
        self.should_exit = True

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        self.drain.begin()
        log.info("draining", drain_timeout_s=self.drain_timeout, streams=self.drain.active_reads)
        timer = asyncio.create_task(self._abort_after(self.drain_timeout))
        # uvicorn would fail open WebSockets at once (1012); instead their response in flight gets the drain
        # period and they close themselves with 1001 (gateway.server.websocket). Their tasks are still awaited.
        for connection in list(self.server_state.connections):
            if getattr(connection, "handshake_complete", False) is True:  # uvicorn's websockets-sansio protocol
                self.server_state.connections.discard(connection)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer

    async def _abort_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.drain.active_reads:
            log.warning("drain_timeout_reached", streams=self.drain.active_reads)
        self.drain.abort()


def serve_until_stopped(config: uvicorn.Config, drain: Drain, settings: Settings,
                        sockets: list[socket.socket] | None = None) -> int:
    """Run until SIGTERM/SIGINT and a drained shutdown; the exit status for the process. ``sockets``: listening
    sockets made by the caller (a worker of ``--workers N``: gateway.server.workers), else uvicorn binds."""
    config.timeout_graceful_shutdown = max(0.0, settings.drain_timeout) + ABORT_GRACE  # type: ignore[assignment]
    server = DrainingServer(config, drain, max(0.0, settings.drain_timeout))
    server.run(sockets=sockets)
    if server.started:
        log.info("stopped")
        return 0
    return 1  # startup failed (port taken, lifespan error); uvicorn logged why
