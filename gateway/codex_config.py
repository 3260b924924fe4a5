"""``responses-gateway codex-config``: Codex CLI set up for the gateway in one command.

Codex sends its ``apply_patch`` as a Lark ``custom`` tool only when the model's metadata says
``apply_patch_tool_type: "freeform"``; for a model it does not know it falls back to built-in metadata without it
(and without a context window), and never asks a custom provider for metadata. So this command reads the gateway's
``/v1/models`` (vLLM's list, passed through, with each model's ``max_model_len``), writes a model catalog in Codex's
``model_catalog_json`` format (codex-rs ``ModelInfo``: ``{"models": [...]}``) into the Codex home, and prints — or
with ``--write`` merges into ``config.toml``, keeping the user's text and a backup — the lines that select it.

Compaction: Codex compacts a conversation when its tokens pass the entry's ``auto_compact_token_limit`` (90 % of
``context_window`` at most). It compacts *remotely* only for OpenAI's own provider and
Azure's (``ModelProviderInfo::supports_remote_compaction``: the provider block's ``name`` "OpenAI", or Azure's name
or base URL); otherwise it compacts inline, asking the model for a summary through ``/v1/responses`` — which the
gateway serves. ``--remote-compaction`` writes ``name = "OpenAI"`` into the gateway's block, and Codex 0.171 then
sends a ``compaction_trigger`` to the gateway (tests/test_codex_compaction.py) — opt-in, since Codex may treat a
provider it takes for OpenAI's differently in other ways too. A client-side tool: it imports nothing of the server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import tomlkit

__all__ = ["SHELL_TYPES", "CodexConfigError", "ServedModel", "add_arguments", "catalog", "catalog_entry",
           "config_lines", "config_values", "fetch_models", "merge_config", "run"]

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"
DEFAULT_PROVIDER = "responses-gateway"
DEFAULT_KEY_ENV = "RESPONSES_GATEWAY_API_KEY"
# codex-rs ConfigShellToolType, serialized snake_case
SHELL_TYPES = ("shell_command", "default", "local", "unified_exec", "disabled")
# Codex's default for its own coding models is 10 000 tokens of tool output; a small window gets a quarter of it.
TRUNCATION_TOKENS = 10_000
FALLBACK_CONTEXT_WINDOW = 32_768  # a /v1/models entry without max_model_len (another server behind the gateway)
MAX_MODELS = 1000  # entries read from /v1/models: a bound on what a misbehaving server makes us write
MAX_BODY_BYTES = 8 * 1024 * 1024  # and on what it makes us read
TIMEOUT_S = 10.0

# vLLM's /v1/models says nothing about reasoning; these families think before they answer (they take
# reasoning.effort), so their entries offer Codex's effort levels. Others get none (Codex then sends no effort).
_REASONING_MODEL = re.compile(
    r"gpt-oss|(^|/)o[134](-|$)|deepseek-r1|qwq|magistral|phi-4-(mini-)?reasoning|-thinking|exaone-deep|"
    r"(^|/)qwen3-(?!coder)(?!.*instruct)|glm-4\.[5-9]|glm-[5-9]|minimax-m[12]|seed-oss|hunyuan-a13b|k2-thinking",
    re.IGNORECASE)

BASE_INSTRUCTIONS = """\
You are a coding agent running in the Codex CLI, working in the user's repository on their machine.

- Read the code before you change it; keep changes minimal and in the style of the surrounding code.
- Edit files only with the `apply_patch` tool. Its input is a patch in this format:
  *** Begin Patch
  *** Add File: path/new.txt
  +first line
  *** Update File: path/existing.py
  @@ def context_line
  -old line
  +new line
  *** Delete File: path/obsolete.txt
  *** End Patch
  Paths are relative to the working directory; every added or changed line starts with `+`, removed with `-`,
  unchanged context lines with a space.
