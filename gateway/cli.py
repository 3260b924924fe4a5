"""``responses-gateway serve|demo|codex-config``. Every serve/demo flag is also a ``GATEWAY_*`` environment variable;
``codex-config`` (gateway/codex_config.py) is a client-side set-up command with its own flags."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from typing import Any

import structlog

from gateway.config import Settings, add_arguments, load_settings

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="responses-gateway",
                                     description="OpenAI Responses API gateway in front of vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Serve the gateway in front of an upstream vLLM.")
    add_arguments(serve)
    demo = sub.add_parser("demo", help="Serve the gateway in front of recorded vLLM answers (no GPU needed).")
    add_arguments(demo, only=("host", "port", "log_level", "api_keys", "api_keys_file", "max_body_bytes",
                              "max_concurrency", "drain_timeout"))
    codex = sub.add_parser("codex-config", help="Set Codex CLI up for this gateway: a model catalog for its served "
                           "models and the config.toml lines (--write merges them).")
    from gateway.codex_config import add_arguments as codex_arguments

    codex_arguments(codex)
    return parser


def startup_warnings(settings: Settings) -> list[tuple[str, str]]:
    """``(event, message)`` for each risky combination of settings, logged once at start-up."""
    warnings = []
    keyless = not settings.all_api_keys()
    if keyless and not settings.is_loopback_bind():
        warnings.append(("keyless_gateway_on_network",
                         f"No API keys and bound to {settings.host}: anyone who reaches this address can use the "
                         "gateway (its upstream, stored responses, MCP servers). Set GATEWAY_API_KEYS or bind to "
                         "127.0.0.1."))
    if keyless and "*" in settings.effective_allowed_hosts() and settings.is_loopback_bind():
        warnings.append(("any_host_on_loopback",
                         "--allowed-hosts '*' on a keyless loopback gateway: web pages can read it through DNS "
                         "rebinding."))
    if "*" in settings.allowed_origins:
        warnings.append(("any_origin",
                         "--allowed-origins '*': any web page the browsers that reach this gateway open may send "
                         "it requests."))
    return warnings


def run(settings: Settings, *, demo: bool = False) -> int:
    from gateway.server.observe import configure_logging

    configure_logging(settings.log_level)
    log = structlog.get_logger("gateway.cli")
    for event, message in startup_warnings(settings):
        log.warning(event, message=message)
    from gateway.websearch.limits import startup_fields

    log.info("web_search", **startup_fields(settings))  # on or off, the provider and its host; never a key
    if settings.workers > 1 and not demo:
        return _run_workers(settings)
    transport = None
    if demo:
        from gateway.demo import demo_transport

        transport = demo_transport()
    return _serve(settings, transport=transport)


def _serve(settings: Settings, *, transport: object = None, worker: object = None,
           sockets: list[socket.socket] | None = None) -> int:
    """Build the app and serve it until SIGTERM/SIGINT and a drained shutdown: this process's exit status."""
    import uvicorn

    from gateway.server import create_app
    from gateway.server.shutdown import serve_until_stopped

    try:
        app = create_app(settings, transport=transport, worker=worker)  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:  # a key file missing or empty: a clear line, not a traceback
        print(f"responses-gateway: {exc}", file=sys.stderr)
        return 2
    # log_config=None: uvicorn's loggers go through the JSON handler configure_logging installed; the
    # gateway writes its own access line per request. The drain timeout is set by serve_until_stopped.
    # ws="websockets-sansio": WebSocket mode on /v1/responses; its frames may be as large as a request body.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            lifespan="on", ws="websockets-sansio", ws_max_size=settings.max_body_bytes + 65536)
    return serve_until_stopped(config, app.state.drain, settings, sockets=sockets)


def _run_workers(settings: Settings) -> int:
    from gateway.server.keys import new_key
    from gateway.server.workers import WorkerContext, supervise

    if not settings.reasoning_key and settings.store.strip().lower() == "none":
        # Nothing keeps a key across starts: one for this start, the same in every worker (gateway.server.keys).
        structlog.get_logger("gateway.cli").warning(
            "reasoning_key_per_start", message="No --reasoning-key and --store none: reasoning encrypted_content "
            "and MCP approval ids do not survive a restart nor open on another replica. Set GATEWAY_REASONING_KEY.")
        settings = settings.with_overrides(reasoning_key=new_key())

    import gateway.server.app  # noqa: F401  # imported once here, shared by the forked workers (copy-on-write)

    def serve(context: WorkerContext, sock: socket.socket) -> int:
        return _serve(settings, worker=context, sockets=[sock])

    return supervise(settings, settings.workers, serve)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "codex-config":
        from gateway.codex_config import run as codex_config

        return codex_config(args)
    if args.command == "demo":
        folder = tempfile.mkdtemp(prefix="responses-gateway-demo-")
        overrides: dict[str, Any] = {}
        if not os.environ.get("GATEWAY_TOOL_CHOICE_ENFORCEMENT"):
            # The recordings are vLLM /v1/responses answers; constrained generation would ask /v1/chat/completions
            # for answers that were never recorded.
            overrides["tool_choice_enforcement"] = "off"
        if not os.environ.get("GATEWAY_WEB_SEARCH_PROVIDER"):
            overrides["web_search_provider"] = "demo"  # a fixed local corpus: web_search round trips, no network
        from gateway.demo_mcp import start_demo_mcp

        servers_file = os.path.join(folder, "mcp-servers.json")
        with open(servers_file, "w", encoding="utf-8") as fh:
            json.dump({"servers": {"demo": {"url": start_demo_mcp(), "require_approval": "never"}}}, fh)
        settings = load_settings(args, upstream_url="http://demo-upstream.invalid",
                                 store=f"sqlite:///{os.path.join(folder, 'responses.db')}",
                                 mcp_servers_file=servers_file, **overrides)
        print(f"responses-gateway demo: http://{settings.host}:{settings.port}/v1 (replaying recorded vLLM "
              f"answers; store in {folder}; MCP tools: {{\"type\": \"mcp\", \"server_label\": \"demo\"}})",
              file=sys.stderr)
        return run(settings, demo=True)
    return run(load_settings(args))
