"""Frozen settings, read from command-line flags and ``GATEWAY_*`` environment variables.

Every setting has one row in ``OPTIONS``: its flag, its environment variable and its default. The CLI,
the README table and the tests all read that table, so a flag can never exist without its variable.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

UpstreamApi = Literal["responses", "chat"]
Enforcement = Literal["off", "validate", "constrain"]


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _bool(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


# vLLM's public inference endpoints: what the pass-through proxy forwards by default. Its admin and development
# endpoints (/sleep, /wake_up, /collective_rpc, /reset_prefix_cache, ...) are never reachable through the gateway
# unless an operator lists them.
DEFAULT_PROXY_PATHS: tuple[str, ...] = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/messages",
    "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/audio/transcriptions", "/v1/audio/translations",
    "/v1/score", "/v1/rerank", "/pooling", "/classify", "/version",
)
LOOPBACK_HOST_NAMES: tuple[str, ...] = ("localhost", "127.0.0.1", "[::1]", "::1")


@dataclass(frozen=True)
class Option:
    name: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    secret: bool = False


OPTIONS: tuple[Option, ...] = (
    Option("upstream_url", "--upstream", "GATEWAY_UPSTREAM_URL", str, "Base URL of vLLM (no /v1)."),
    Option("host", "--host", "GATEWAY_HOST", str, "Address to listen on."),
    Option("port", "--port", "GATEWAY_PORT", int, "Port to listen on."),
    Option(
        "upstream_api_key", "--upstream-api-key", "GATEWAY_UPSTREAM_API_KEY", str,
        "Bearer token sent upstream; replaces the client's Authorization.", secret=True,
    ),
    Option(
        "api_keys", "--api-keys", "GATEWAY_API_KEYS", _csv,
        "Comma-separated keys clients must present (Bearer) on /v1/* and every proxied path; "
        "/healthz, /readyz and /metrics stay open. Empty: no gateway auth.", secret=True,
    ),
    Option("api_keys_file", "--api-keys-file", "GATEWAY_API_KEYS_FILE", str,
           "File with one key per line (# comments); adds to GATEWAY_API_KEYS."),
    Option("owner_secret", "--owner-secret", "GATEWAY_OWNER_SECRET", str,
           "Secret keying the owner hash stored with each response and conversation under gateway keys; "
           "unset: derived from the key set (changing the set then hides everything stored).", secret=True),
    Option("upstream_api", "--upstream-api", "GATEWAY_UPSTREAM_API", str,
           "Which upstream API to call.", choices=("responses", "chat")),
    Option("tool_choice_enforcement", "--tool-choice-enforcement", "GATEWAY_TOOL_CHOICE_ENFORCEMENT", str,
           "How tool_choice and custom-tool grammars are enforced.", choices=("off", "validate", "constrain")),
    Option("tool_call_parser", "--tool-call-parser", "GATEWAY_TOOL_CALL_PARSER", str,
           "vLLM's --tool-call-parser (hermes, qwen3_coder, qwen3_xml): grammar custom tools under auto are then "
           "constrained by a structural tag in the request itself; auto: vLLM's strict-tool pattern where the "
           "grammar is regular, else the takeover.", choices=("auto", "hermes", "qwen3_coder", "qwen3_xml")),
    Option("max_body_bytes", "--max-body-bytes", "GATEWAY_MAX_BODY_BYTES", int, "Largest request body (413)."),
    Option("max_concurrency", "--max-concurrency", "GATEWAY_MAX_CONCURRENCY", int,
           "Concurrent requests (streams until they end) before 429; probes and metrics not counted."),
    Option("stream_idle_timeout", "--stream-idle-timeout", "GATEWAY_STREAM_IDLE_TIMEOUT", float,
           "Seconds without an upstream frame before a stream ends with response.failed."),
    Option("connect_timeout", "--upstream-connect-timeout", "GATEWAY_UPSTREAM_CONNECT_TIMEOUT", float,
           "Seconds to connect to the upstream."),
    Option("read_timeout", "--upstream-read-timeout", "GATEWAY_UPSTREAM_READ_TIMEOUT", float,
           "Seconds to wait for a non-streamed upstream answer."),
    Option("max_unnamed_call_bytes", "--max-unnamed-call-bytes", "GATEWAY_MAX_UNNAMED_CALL_BYTES", int,
           "Bytes of frames held per response for tool calls whose name has not arrived."),
    Option("drain_timeout", "--drain-timeout", "GATEWAY_DRAIN_TIMEOUT", float,
           "Seconds in-flight streams get after SIGTERM before they end with response.failed."),
    Option("store", "--store", "GATEWAY_STORE", str,
           "Response store: sqlite:///file.db, postgresql://user@host:port/db or none."),
    Option("store_ttl", "--store-ttl", "GATEWAY_STORE_TTL", float, "Seconds to keep stored responses; 0 keeps them."),
    Option("max_background_responses", "--max-background-responses", "GATEWAY_MAX_BACKGROUND_RESPONSES", int,
           "Background responses (background: true) running at once on this replica (all its workers) before 429."),
    Option("log_level", "--log-level", "GATEWAY_LOG_LEVEL", str, "Log level.",
           choices=("debug", "info", "warning", "error")),
    Option("mcp_allowed_hosts", "--mcp-allowed-hosts", "GATEWAY_MCP_ALLOWED_HOSTS", _csv,
           "Comma-separated host or host:port patterns ('*' = any public host) that mcp tools' server_url may "
           "name; loopback, private, link-local, CGNAT, metadata addresses only if listed; empty: none."),
    Option("mcp_servers_file", "--mcp-servers-file", "GATEWAY_MCP_SERVERS_FILE", str,
           "JSON file of labelled MCP servers clients reference by server_label alone (credentials stay here)."),
    Option("max_tool_rounds", "--max-tool-rounds", "GATEWAY_MAX_TOOL_ROUNDS", int,
           "Rounds per response that run gateway-owned tool calls; then one more round without tools."),
    Option("mcp_call_timeout", "--mcp-call-timeout", "GATEWAY_MCP_CALL_TIMEOUT", float,
           "Seconds one MCP tool call may take before it fails."),
    Option("websocket_idle_timeout", "--websocket-idle-timeout", "GATEWAY_WEBSOCKET_IDLE_TIMEOUT", float,
           "Seconds a WebSocket connection may sit without a message before it is closed (pinged meanwhile)."),
    Option("reasoning_key", "--reasoning-key", "GATEWAY_REASONING_KEY", str,
           "Base64 AES-256 keys (comma-separated; the first seals) for reasoning encrypted_content and MCP "
           "approval ids; unset: a key kept with the store (a 0600 file beside the SQLite database, a row in "
           "PostgreSQL), or one per start with --store none.", secret=True),
    Option("max_websocket_connections", "--max-websocket-connections", "GATEWAY_MAX_WEBSOCKET_CONNECTIONS", int,
           "Open WebSocket connections on /v1/responses before the handshake is answered 503."),
    Option("body_read_timeout", "--body-read-timeout", "GATEWAY_BODY_READ_TIMEOUT", float,
           "Seconds a request body may take to arrive before 408; the concurrency slot is taken after it."),
    Option("max_history_bytes", "--max-history-bytes", "GATEWAY_MAX_HISTORY_BYTES", int,
           "Bytes of history (chain, conversation, item references) one request may resolve before 400."),
    Option("compaction_max_output_tokens", "--compaction-max-output-tokens", "GATEWAY_COMPACTION_MAX_OUTPUT_TOKENS",
           int, "Tokens a compaction summary may take (the summarization turn's max_output_tokens); unset: what "
           "the model's window leaves."),
    Option("max_mcp_servers_per_request", "--max-mcp-servers-per-request", "GATEWAY_MAX_MCP_SERVERS_PER_REQUEST", int,
           "Distinct MCP servers one request may name before 400."),
    Option("max_background_per_key", "--max-background-per-key", "GATEWAY_MAX_BACKGROUND_PER_KEY", int,
           "Background responses one API key may run at once before 429; unset: a quarter of "
           "--max-background-responses; not applied without API keys."),
    Option("allowed_hosts", "--allowed-hosts", "GATEWAY_ALLOWED_HOSTS", _csv,
           "Comma-separated Host header values answered ('*' = any); unset: loopback names only when bound to a "
           "loopback address without API keys, else '*'. /healthz, /readyz and /metrics are exempt."),
    Option("allowed_origins", "--allowed-origins", "GATEWAY_ALLOWED_ORIGINS", _csv,
           "Comma-separated Origin values allowed on requests and WebSocket handshakes ('*' = any); a request "
           "carrying another Origin gets 403. Empty: none."),
    Option("proxy_paths", "--proxy-paths", "GATEWAY_PROXY_PATHS", _csv,
           "Comma-separated upstream paths the pass-through proxy forwards; anything else is 404."),
    Option("sqlite_synchronous", "--sqlite-synchronous", "GATEWAY_SQLITE_SYNCHRONOUS", str,
           "SQLite's synchronous pragma: full (a commit survives power loss) or normal (faster; the last commits "
           "can be lost on power loss).", choices=("full", "normal")),
    Option("workers", "--workers", "GATEWAY_WORKERS", int,
           "Processes serving the port (SO_REUSEPORT); metrics, limits, background runs and the reasoning key are "
           "shared by all of them."),
    Option("web_search_provider", "--web-search-provider", "GATEWAY_WEB_SEARCH_PROVIDER", str,
           "Search engine the gateway runs web_search tools on; unset: web search is off and web_search tools are "
           "passed upstream unchanged.", choices=("searxng", "brave", "tavily", "demo")),
    Option("web_search_url", "--web-search-url", "GATEWAY_WEB_SEARCH_URL", str,
           "SearXNG's base URL (required for searxng); for brave and tavily an override of their API base. Its "
           "host is allowed even when it is loopback or private (the operator named it)."),
    Option("brave_api_key", "--brave-api-key", "GATEWAY_BRAVE_API_KEY", str,
           "Brave Search API subscription token (X-Subscription-Token).", secret=True),
    Option("tavily_api_key", "--tavily-api-key", "GATEWAY_TAVILY_API_KEY", str,
           "Tavily API key (sent as Authorization: Bearer).", secret=True),
    Option("web_search_timeout", "--web-search-timeout", "GATEWAY_WEB_SEARCH_TIMEOUT", float,
           "Seconds one search may take (connect, answer and body) before its web_search_call fails."),
    Option("web_search_max_results", "--web-search-max-results", "GATEWAY_WEB_SEARCH_MAX_RESULTS", int,
           "Results one search returns at most (Brave and Tavily cap at 20)."),
    Option("web_search_max_result_bytes", "--web-search-max-result-bytes", "GATEWAY_WEB_SEARCH_MAX_RESULT_BYTES", int,
           "UTF-8 bytes of one result's snippet at search_context_size high (medium: half, low: a quarter); a "
           "search's total is at most this times --web-search-max-results."),
    Option("web_search_max_calls_per_response", "--web-search-max-calls-per-response",
           "GATEWAY_WEB_SEARCH_MAX_CALLS_PER_RESPONSE", int,
           "Searches one response may run; later web_search_calls fail without reaching the provider."),
    Option("web_search_per_key_per_minute", "--web-search-per-key-per-minute", "GATEWAY_WEB_SEARCH_PER_KEY_PER_MINUTE",
           int, "Searches one API key (the whole gateway without keys) may run per minute before 429; 0: no bound."),
)


@dataclass(frozen=True)
class Settings:
    upstream_url: str = "http://127.0.0.1:8000"
    host: str = "127.0.0.1"
    port: int = 8080
    upstream_api_key: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: str | None = None
    owner_secret: str | None = field(default=None, repr=False)
    upstream_api: UpstreamApi = "responses"
    tool_choice_enforcement: Enforcement = "constrain"
    tool_call_parser: str = "auto"
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrency: int = 256
    stream_idle_timeout: float = 300.0
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    max_unnamed_call_bytes: int = 256 * 1024
    drain_timeout: float = 20.0
    store: str = "sqlite:///responses-gateway.db"
    store_ttl: float = 0.0
    max_background_responses: int = 64
    log_level: str = "info"
    mcp_allowed_hosts: tuple[str, ...] = ()
    mcp_servers_file: str | None = None
    max_tool_rounds: int = 10
    mcp_call_timeout: float = 60.0
    reasoning_key: str | None = field(default=None, repr=False)
    websocket_idle_timeout: float = 300.0
    max_websocket_connections: int = 256
    body_read_timeout: float = 30.0
    max_history_bytes: int = 32 * 1024 * 1024
    compaction_max_output_tokens: int | None = None
    max_mcp_servers_per_request: int = 8
    max_background_per_key: int | None = None
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    proxy_paths: tuple[str, ...] = DEFAULT_PROXY_PATHS
    sqlite_synchronous: Literal["full", "normal"] = "full"
    workers: int = 1
    web_search_provider: Literal["searxng", "brave", "tavily", "demo"] | None = None
    web_search_url: str | None = None
    brave_api_key: str | None = field(default=None, repr=False)
    tavily_api_key: str | None = field(default=None, repr=False)
    web_search_timeout: float = 10.0
    web_search_max_results: int = 10
    web_search_max_result_bytes: int = 4096
    web_search_max_calls_per_response: int = 8
    web_search_per_key_per_minute: int = 30

    def all_api_keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_keys_file:
            with open(self.api_keys_file, encoding="utf-8") as fh:
                keys.extend(line.strip() for line in fh if line.strip() and not line.startswith("#"))
        return tuple(keys)

    def background_per_key(self) -> int:
        """The per-key bound on background responses (applied only under API keys)."""
        if self.max_background_per_key is not None:
            return self.max_background_per_key
        return max(1, self.max_background_responses // 4)

    def is_loopback_bind(self) -> bool:
        host = self.host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def effective_allowed_hosts(self) -> tuple[str, ...]:
        """``--allowed-hosts``, or its default: loopback names only for a keyless gateway bound to loopback (a
        developer's machine, where DNS rebinding is the threat), ``*`` otherwise."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        if self.is_loopback_bind() and not self.all_api_keys():
            return LOOPBACK_HOST_NAMES
        return ("*",)

    def with_overrides(self, **kwargs: Any) -> Settings:
        return replace(self, **kwargs)


_DEFAULTS = {f.name: f.default for f in fields(Settings)}


def add_arguments(parser: argparse.ArgumentParser, *, only: tuple[str, ...] | None = None) -> None:
    for opt in OPTIONS:
        if only is not None and opt.name not in only:
            continue
        default = _DEFAULTS[opt.name]
        shown = "(set)" if opt.secret else default
        parser.add_argument(
            opt.flag, dest=opt.name, default=None, choices=opt.choices,
            help=f"{opt.help} [env {opt.env}; default {shown}]",
        )


def load_settings(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
                  **overrides: Any) -> Settings:
    """Flags win over environment variables, which win over defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw = getattr(args, opt.name, None) if args is not None else None
        if raw is None:
            raw = env.get(opt.env)
        if raw is None or raw == "":
            continue
        try:
            value = opt.parse(raw)
        except ValueError as exc:
            raise SystemExit(f"invalid value for {opt.flag} / {opt.env}: {raw!r}") from exc
        if opt.choices and value not in opt.choices:
            raise SystemExit(f"{opt.flag} / {opt.env} must be one of {', '.join(opt.choices)}, not {raw!r}")
        values[opt.name] = value
    values.update(overrides)
    if values.get("workers", 1) < 1:
        raise SystemExit("--workers / GATEWAY_WORKERS must be at least 1")
    for name, least in (("web_search_max_results", 1), ("web_search_max_result_bytes", 64),
                        ("web_search_max_calls_per_response", 1), ("web_search_per_key_per_minute", 0)):
        if values.get(name, least) < least:
            opt = next(o for o in OPTIONS if o.name == name)
            raise SystemExit(f"{opt.flag} / {opt.env} must be at least {least}")
    if values.get("web_search_timeout", 1.0) <= 0:
        raise SystemExit("--web-search-timeout / GATEWAY_WEB_SEARCH_TIMEOUT must be positive")
    return Settings(**values)


__all__ = [
    "DEFAULT_PROXY_PATHS", "LOOPBACK_HOST_NAMES", "OPTIONS", "Settings", "_bool", "add_arguments", "load_settings",
]
