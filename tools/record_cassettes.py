#!/usr/bin/env python3
"""Record vcrpy cassettes of a real vLLM upstream, one per named scenario.

Every request is in the UPSTREAM form the gateway sends: ``store: false`` and OpenAI
``custom`` tools already rewritten into function tools taking one string ``input``.
Each scenario is recorded non-streaming (``<name>_nonstream``) and streaming
(``<name>_stream``) into ``<out>/<scenario>.yaml``; after vcrpy has written the file a
YAML comment block (scenario, date, vLLM version, request, what came back) is
prepended.

    .venv/bin/python tools/record_cassettes.py --upstream http://127.0.0.1:8011 \
        --out cassettes/vllm [--only two_calls_stream chat_text ...] [--list]

Upstream used for the committed cassettes: vLLM 0.32.0 CPU build, random-weight model
``tiny``, ``--enable-auto-tool-choice --tool-call-parser hermes``
(/work/shared/tools/tiny-vllm/serve.sh). Outputs are gibberish, but tool-call streams,
framing and structured-output constraints are real. Some scenarios search over
``seed`` (a vLLM extra field; deterministic per seed) for an output with the wanted
property (e.g. two parallel calls) before recording with the chosen seed.
"""

from __future__ import annotations

import argparse
import base64
import copy
import datetime as _dt
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import vcr
import yaml

MODEL = "tiny"

GET_WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name."}},
    "required": ["city"],
    "additionalProperties": False,
}
GET_TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "description": "IANA timezone."}},
    "required": ["timezone"],
    "additionalProperties": False,
}

# The grammar used by the tests (an apply_patch-like Lark grammar).
APPLY_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
filename: /[a-zA-Z0-9_.\/-]+/
add_line: "+" /[^\n]*/ LF
%import common.LF
"""

# The `lark` package rejects APPLY_PATCH_GRAMMAR as written (every parser/lexer: zero-width
# terminal /[^\n]*/); this equivalent form is what the output is checked against.
LARK_CHECK_GRAMMAR = APPLY_PATCH_GRAMMAR.replace(r'add_line: "+" /[^\n]*/ LF', r'add_line: "+" /[^\n]+/? LF')
assert LARK_CHECK_GRAMMAR != APPLY_PATCH_GRAMMAR

# The client-side custom tool, as a Responses client (e.g. Codex) sends it.
CLIENT_CUSTOM_APPLY_PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}

FORMAT_NOTE = (
    "The `input` argument is the raw free-form tool input; it must be valid according to "
    "this Lark grammar:\n" + APPLY_PATCH_GRAMMAR
)


def rewrite_custom_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """The gateway's rewrite: custom tool -> function tool with one string `input`."""
    desc = tool.get("description") or ""
    if tool.get("format", {}).get("type") == "grammar":
        desc = f"{desc}\n\n{FORMAT_NOTE}" if desc else FORMAT_NOTE
    return {
        "type": "function",
        "name": tool["name"],
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The raw free-form input for this tool."}},
            "required": ["input"],
            "additionalProperties": False,
        },
    }


FN_GET_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city.",
    "parameters": GET_WEATHER_PARAMS,
}
FN_GET_TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Get the current time in a timezone.",
    "parameters": GET_TIME_PARAMS,
}
FN_APPLY_PATCH = rewrite_custom_tool(CLIENT_CUSTOM_APPLY_PATCH)


def chat_tool(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {k: fn[k] for k in ("name", "description", "parameters")},
    }


# 1x1 transparent PNG
PNG_DATA_URL = "data:image/png;base64," + (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)
TXT_DATA_URL = "data:text/plain;base64," + base64.b64encode(b"hello from a file\n").decode()

DEFAULT_CALL_ID = "chatcmpl-tool-0000000000000000"
PATCH_ARGS = json.dumps({"input": "*** Begin Patch\n*** End Patch\n"})


