"""``--workers N``: N processes serving one port, sharing what must be shared.

The parent (``supervise``) serves nothing itself. Before it forks it:

- makes a private directory (0700, removed when it exits) holding the prometheus-client multiprocess files
  (``PROMETHEUS_MULTIPROC_DIR``: ``/metrics`` on any worker sums all of them) and the shared tally of the limits
  (gateway.server.limits: ``--max-concurrency``, ``--max-websocket-connections``, ``--max-background-responses``
  and ``--max-background-per-key`` hold for the gateway, not per worker);
- binds one listening socket per worker on the port with ``SO_REUSEPORT``: the kernel spreads connections over
  them by their address and port, so no worker's accept loop takes them all;
- generates one reasoning key for all its workers when there is neither ``--reasoning-key`` nor a store to keep
  one (``--store none``); otherwise each worker reads the store's key (gateway.server.keys), the same for all.

Each worker builds the app from the settings (``create_app(…, worker=…)``) and serves its socket with the usual
drain (gateway.server.shutdown). Background runs need nothing more: they live in the store, followers of another
worker's run poll it, and a cancel reaches the worker running it through the store (see
gateway.server.background).

Signals: SIGTERM or SIGINT to the parent is forwarded (as SIGTERM) to every worker, which drains and exits 0; the
parent exits 0 once all of them did. A second signal is forwarded too (each worker then stops at once). Workers
are in a process group of their own, so a terminal's Ctrl-C reaches them only through the parent, and they get
SIGTERM if the parent dies. A worker that dies otherwise is replaced (its slots freed first: see limits.py); one
that fails to start (its store unreachable, …) stops the gateway with status 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import structlog

from gateway.config import Settings
from gateway.server.limits import SharedTally

log = structlog.get_logger("gateway.workers")

__all__ = ["WorkerContext", "supervise"]

STARTUP_FAILED = 1  # the parent's exit status when a worker could not start
# A worker's exit status when it never served: serve_until_stopped's 1, the CLI's 2 (bad key file), uvicorn's 3
# (the lifespan failed: store unreachable, …). Respawning would fail the same way.
_NEVER_SERVED = frozenset({1, 2, 3})
RESPAWN_PAUSE = 1.0  # between a worker's death and its replacement: a crash loop must not spin


@dataclass(frozen=True)
class WorkerContext:
    """What a worker shares with the others: handed to ``create_app(…, worker=…)``."""

    index: int
    count: int
    metrics_dir: str
    tally: SharedTally


def _listener(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _die_with_parent() -> None:
    """Linux: SIGTERM to this process when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _metrics_value_class() -> None:
    # prometheus-client picks its value class when first imported; a worker switches to the multiprocess one
    # before any metric exists (the parent imported the module with PROMETHEUS_MULTIPROC_DIR already set, but
    # say it explicitly rather than rely on import order).
    from prometheus_client import values

    values.ValueClass = values.get_value_class()


class _Supervisor:
    def __init__(self, settings: Settings, count: int, serve: Callable[[WorkerContext, socket.socket], int]) -> None:
        self.settings = settings
        self.count = count
        self.serve = serve
        self.children: dict[int, int] = {}  # pid -> worker index
        self.stopping = False
        self.failed = False
        self.port = settings.port

    def run(self) -> int:
        folder = tempfile.mkdtemp(prefix="responses-gateway-workers-")  # 0700
        metrics_dir = os.path.join(folder, "metrics")
        os.mkdir(metrics_dir, 0o700)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        tally = SharedTally.create(folder, self.count, self.settings.max_background_responses)
        original = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                first = _listener(self.settings.host, self.settings.port)
            except OSError as exc:
                print(f"responses-gateway: cannot listen on {self.settings.host}:{self.settings.port}: {exc}",
                      file=sys.stderr)
                return STARTUP_FAILED
            self.port = first.getsockname()[1]  # the port chosen, when --port 0 asked the kernel for one
            log.info("workers_starting", workers=self.count, port=self.port)
            for index in range(self.count):
                if self.stopping:  # signalled while starting: the ones started got it, the rest never start
                    first.close()
                    break
                try:
                    sock = first if index == 0 else _listener(self.settings.host, self.port)
                except OSError as exc:
                    log.error("worker_listen_failed", worker=index, error=str(exc))
                    self.failed = True
                    self._on_signal(signal.SIGTERM, None)
                    break
                self._spawn(index, sock, metrics_dir, tally)
            self._wait(metrics_dir, tally)
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
            tally.close()
            shutil.rmtree(folder, ignore_errors=True)
        if self.failed:
            return STARTUP_FAILED
        log.info("stopped", workers=self.count)
        return 0

    def _spawn(self, index: int, sock: socket.socket, metrics_dir: str, tally: SharedTally) -> None:
        # Signals wait until the worker has dropped the parent's handlers (which would signal its siblings).
        handled = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, handled)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
            raise
        if pid == 0:  # the worker: never returns
            code = 70
            try:
                for sig in handled:
                    signal.signal(sig, signal.SIG_DFL)  # uvicorn installs the worker's own
                signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
                os.setpgid(0, 0)
                _die_with_parent()
                _metrics_value_class()
                tally.attach(index)
                code = self.serve(WorkerContext(index, self.count, metrics_dir, tally), sock)
            except SystemExit as exc:  # uvicorn exits 3 when the lifespan fails
                code = exc.code if isinstance(exc.code, int) else 70
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        sock.close()  # the worker's own now: a copy kept here would keep accepting connections nobody serves
        self.children[pid] = index
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)  # a pending signal runs now, reaching this one too
        log.info("worker_started", worker=index, worker_pid=pid)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _wait(self, metrics_dir: str, tally: SharedTally) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        while self.children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            index = self.children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            tally.clear(index)  # what it held (requests, connections, runs) is free again
            mark_process_dead(pid, metrics_dir)  # its live gauges leave the sums
            if self.stopping:
                if code != 0:
                    log.warning("worker_exited", worker=index, worker_pid=pid, status=code)
                continue
            if code in _NEVER_SERVED:
                log.error("worker_failed_to_start", worker=index, worker_pid=pid)
                self.failed = True
                self._on_signal(signal.SIGTERM, None)
                continue
            log.error("worker_died", worker=index, worker_pid=pid, status=code)
            time.sleep(RESPAWN_PAUSE)
            if self.stopping:
                continue
            try:
                sock = _listener(self.settings.host, self.port)
            except OSError as exc:
                log.error("worker_respawn_failed", worker=index, error=str(exc))
                continue
            self._spawn(index, sock, metrics_dir, tally)


def supervise(settings: Settings, count: int, serve: Callable[[WorkerContext, socket.socket], int]) -> int:
    """Run ``count`` workers (each ``serve(context, listening_socket)``, its exit status) until SIGTERM/SIGINT;
    the parent's exit status."""
    return _Supervisor(settings, count, serve).run()