- Run commands (tests, builds, searches) with the shell tool and read their output before going on.
- When the task is done, answer briefly: what you changed and how you checked it.
"""


class CodexConfigError(Exception):
    """A failure the user can act on: printed as one line, exit status 1."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    context_window: int | None  # vLLM's max_model_len


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway-url", default=DEFAULT_GATEWAY_URL,
                        help=f"The gateway's address (default {DEFAULT_GATEWAY_URL}); Codex gets it + /v1.")
    parser.add_argument("--model", default=None, help="The model Codex uses (default: the first served model).")
    parser.add_argument("--provider-name", default=DEFAULT_PROVIDER,
                        help=f"The [model_providers.NAME] block to write (default {DEFAULT_PROVIDER}).")
    parser.add_argument("--api-key-env", default=DEFAULT_KEY_ENV,
                        help="The environment variable holding a gateway key: Codex reads it (env_key), and so "
                             f"does this command to list the models (default {DEFAULT_KEY_ENV}).")
    parser.add_argument("--no-websockets", action="store_true",
                        help="Write supports_websockets = false (Codex then POSTs each turn).")
    parser.add_argument("--shell-type", default="shell_command", choices=SHELL_TYPES,
                        help="The models' shell_type in the catalog (default shell_command).")
    parser.add_argument("--remote-compaction", action="store_true",
                        help='Name the provider "OpenAI" in its block, the one name Codex compacts remotely for: '
                             "Codex then sends a compaction_trigger and the gateway's model writes a sealed summary "
                             "(without it Codex summarizes with an ordinary turn of its own).")
    parser.add_argument("--codex-home", default=None,
                        help="Codex's home folder (default $CODEX_HOME, else ~/.codex).")
    parser.add_argument("--write", action="store_true",
                        help="Merge the lines into CODEX_HOME/config.toml (a backup of the old file is kept).")


# --- the gateway's model list ---------------------------------------------------------------------------------------


def _v1(gateway_url: str) -> str:
    base = gateway_url.strip().rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def fetch_models(gateway_url: str, api_key: str | None, *, transport: httpx.BaseTransport | None = None
                 ) -> list[ServedModel]:
    """The gateway's served models, in its order. CodexConfigError when it cannot be read."""
    url = _v1(gateway_url) + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=TIMEOUT_S, transport=transport) as client, \
                client.stream("GET", url, headers=headers) as resp:
            body = b""
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise CodexConfigError(f"GET {url} answered more than {MAX_BODY_BYTES} bytes: not a model list.")
    except httpx.InvalidURL as exc:
        raise CodexConfigError(f"--gateway-url {gateway_url!r} is not a URL ({exc}).") from None
    except httpx.HTTPError as exc:
        raise CodexConfigError(f"Cannot reach the gateway at {url} ({type(exc).__name__}: {exc}). Is it running? "
                               "Start it with `responses-gateway serve`, or pass --gateway-url.") from None
    if resp.status_code in (401, 403):
        hint = ("set it to a key of the gateway's GATEWAY_API_KEYS" if not api_key
                else "it is not a key the gateway accepts")
        raise CodexConfigError(f"The gateway refused to list its models (HTTP {resp.status_code}): the key is read "
                               f"from the environment variable named by --api-key-env; {hint}.")
    if resp.status_code != 200:
        raise CodexConfigError(f"The gateway answered GET {url} with HTTP {resp.status_code}: "
                               f"{body[:300].decode(errors='replace')!r}")
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        raise CodexConfigError(f"GET {url} did not return a model list (no 'data' array).")
    models: list[ServedModel] = []
    for entry in data[:MAX_MODELS]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            continue
        window = entry.get("max_model_len")
        ok = isinstance(window, int) and not isinstance(window, bool) and window > 0
        models.append(ServedModel(entry["id"], window if ok else None))
    if not models:
        raise CodexConfigError(f"The gateway serves no models (GET {url} listed none): is its upstream vLLM up?")
    return models


# --- Codex's model catalog ------------------------------------------------------------------------------------------


def reasons(model_id: str) -> bool:
    """Whether the model is one of the reasoning families (vLLM's model list does not say)."""
    return bool(_REASONING_MODEL.search(model_id))