# --------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    name: str  # base name, without _stream/_nonstream
    path: str  # /v1/responses or /v1/chat/completions
    body: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]
    note: str = ""
    # Optional seed search: want(summary) -> bool. The first seed in `seeds` for which
    # the non-streaming probe satisfies `want` is used for both variants.
    want: Callable[[dict[str, Any]], bool] | None = None
    seeds: list[int] = field(default_factory=list)
    check: Callable[[str], str] | None = None  # structured-output check of the text
    variants: tuple[str, ...] = ("nonstream", "stream")


def _responses(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "store": False, "max_output_tokens": 48}
    body.update(kw)
    return body


def _chat(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 48}
    body.update(kw)
    return body


def _continuation(state: dict[str, Any]) -> dict[str, Any]:
    call_id = state.get("apply_patch_call_id") or DEFAULT_CALL_ID
    return _responses(
        input=[
            {"type": "message", "role": "user", "content": "Create an empty patch."},
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "apply_patch",
                "arguments": PATCH_ARGS,
            },
            {"type": "function_call_output", "call_id": call_id, "output": "Done."},
            {"type": "message", "role": "user", "content": "Now do it again."},
        ],
        tools=[FN_APPLY_PATCH],
        tool_choice="auto",
    )


def _array_output(parts: list[dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def build(state: dict[str, Any]) -> dict[str, Any]:
        call_id = state.get("apply_patch_call_id") or DEFAULT_CALL_ID
        return _responses(
            input=[
                {"type": "message", "role": "user", "content": "Create an empty patch."},
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "apply_patch",
                    "arguments": PATCH_ARGS,
                },
                {"type": "function_call_output", "call_id": call_id, "output": parts},
            ],
            tools=[FN_APPLY_PATCH],
            tool_choice="auto",
        )

    return build


def _n_calls(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s.get("status") == "completed" and s.get("n_calls", 0) >= n


def check_json(text: str) -> str:
    import jsonschema

    try:
        obj = json.loads(text)
    except ValueError as e:
        return f"NOT JSON ({e})"
    try:
        jsonschema.validate(obj, GET_WEATHER_PARAMS)
    except jsonschema.ValidationError as e:
        return f"JSON but schema-invalid ({e.message})"
    return "valid JSON, matches the get_weather schema"


def check_regex(text: str) -> str:
    return "fullmatches [0-9]{5}" if re.fullmatch(r"[0-9]{5}", text) else "does NOT fullmatch [0-9]{5}"


def check_grammar(text: str) -> str:
    import lark

    try:
        lark.Lark(LARK_CHECK_GRAMMAR, parser="earley").parse(text)
    except lark.exceptions.LarkError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"does NOT parse with lark ({type(e).__name__}: {first[:100]})"
    return "parses with lark (full apply_patch grammar)"


CHOICES = ["get_weather", "get_time", "apply_patch"]


def check_choice(text: str) -> str:
    return "one of the choices" if text in CHOICES else "NOT one of the choices"


def _args_object(need_input: bool) -> Callable[[dict[str, Any]], bool]:
    """The first call's arguments decode to a JSON object (with a non-empty string `input`)."""

    def want(s: dict[str, Any]) -> bool:
        if s.get("status") != "completed" or not s.get("call_args_full"):
            return False
        try:
            v = json.loads(s["call_args_full"][0])
        except (TypeError, ValueError):
            return False
        if not isinstance(v, dict):
            return False
        return not need_input or (isinstance(v.get("input"), str) and v["input"] != "")

    return want


def _chat_ok(s: dict[str, Any]) -> bool:
    return s.get("finish_reason") == "stop" and not str(s.get("check", "")).startswith(("NOT", "does NOT", "JSON but"))


SCENARIOS: list[Scenario] = [
    # ---- /v1/responses
    Scenario("text", "/v1/responses", _responses(input="Say hello.")),
    Scenario(
        "text_completed",
        "/v1/responses",
        _responses(input="Say hello.", stop=["e"]),
        note="a vLLM `stop` string ends the random text early, so the response completes (not cut off)",
        want=lambda s: s.get("status") == "completed",
        seeds=list(range(1, 30)),
    ),
    Scenario(
        "function_call",
        "/v1/responses",
        _responses(
            input="What is the weather in Paris?",
            tools=[FN_GET_WEATHER],
            tool_choice="required",
            max_output_tokens=64,
        ),
        want=_n_calls(1),
        seeds=list(range(1, 30)),
    ),
    Scenario(
        "custom_tool_call",
        "/v1/responses",
        _responses(
            input="Create an empty patch.",
            tools=[FN_APPLY_PATCH],
            tool_choice={"type": "function", "name": "apply_patch"},
            max_output_tokens=64,
        ),
        note="without strict, vLLM enforces only the call envelope: arguments may be any JSON value",
        want=_args_object(False),
        seeds=list(range(1, 60)),
    ),
    Scenario(
        "custom_tool_call_strict",
        "/v1/responses",
        _responses(
            input="Create an empty patch.",
            tools=[{**FN_APPLY_PATCH, "strict": True}],
            tool_choice={"type": "function", "name": "apply_patch"},
            max_output_tokens=128,
        ),
        note='the rewritten tool with "strict": true: the parameters schema is enforced',
        want=_args_object(True),
        seeds=list(range(1, 60)),
    ),
    Scenario(
        "two_calls",
        "/v1/responses",
        _responses(
            input="Weather in Paris and time in Tokyo?",
            tools=[FN_GET_WEATHER, FN_GET_TIME],
            tool_choice="required",
            parallel_tool_calls=True,
            max_output_tokens=160,
        ),
        want=lambda s: s.get("status") == "completed" and s.get("n_calls") == 2,
        seeds=list(range(1, 80)),
    ),
    Scenario(
        "three_calls",
        "/v1/responses",
        _responses(
            input="Weather in Paris and Rome, time in Tokyo?",
            tools=[FN_GET_WEATHER, FN_GET_TIME],
            tool_choice="required",
            parallel_tool_calls=True,
            max_output_tokens=200,
        ),
        want=lambda s: s.get("status") == "completed" and s.get("n_calls") == 3,
        seeds=list(range(1, 120)),
    ),
    Scenario(
        "parallel_false",
        "/v1/responses",
        _responses(
            input="Weather in Paris and time in Tokyo?",
            tools=[FN_GET_WEATHER, FN_GET_TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=160,
        ),
        note="same request as two_calls (same seed) but parallel_tool_calls:false",
    ),
    Scenario("continuation", "/v1/responses", _continuation),
    Scenario(
        "developer_role",
        "/v1/responses",
        _responses(
            input=[
                {"type": "message", "role": "developer", "content": "Be terse."},
                {"type": "message", "role": "user", "content": "Say hello."},
            ]
        ),
    ),
    Scenario(
        "function_output_array_text",
        "/v1/responses",
        _array_output([{"type": "input_text", "text": "Patch applied."}]),
    ),
    Scenario(
        "function_output_array_image",
        "/v1/responses",
        _array_output(
            [
                {"type": "input_text", "text": "Screenshot:"},
                {"type": "input_image", "image_url": PNG_DATA_URL, "detail": "auto"},
            ]
        ),
    ),
    Scenario(
        "function_output_array_file",
        "/v1/responses",
        _array_output(
            [
                {"type": "input_text", "text": "File:"},
                {"type": "input_file", "filename": "a.txt", "file_data": TXT_DATA_URL},
            ]
        ),
    ),
    Scenario("length_cutoff", "/v1/responses", _responses(input="Say hello.", max_output_tokens=4)),
    Scenario("error_unknown_model", "/v1/responses", _responses(model="no-such-model", input="hi")),
    Scenario(
        "error_bad_tool_type",
        "/v1/responses",
        _responses(input="hi", tools=[{"type": "frobnicate"}]),
    ),
    Scenario(
        "error_grammar_custom",
        "/v1/responses",
        _responses(input="Create an empty patch.", tools=[CLIENT_CUSTOM_APPLY_PATCH]),
        note="raw client custom tool with a grammar format sent straight to vLLM",
    ),
    # ---- /v1/chat/completions
    Scenario("chat_text", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "Say hello."}])),
    Scenario(
        "chat_tool_call",
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[chat_tool(FN_GET_WEATHER), chat_tool(FN_GET_TIME)],
            tool_choice="required",
            max_tokens=96,
        ),
        want=lambda s: s.get("finish_reason") in ("tool_calls", "stop") and s.get("n_calls", 0) >= 1,
        seeds=list(range(1, 30)),
    ),
    Scenario(
        "chat_named_tool",
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "user", "content": "Create an empty patch."}],
            tools=[chat_tool(FN_APPLY_PATCH)],
            tool_choice={"type": "function", "function": {"name": "apply_patch"}},
            max_tokens=64,
        ),
        want=lambda s: s.get("finish_reason") == "stop" and s.get("n_calls", 0) >= 1,
        seeds=list(range(1, 30)),
    ),
    Scenario(
        "chat_tool_array_content",
        "/v1/chat/completions",
        _chat(
            messages=[
                {"role": "user", "content": "Create an empty patch."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": DEFAULT_CALL_ID,
                            "type": "function",
                            "function": {"name": "apply_patch", "arguments": PATCH_ARGS},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": DEFAULT_CALL_ID,
                    "content": [{"type": "text", "text": "Patch applied."}],
                },
            ],
            tools=[chat_tool(FN_APPLY_PATCH)],
        ),
    ),
    Scenario(
        "chat_structured_json",
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "user", "content": "Weather query for Paris as JSON."}],
            structured_outputs={"json": GET_WEATHER_PARAMS},
            max_tokens=96,
        ),
        check=check_json,
        want=_chat_ok,
        seeds=list(range(1, 60)),
    ),
    Scenario(
        "chat_structured_regex",
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "user", "content": "A zip code."}],
            structured_outputs={"regex": "[0-9]{5}"},
        ),
        check=check_regex,
    ),
    Scenario(
        "chat_structured_grammar",
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "user", "content": "Create a patch."}],
            structured_outputs={"grammar": APPLY_PATCH_GRAMMAR},
            max_tokens=160,
        ),
        check=check_grammar,
        want=_chat_ok,
        seeds=list(range(1, 120)),
    ),
    Scenario(
        "chat_structured_choice",
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "user", "content": "Pick a tool."}],
            structured_outputs={"choice": CHOICES},
        ),
        check=check_choice,
    ),
]


