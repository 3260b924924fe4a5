"""``responses-gateway demo``: the gateway in front of an in-process upstream that replays the recorded
vLLM cassettes, so the whole path (rewrite, translation, restoration, store) runs with no GPU.

The replayed upstream picks the recorded scenario closest to each request (streamed or not, with or
without tools, custom or function, a continuation or a first turn) and renames the recorded tool call to
the tool the request declares, so ``responses.create`` with any custom tool gets a real custom tool call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.translate.rewrite import INPUT_PARAM_SCHEMA
from gateway.upstream.replay import Cassette, CassetteTransport, Interaction, default_cassette_dir, load_cassette

__all__ = ["demo_transport"]


def _is_custom_shim(tool: dict[str, Any]) -> bool:
    return tool.get("parameters") == INPUT_PARAM_SCHEMA


def _choose(body: dict[str, Any]) -> tuple[str, str | None]:
    """The scenario name and the tool name the request wants called."""
    tools = [t for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    choice = body.get("tool_choice")
    suffix = "_stream" if body.get("stream") else "_nonstream"
    items = body.get("input") if isinstance(body.get("input"), list) else []
    last = items[-1] if items else {}
    if isinstance(last, dict) and last.get("type") == "function_call_output":
        return "text_completed" + suffix, None
    if not tools or choice == "none":
        return "text_completed" + suffix, None
    target = None
    if isinstance(choice, dict) and choice.get("name"):
        target = next((t for t in tools if t.get("name") == choice["name"]), None)
    target = target or next((t for t in tools if _is_custom_shim(t)), tools[0])
    scenario = "custom_tool_call_strict" if _is_custom_shim(target) else "function_call"
    return scenario + suffix, str(target.get("name"))


def _recorded_call_name(interaction: Interaction) -> str | None:
    body = interaction.request_body or {}
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return choice.get("name") or (choice.get("function") or {}).get("name")
    tools = body.get("tools") or []
    return tools[0].get("name") if tools else None


def demo_transport(cassette_dir: Path | None = None) -> CassetteTransport:
    folder = (cassette_dir or default_cassette_dir()) / "vllm"
    cassettes = {p.stem: load_cassette(p) for p in sorted(folder.glob("*.yaml"))}

    def matcher(request: httpx.Request, body: dict[str, Any] | None, _: list[Cassette]
                ) -> tuple[Interaction, str | None] | None:
        path = request.url.path
        if path == "/v1/responses" and body is not None:
            name, wanted = _choose(body)
            cassette = cassettes.get(name) or cassettes.get(name.replace("_strict", ""))
            if cassette is None:
                return None
            interaction = cassette.interactions[0]
            recorded = _recorded_call_name(interaction)
            rename = f"{recorded}\x00{wanted}" if wanted and recorded and wanted != recorded else None
            return interaction, rename
        if path in ("/health", "/ping"):
            return Interaction("GET", path, None, 200, {}, b""), None
        if path == "/version":
            return Interaction("GET", path, None, 200, {"content-type": "application/json"},
                               b'{"version":"0.32.0 (demo replay)"}'), None
        if path == "/v1/models":
            models = {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm",
                                                  "max_model_len": 2048}]}
            return Interaction("GET", path, None, 200, {"content-type": "application/json"},
                               orjson.dumps(models)), None
        return None

    return CassetteTransport(list(cassettes.values()), matcher=matcher)