def catalog_entry(model: ServedModel, *, shell_type: str = "shell_command", websockets: bool = True,
                  priority: int = 1) -> dict[str, Any]:
    """One codex-rs ``ModelInfo``: every field Codex 0.171 reads, those it requires included."""
    window = model.context_window or FALLBACK_CONTEXT_WINDOW
    thinks = reasons(model.id)
    levels = [{"effort": e, "description": f"{e.capitalize()} reasoning effort"} for e in ("low", "medium", "high")]
    return {
        "slug": model.id,
        "display_name": model.id,
        "description": f"{model.id}, served by vLLM through responses-gateway.",
        "base_instructions": BASE_INSTRUCTIONS,
        "model_messages": None,
        "prefer_websockets": websockets,
        # the point of the catalog: Codex sends apply_patch as its Lark custom tool, which the gateway serves
        "apply_patch_tool_type": "freeform",
        "web_search_tool_type": "text",
        "supports_search_tool": False,
        "shell_type": shell_type,
        "input_modalities": ["text"],  # vLLM's list does not say whether a model sees images
        "supports_image_detail_original": False,
        "truncation_policy": {"mode": "tokens", "limit": min(TRUNCATION_TOKENS, max(window // 4, 256))},
        # the gateway's grammar takeover edits one call per turn; one at a time is what open models do reliably
        "supports_parallel_tool_calls": False,
        "tool_mode": None,
        "multi_agent_version": None,
        "multi_agent_reasoning_effort": None,
        "use_responses_lite": False,
        "supports_reasoning_effort_updates": False,
        "include_skills_usage_instructions": False,
        "include_apps_usage_instructions": False,
        "include_plugin_usage_instructions": False,
        "guardian": None,
        "node_repl_auto_review_required": False,
        "node_repl_disabled": False,
        "requires_sandboxed_review": False,
        "auto_review_model_override": None,
        "model_specialty": None,
        "context_window": window,
        "max_context_window": window,
        # Codex compacts (inline, through /v1/responses) past this; it clamps to 90 % of the window itself too
        "auto_compact_token_limit": window * 9 // 10,
        "effective_context_window_percent": 95,
        "comp_hash": "0",
        "default_reasoning_summary": "none",
        "default_reasoning_level": "medium" if thinks else None,
        "supported_reasoning_levels": levels if thinks else [],
        "visibility": "list",
        "minimal_client_version": "0.1.0",
        "supported_in_api": True,
        "availability_nux": None,
        "upgrade": None,
        "priority": priority,
        "experimental_supported_tools": [],
        "available_in_plans": [],
        "supports_experimental_context": False,
        "default_service_tier": None,
        "service_tiers": [],
        "additional_speed_tiers": [],
        "support_verbosity": False,
        "default_verbosity": None,
        # vLLM returns reasoning text, not OpenAI's summaries: Codex sends no reasoning.summary
        "supports_reasoning_summary_parameter": False,
        "supports_reasoning_summaries": False,
    }


def catalog(models: Sequence[ServedModel], *, shell_type: str = "shell_command", websockets: bool = True
            ) -> dict[str, Any]:
    return {"models": [catalog_entry(m, shell_type=shell_type, websockets=websockets, priority=i + 1)
                       for i, m in enumerate(models)]}


# --- config.toml ----------------------------------------------------------------------------------------------------


def config_values(*, model: str, provider: str, catalog_path: str, gateway_url: str, key_env: str,
                  websockets: bool, remote_compaction: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(top-level keys, the provider block) that select the gateway and the catalog. ``remote_compaction``: the
    block's display ``name`` is "OpenAI", which is what codex-rs (``supports_remote_compaction``) checks; the
    block's key, its base_url and its env_key stay the gateway's."""
    top = {"model": model, "model_provider": provider, "model_catalog_json": catalog_path}
    block = {"name": "OpenAI" if remote_compaction else provider, "base_url": _v1(gateway_url), "wire_api": "responses",
             "supports_websockets": websockets, "env_key": key_env}
    return top, block


def config_lines(top: Mapping[str, Any], provider: str, block: Mapping[str, Any]) -> str:
    """The config.toml lines, as printed."""
    doc = tomlkit.document()
    for key, value in top.items():
        doc[key] = value
    providers = tomlkit.table(is_super_table=True)
    table = tomlkit.table()
    for key, value in block.items():
        table[key] = value
    providers[provider] = table
    doc["model_providers"] = providers
    return tomlkit.dumps(doc)


def merge_config(text: str, top: Mapping[str, Any], provider: str, block: Mapping[str, Any]) -> str:
    """``text`` (a config.toml) with these keys set and everything else — other keys, tables, comments — kept.
    CodexConfigError when ``text`` is not TOML (nothing is written then)."""
    try:
        tomllib.loads(text)
        doc = tomlkit.parse(text)
    except (tomllib.TOMLDecodeError, tomlkit.exceptions.TOMLKitError) as exc:
        raise CodexConfigError(f"config.toml is not valid TOML ({exc}); fix or move it, then run again.") from None
    for key, value in top.items():  # tomlkit puts a new top-level key above the first table
        doc[key] = value
    providers = doc.get("model_providers")
    if providers is None:
        providers = tomlkit.table(is_super_table=True)
        doc["model_providers"] = providers
    elif not isinstance(providers, MutableMapping):
        raise CodexConfigError("config.toml's model_providers is not a table; fix it, then run again.")
    table = providers.get(provider)
    if table is None:
        table = tomlkit.table()
        providers[provider] = table
    elif not isinstance(table, MutableMapping):
        raise CodexConfigError(f"config.toml's model_providers.{provider} is not a table; fix it, then run again.")
    for key, value in block.items():
        table[key] = value
    out = tomlkit.dumps(doc)
    tomllib.loads(out)  # what we write parses
    return out


def _write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def codex_home(arg: str | None, environ: Mapping[str, str]) -> Path:
    if arg:
        return Path(arg).expanduser()
    if environ.get("CODEX_HOME"):
        return Path(environ["CODEX_HOME"]).expanduser()
    return Path("~/.codex").expanduser()


def run(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None, out: Any = None, err: Any = None) -> int:
    """The command: 0 on success, 1 with one line on stderr on a failure the user can fix."""
    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        return _run(args, environ, transport, out, err)
    except CodexConfigError as exc:
        print(f"responses-gateway codex-config: {exc}", file=err)
        return 1
    except OSError as exc:
        print(f"responses-gateway codex-config: {exc.strerror or exc} ({exc.filename or ''})", file=err)
        return 1


def _run(args: argparse.Namespace, environ: Mapping[str, str], transport: httpx.BaseTransport | None,
         out: Any, err: Any) -> int:
    key_env = args.api_key_env
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env or ""):
        raise CodexConfigError(f"--api-key-env {key_env!r} is not an environment variable name.")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.provider_name or ""):
        raise CodexConfigError(f"--provider-name {args.provider_name!r}: use letters, digits, '-' and '_'.")
    websockets = not args.no_websockets
    models = fetch_models(args.gateway_url, environ.get(key_env) or None, transport=transport)
    ids = [m.id for m in models]
    model = args.model or ids[0]
    if model not in ids:
        raise CodexConfigError(f"The gateway does not serve {model!r}; it serves: {', '.join(ids[:20])}.")
    home = codex_home(args.codex_home, environ)
    home.mkdir(parents=True, exist_ok=True)
    catalog_path = home / f"{args.provider_name}-models.json"
    _write_atomic(catalog_path, json.dumps(catalog(models, shell_type=args.shell_type, websockets=websockets),
                                           indent=2) + "\n")
    print(f"Wrote the model catalog for {len(models)} model(s) to {catalog_path}", file=err)
    top, block = config_values(model=model, provider=args.provider_name, catalog_path=str(catalog_path),
                               gateway_url=args.gateway_url, key_env=key_env, websockets=websockets,
                               remote_compaction=args.remote_compaction)
    if not args.write:
        print(config_lines(top, args.provider_name, block), end="", file=out)
        print(f"Add these lines to {home / 'config.toml'} (or run again with --write).", file=err)
    else:
        config = home / "config.toml"
        if config.exists():
            old = config.read_text(encoding="utf-8")
            new = merge_config(old, top, args.provider_name, block)
            backup = home / f"config.toml.{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.bak"
            shutil.copy2(config, backup)
            _write_atomic(config, new, config.stat().st_mode & 0o777)
            print(f"Updated {config} (the previous one is in {backup})", file=err)
        else:
            _write_atomic(config, config_lines(top, args.provider_name, block))
            print(f"Wrote {config}", file=err)
    if not environ.get(key_env):
        print(f"Codex reads the gateway key from ${key_env}: export it before running codex (any string when the "
              "gateway has no API keys).", file=err)
    return 0