# ---- tool_choice enforcement (gateway/enforce): multi-step scenarios
#
# Each is a CLIENT Responses request; the upstream requests are built by the gateway's own code
# (gateway.enforce.constrain), so a cassette's recorded bodies are exactly what the gateway sends and the
# tests can assert on them. All steps of one variant go into one cassette, in order.

# An apply_patch-like Lark grammar that the Python `lark` package loads as is (bounded terminals, so
# the tiny random model also terminates: 10/10 seeds in a probe, against ~1/2 for APPLY_PATCH_GRAMMAR).
LARK_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " FILENAME LF add_line+
delete_hunk: "*** Delete File: " FILENAME LF
add_line: "+" TEXT? LF
FILENAME: /[a-z][a-z0-9_]{0,11}\.txt/
TEXT: /[^\n]{1,32}/
%import common.LF
"""
ZIP_REGEX = "[0-9]{5}"
CLIENT_GET_WEATHER = {**FN_GET_WEATHER}
CLIENT_GET_TIME = {**FN_GET_TIME}
CLIENT_LARK_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
                     "format": {"type": "grammar", "syntax": "lark", "definition": LARK_PATCH_GRAMMAR}}
CLIENT_ZIP = {"type": "custom", "name": "zip_code", "description": "Look up a zip code.",
              "format": {"type": "grammar", "syntax": "regex", "definition": ZIP_REGEX}}


@dataclass
class EnforceScenario:
    name: str
    request: dict[str, Any]  # the client's Responses request (without stream/seed)
    note: str = ""
    seeds: list[int] = field(default_factory=lambda: list(range(1, 40)))
    max_len: int | None = None  # prefer a short answer (a JSON answer can be hundreds of whitespace chunks)


ENFORCE_SCENARIOS: list[EnforceScenario] = [
    EnforceScenario("enforce_named_function", {
        "model": MODEL, "input": "What is the weather in Paris?", "tools": [CLIENT_GET_WEATHER, CLIENT_GET_TIME],
        "tool_choice": {"type": "function", "name": "get_weather"}},
        note="named function: arguments generated under structured_outputs json = its parameters", max_len=120),
    EnforceScenario("enforce_required_three", {
        "model": MODEL, "input": "Weather in Paris, the time in Tokyo, or a zip code?",
        "tools": [CLIENT_GET_WEATHER, CLIENT_GET_TIME, CLIENT_ZIP], "tool_choice": "required"},
        note="required among three tools: a choice step picks the tool, then its arguments are constrained"),
    EnforceScenario("enforce_custom_lark", {
        "model": MODEL, "input": "Add a file hello.txt saying hi.", "tools": [CLIENT_LARK_PATCH],
        "tool_choice": {"type": "custom", "name": "apply_patch"}},
        note="custom tool with a Lark grammar: input generated under structured_outputs grammar"),
    EnforceScenario("enforce_custom_regex", {
        "model": MODEL, "input": "The zip code of the Eiffel Tower?", "tools": [CLIENT_ZIP],
        "tool_choice": {"type": "custom", "name": "zip_code"}},
        note="custom tool with a regex: input generated under structured_outputs regex"),
]


def _enforce_steps(client: httpx.Client, sc: EnforceScenario, stream: bool, seed: int, key: str | None
                   ) -> dict[str, Any]:
    """Run the gateway's constrained steps for one client request; return a summary."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gateway.enforce.constrain import args_request, pick_request
    from gateway.enforce.validate import check_arguments, check_input
    from gateway.translate.chat import build_chat_request
    from gateway.translate.tool_context import resolve_tool_context

    req = {**copy.deepcopy(sc.request), "seed": seed}
    ctx = resolve_tool_context(req)
    base = build_chat_request(req, ctx, [], with_tools=False)
    pinned = ctx.pinned_tools
    s: dict[str, Any] = {"http": 200, "steps": []}
    info = pinned[0]
    if len(pinned) > 1:
        r = client.post("/v1/chat/completions", json=pick_request(base, pinned), headers=headers(key))
        if r.status_code != 200:
            return {"http": r.status_code, "error": r.text[:200]}
        picked = r.json()["choices"][0]["message"]["content"]
        s["steps"].append(f"pick -> {picked!r}")
        info = next((i for i in pinned if i.upstream_name == picked), None)
        if info is None:
            s["valid"] = False
            return s
    body = args_request(base, info, stream=stream)
    r = client.post("/v1/chat/completions", json=body, headers=headers(key))
    r.read()
    if r.status_code != 200:
        return {"http": r.status_code, "error": r.text[:200]}
    summ = summarize("/v1/chat/completions", stream, r, None)
    text = summ.get("text", "")
    verdict = check_arguments(info, text) if info.kind == "function" else check_input(info, text)
    s["steps"].append(f"arguments({info.upstream_name}) finish={summ.get('finish_reason')} "
                      f"{'valid' if verdict.ok else 'INVALID: ' + str(verdict.reason)} content={text[:60]!r}")
    s["valid"] = verdict.ok and summ.get("finish_reason") == "stop" and (sc.max_len is None or len(text) <= sc.max_len)
    return s


def record_enforce(args: argparse.Namespace, client: httpx.Client, version: str, wanted: set[str]) -> None:
    out = Path(args.out)
    for sc in ENFORCE_SCENARIOS:
        for variant in ("nonstream", "stream"):
            name = f"{sc.name}_{variant}"
            if wanted and name not in wanted and sc.name not in wanted:
                continue
            path = out / f"{name}.yaml"
            stream = variant == "stream"
            summary: dict[str, Any] = {}
            for seed in sc.seeds:
                if path.exists():
                    path.unlink()
                my_vcr = vcr.VCR(serializer="yaml", record_mode="all", decode_compressed_response=True,
                                 filter_headers=["authorization"])
                with my_vcr.use_cassette(str(path)):
                    summary = _enforce_steps(client, sc, stream, seed, args.api_key)
                if summary.get("valid"):
                    break
            now = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
            req = json.dumps({**sc.request, "seed": seed, **({"stream": True} if stream else {})})
            hdr = [
                f"# scenario: {name}",
                f"# recorded: {now}",
                f"# vllm-version: {version}",
                f"# upstream: {args.upstream} model={MODEL} (tiny random-weight model, hermes tool parser)",
                f"# client request (Responses, to the gateway; upstream requests built by gateway.enforce): {req}",
                f"# seed: {seed} (the first seed of {sc.seeds[0]}..{sc.seeds[-1]} whose answer was valid"
                + (f" and at most {sc.max_len} characters)" if sc.max_len else ")")
                if summary.get("valid") else f"# seed: {seed} (NO seed gave a valid answer)",
                f"# note: {sc.note}",
                f"# result: {'; '.join(summary.get('steps', [])) or summary.get('error')}",
            ]
            text = path.read_text()
            path.write_text("\n".join(h.replace("\n", "\\n") for h in hdr) + "\n" + text)
            print(f"{name}: seed {seed}: {'; '.join(summary.get('steps', []))}", flush=True)


# --------------------------------------------------------------------------- summaries


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event, data) frames."""
    frames = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        ev, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                ev = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        frames.append((ev, "\n".join(data)))
    return frames


def _summ_response_obj(resp: dict[str, Any], s: dict[str, Any]) -> None:
    s["status"] = resp.get("status")
    if resp.get("incomplete_details"):
        s["incomplete"] = resp["incomplete_details"].get("reason")
    items = []
    n_calls = 0
    texts = []
    for it in resp.get("output") or []:
        t = it.get("type")
        if t in ("function_call", "custom_tool_call"):
            n_calls += 1
            args = it.get("arguments", it.get("input"))
            items.append(f"{t} {it.get('name')} args={str(args)[:60]!r}")
            s.setdefault("call_ids", []).append(it.get("call_id"))
            s.setdefault("call_names", []).append(it.get("name"))
            s.setdefault("call_args_full", []).append(args)
        elif t == "message":
            txt = "".join(p.get("text", "") for p in it.get("content") or [])
            texts.append(txt)
            items.append(f"message text={txt[:40]!r}")
        else:
            items.append(str(t))
    s["items"] = items
    s["n_calls"] = n_calls
    s["text"] = "".join(texts)


def summarize(path: str, stream: bool, resp: httpx.Response, check: Callable[[str], str] | None) -> dict[str, Any]:
    s: dict[str, Any] = {"http": resp.status_code}
    body = resp.text
    if resp.status_code != 200:
        try:
            err = resp.json()["error"]
            s["error"] = f"{err.get('type')}: {str(err.get('message'))[:200]}"
        except Exception:
            s["error"] = body[:200]
        return s
    if path == "/v1/responses":
        if not stream:
            _summ_response_obj(resp.json(), s)
        else:
            frames = parse_sse(body)
            s["events"] = len(frames)
            s["ends_with_blank_line"] = body.endswith("\n\n")
            s["done_marker"] = any(d == "[DONE]" for _, d in frames)
            last = None
            for _ev, d in frames:
                try:
                    obj = json.loads(d)
                except ValueError:
                    continue
                if obj.get("type") in ("response.completed", "response.incomplete", "response.failed"):
                    last = obj
            s["final_event"] = last.get("type") if last else None
            if last:
                _summ_response_obj(last["response"], s)
    else:
        if not stream:
            ch = resp.json()["choices"][0]
            msg = ch["message"]
            s["finish_reason"] = ch.get("finish_reason")
            s["text"] = msg.get("content") or ""
            calls = msg.get("tool_calls") or []
            s["n_calls"] = len(calls)
            s["call_names"] = [c["function"]["name"] for c in calls]
            s["call_args"] = [c["function"]["arguments"][:60] for c in calls]
        else:
            frames = parse_sse(body)
            s["chunks"] = len(frames)
            s["done_marker"] = frames[-1][1] == "[DONE]" if frames else False
            text, calls, usage = [], {}, False
            for _, d in frames:
                if d == "[DONE]":
                    continue
                obj = json.loads(d)
                if obj.get("usage") and not obj.get("choices"):
                    usage = True
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    if delta.get("content"):
                        text.append(delta["content"])
                    for tc in delta.get("tool_calls") or []:
                        c = calls.setdefault(tc["index"], {"name": "", "args": ""})
                        fn = tc.get("function") or {}
                        c["name"] += fn.get("name") or ""
                        c["args"] += fn.get("arguments") or ""
                    if ch.get("finish_reason"):
                        s["finish_reason"] = ch["finish_reason"]
            s["text"] = "".join(text)
            s["n_calls"] = len(calls)
            s["call_names"] = [c["name"] for c in calls.values()]
            s["call_args"] = [c["args"][:60] for c in calls.values()]
            s["usage_chunk"] = usage
    if check is not None:
        s["check"] = check(s.get("text", ""))
    return s


def describe(s: dict[str, Any]) -> str:
    if s["http"] != 200:
        return f"HTTP {s['http']}; error {s.get('error')}"
    parts = [f"HTTP {s['http']}"]
    for k in ("status", "incomplete", "finish_reason", "final_event", "events", "chunks"):
        if s.get(k) is not None:
            parts.append(f"{k}={s[k]}")
    if "items" in s:
        parts.append(f"output=[{'; '.join(s['items'])}]")
    if s.get("n_calls") or "call_names" in s:
        parts.append(f"{s.get('n_calls', 0)} call(s) {s.get('call_names', [])}")
        if s.get("call_args"):
            parts.append(f"args={s['call_args']}")
    if s.get("text") and "items" not in s:
        parts.append(f"text={s['text'][:80]!r}")
    if "usage_chunk" in s:
        parts.append(f"usage_chunk={s['usage_chunk']} done_marker={s['done_marker']}")
    elif "done_marker" in s:
        parts.append(f"done_marker={s['done_marker']} ends_with_blank_line={s.get('ends_with_blank_line')}")
    if s.get("check"):
        parts.append(f"check: {s['check']}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- recording


def headers(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def build_body(sc: Scenario, state: dict[str, Any], stream: bool, seed: int | None) -> dict[str, Any]:
    body = copy.deepcopy(sc.body(state) if callable(sc.body) else sc.body)
    if seed is not None:
        body["seed"] = seed
    if stream:
        body["stream"] = True
        if sc.path == "/v1/chat/completions":
            body["stream_options"] = {"include_usage": True}
    return body


def _record_one(
    client: httpx.Client, path: Path, sc: Scenario, body: dict[str, Any], key: str | None
) -> httpx.Response:
    if path.exists():
        path.unlink()
    my_vcr = vcr.VCR(
        serializer="yaml",
        record_mode="all",
        decode_compressed_response=True,
        filter_headers=["authorization"],
    )
    with my_vcr.use_cassette(str(path)):
        r = client.post(sc.path, json=body, headers=headers(key))
        r.read()  # the whole body (the full SSE stream) is what vcrpy stores
    return r


def record(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = args.api_key
    client = httpx.Client(base_url=args.upstream, timeout=args.timeout)
    version = client.get("/version").json().get("version", "?")
    state: dict[str, Any] = {}
    ctc = out / "custom_tool_call_nonstream.yaml"
    if ctc.exists():  # the call_id of a previously recorded call, for continuation
        try:
            cas = yaml.safe_load(ctc.read_text())
            resp = json.loads(cas["interactions"][0]["response"]["body"]["string"])
            state["apply_patch_call_id"] = next(
                it["call_id"] for it in resp["output"] if it.get("name") == "apply_patch"
            )
        except Exception:
            pass
    wanted = set(args.only or [])
    used_seed: dict[str, int | None] = {}  # "<scenario>_<variant>" -> seed
    for sc in SCENARIOS:
        for variant in sc.variants:
            name = f"{sc.name}_{variant}"
            if wanted and name not in wanted and sc.name not in wanted:
                continue
            stream = variant == "stream"
            path = out / f"{name}.yaml"
            if sc.name == "parallel_false":
                # the same request and seed as two_calls, only parallel_tool_calls differs
                seed = used_seed.get(f"two_calls_{variant}", args.parallel_seed)
                seeds, seed_note = [seed], f"seed {seed} (the seed of two_calls_{variant})"
            elif sc.seeds and sc.want is not None:
                seeds, seed_note = sc.seeds, ""
            else:
                seeds, seed_note = [None], ""
            # Record until the response has the wanted property (sampling on this CPU build
            # differs between streaming and non-streaming, so each variant searches itself).
            best: tuple[int, int | None] = (-1, None)
            chosen: int | None = None
            for seed in seeds:
                body = build_body(sc, state, stream, seed)
                r = _record_one(client, path, sc, body, key)
                s = summarize(sc.path, stream, r, sc.check)
                if len(seeds) == 1 or sc.want is None:
                    chosen = seed
                    break
                if sc.want(s):
                    chosen = seed
                    seed_note = (
                        f"seed {seed} (the first seed tried; it gave the wanted output)"
                        if seed == seeds[0]
                        else f"seed {seed} (seeds {seeds[0]}..{seed - 1} did not give the wanted output)"
                    )
                    break
                if s.get("n_calls", 0) > best[0]:
                    best = (s.get("n_calls", 0), seed)
            else:
                chosen = best[1]
                seed_note = f"seed {chosen} (NO seed in {seeds[0]}..{seeds[-1]} gave the wanted output; best effort)"
                body = build_body(sc, state, stream, chosen)
                r = _record_one(client, path, sc, body, key)
                s = summarize(sc.path, stream, r, sc.check)
            used_seed[name] = chosen
            if sc.name == "custom_tool_call" and not stream and s.get("call_ids"):
                state["apply_patch_call_id"] = s["call_ids"][0]
            desc = describe(s)
            now = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
            hdr = [
                f"# scenario: {name}",
                f"# recorded: {now}",
                f"# vllm-version: {version}",
                f"# upstream: {args.upstream} model={body.get('model')} (tiny random-weight model, hermes tool parser)",
                f"# request: POST {sc.path} stream={str(stream).lower()}" + (f"; {seed_note}" if seed_note else ""),
            ]
            if sc.note:
                hdr.append(f"# note: {sc.note}")
            hdr.append(f"# result: {desc}")
            if s["http"] == 200 and "n_calls" in s:
                hdr.append(f"# calls: {s['n_calls']}")
            text = path.read_text()
            path.write_text("\n".join(h.replace("\n", "\\n") for h in hdr) + "\n" + text)
            print(f"{name}: {desc}", flush=True)
    record_enforce(args, client, version, wanted)
    client.close()
    return 0


SCENARIOS_BY_NAME = {sc.name: sc for sc in SCENARIOS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", default="http://127.0.0.1:8011")
    ap.add_argument("--out", default="cassettes/vllm")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="scenario names, with or without the _stream/_nonstream suffix",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="sent as a bearer token; filtered out of the cassettes",
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument(
        "--parallel-seed",
        type=int,
        default=None,
        help="seed for parallel_false when two_calls is not recorded in the same run",
    )
    ap.add_argument("--list", action="store_true", help="list scenario names and exit")
    args = ap.parse_args(argv)
    if args.list:
        for sc in SCENARIOS:
            for v in sc.variants:
                print(f"{sc.name}_{v}")
        for esc in ENFORCE_SCENARIOS:
            for v in ("nonstream", "stream"):
                print(f"{esc.name}_{v}")
        return 0
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
