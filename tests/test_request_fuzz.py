"""Bad input never reaches a 500: fuzzed request bodies against the in-process app.

The upstream is a ``MockTransport`` that answers every POST with a valid minimal vLLM answer (Responses or
Chat Completions, streamed or not, honouring ``structured_outputs`` the way vLLM would), so anything 5xx the
client sees is the gateway's own failure. Every 4xx must be OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import copy
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import Settings
from gateway.server import create_app
from gateway.store import SqliteResponseStore
from tests.sdk_shapes import forgive_echoed
from tests.support import sse_events

# ---------------------------------------------------------------------------------------------- the upstream

_USAGE_CHAT = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
_USAGE_RESP = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
               "output_tokens": 2,
               "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}


def _sse(events: list[tuple[str | None, Any]]) -> bytes:
    out = b""
    for event, data in events:
        head = f"event: {event}\n".encode() if event else b""
        payload = data if isinstance(data, bytes) else orjson.dumps(data)
        out += head + b"data: " + payload + b"\n\n"
    return out


def _call(body: dict[str, Any], chat: bool) -> tuple[str, str] | None:
    """(name, arguments) of a call to the first offered tool, on about half the requests that offer one."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none" or len(str(body)) % 2:
        return None
    tool = tools[0].get("function", tools[0]) if chat else tools[0]
    params = tool.get("parameters")
    custom = isinstance(params, dict) and isinstance(params.get("properties"), dict) and "input" in params["properties"]
    return str(tool.get("name")), '{"input": "x"}' if custom else "{}"


def _chat_text(body: dict[str, Any]) -> str:
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        if isinstance(so.get("choice"), list) and so["choice"]:
            return str(so["choice"][0])
        if "json" in so:
            return "{}"
        return "x"
    return "ok"


def _chat(body: dict[str, Any]) -> httpx.Response:
    text, call = _chat_text(body), _call(body, chat=True)
    base = {"id": "chatcmpl-1", "created": 1, "model": str(body.get("model") or "tiny")}
    tool_calls = [{"id": "call_up", "type": "function", "function": {"name": call[0], "arguments": call[1]}}] \
        if call else None
    finish = "tool_calls" if call else "stop"
    if not body.get("stream"):
        message = {"role": "assistant", "content": None if call else text, "tool_calls": tool_calls}
        return httpx.Response(200, json={**base, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": finish}], "usage": _USAGE_CHAT})
    chunk = {**base, "object": "chat.completion.chunk"}
    delta = {"tool_calls": [{"index": 0, **tool_calls[0]}]} if tool_calls else {"content": text}
    frames = [
        (None, {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]}),
        (None, {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
        (None, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
        (None, {**chunk, "choices": [], "usage": _USAGE_CHAT}),
        (None, b"[DONE]"),
    ]
    return httpx.Response(200, content=_sse(frames), headers={"content-type": "text/event-stream"})


def _responses(body: dict[str, Any]) -> httpx.Response:
    call = _call(body, chat=False)
    part = {"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}
    if call:
        item = {"id": "fc_1", "type": "function_call", "call_id": "call_up", "name": call[0], "arguments": call[1],
                "status": "completed"}
        opened = {**item, "arguments": "", "status": "in_progress"}
        middle: list[dict[str, Any]] = [
            {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0,
             "delta": call[1]},
            {"type": "response.function_call_arguments.done", "item_id": "fc_1", "output_index": 0,
             "arguments": call[1]},
        ]
    else:
        item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": [part]}
        opened = {**item, "status": "in_progress", "content": []}
        middle = [
            {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0, "content_index": 0,
             "part": {**part, "text": ""}},
            {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0,
             "delta": "ok", "logprobs": []},
            {"type": "response.output_text.done", "item_id": "msg_1", "output_index": 0, "content_index": 0,
             "text": "ok", "logprobs": []},
            {"type": "response.content_part.done", "item_id": "msg_1", "output_index": 0, "content_index": 0,
             "part": part},
        ]
    resp = {"id": "resp_up", "object": "response", "created_at": 1, "model": str(body.get("model") or "tiny"),
            "status": "completed", "output": [item], "usage": _USAGE_RESP, "error": None,
            "incomplete_details": None, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    if not body.get("stream"):
        return httpx.Response(200, json=resp)
    started = {**resp, "status": "in_progress", "output": [], "usage": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": opened},
        *middle,
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": resp},
    ]
    for seq, ev in enumerate(events):
        ev["sequence_number"] = seq
    return httpx.Response(200, content=_sse([(ev["type"], ev) for ev in events]),
                          headers={"content-type": "text/event-stream"})


def fake_vllm(request: httpx.Request) -> httpx.Response:
    """A valid minimal vLLM answer to any POST (the gateway always sends JSON it could serialize)."""
    body = orjson.loads(request.content) if request.content else {}
    assert isinstance(body, dict)
    if request.url.path.endswith("/chat/completions"):
        return _chat(body)
    return _responses(body)


# ---------------------------------------------------------------------------------------------- the gateway

PREVIOUS = "resp_prev"  # replaced in every request by the id of a response stored at startup
_WARM_UP = {"model": "tiny", "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "apply_patch"}],
            "input": [{"role": "user", "content": "hi"},
                      {"type": "function_call", "call_id": "call_0", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_0", "output": "done"},
                      {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": "x"},
                      {"type": "custom_tool_call_output", "call_id": "call_9", "output": [
                          {"type": "input_text", "text": "ok"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]}]}


class InProcessGateway:
    """The app with its lifespan running, on one event loop kept for the whole module (hypothesis calls
    the test body many times; a loop per example would dominate the run time)."""

    def __init__(self, **overrides: Any) -> None:
        settings_ = Settings(upstream_url="http://upstream.test", store="none", **overrides)
        self.upstream_api = settings_.upstream_api
        self._dir = tempfile.TemporaryDirectory()
        self.store = SqliteResponseStore(Path(self._dir.name) / "responses.db")
        self.app = create_app(settings_, transport=httpx.MockTransport(fake_vllm), store=self.store)
        self.runner = asyncio.Runner()
        self.lifespan = self.app.router.lifespan_context(self.app)
        self.runner.run(self.lifespan.__aenter__())
        # 127.0.0.1: a Host the default rule of a keyless gateway bound to loopback answers
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://127.0.0.1")
        first = self.post(orjson.dumps(_WARM_UP))
        assert first.status_code == 200, first.text
        self.previous = first.json()["id"]  # every fuzzed previous_response_id names this stored response

    def post(self, content: bytes) -> httpx.Response:
        content = content.replace(PREVIOUS.encode(), getattr(self, "previous", PREVIOUS).encode())
        return self.runner.run(self.client.post("/v1/responses", content=content,
                                                headers={"content-type": "application/json"}))

    def close(self) -> None:
        self.runner.run(self.client.aclose())
        self.runner.run(self.lifespan.__aexit__(None, None, None))
        self.runner.close()
        self._dir.cleanup()


MAX_EXAMPLES = 600  # per configuration: the whole file runs in about 10 s on 2 cores

CONFIGS = [("responses", "off"), ("responses", "constrain"), ("chat", "off"), ("chat", "constrain")]


# The Response fields that echo the request (gateway/translate/restore.py build_request_state).
ECHOED = frozenset({"tools", "tool_choice", "parallel_tool_calls", "metadata", "previous_response_id", "store",
                    "instructions", "max_output_tokens", "text", "truncation", "model", "conversation", "user",
                    "safety_identifier", "prompt_cache_key", "service_tier", "max_tool_calls", "reasoning",
                    "background", "temperature", "top_p"})


@pytest.fixture(autouse=True)
def echoed_request_fields_pass(sdk_validates_every_completed_event: list[tuple[Exception, bytes]]
                               ) -> Iterator[None]:
    """Fuzzed bodies carry values OpenAI would refuse but the gateway accepts leniently and echoes as sent (a
    ``namespace`` tool without a ``description``, a ``{"type": "namespace"}`` tool_choice, a float
    ``max_tool_calls``…); the SDK's closed models reject the echo. Errors in the echoed request fields, and only
    there, are not held against the fuzz tests; the rest of every completed event is (tests/conftest.py)."""
    yield
    forgive_echoed(sdk_validates_every_completed_event, ECHOED)


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{a}-{m}" for a, m in CONFIGS])
def gateway(request: pytest.FixtureRequest) -> Iterator[InProcessGateway]:
    api, mode = request.param
    gw = InProcessGateway(upstream_api=api, tool_choice_enforcement=mode, log_level="error")
    try:
        yield gw
    finally:
        gw.close()


def check_answer(resp: httpx.Response, raw: bytes) -> None:
    where = f"request body (first 600 bytes): {raw[:600]!r}\nanswer: {resp.status_code} {resp.content[:600]!r}"
    assert resp.status_code < 500, where
    if resp.status_code >= 400:
        body = resp.json()
        assert isinstance(body, dict) and set(body) == {"error"}, where
        err = body["error"]
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"], where
        assert err["type"] == "invalid_request_error" or resp.status_code in (401, 403, 404, 413, 429), where
        assert err["param"] is None or isinstance(err["param"], str), where
        assert err["code"] is None or isinstance(err["code"], str), where
        assert len(err["message"]) < 4096 and (err["param"] is None or len(err["param"]) < 512), where
    else:
        assert resp.status_code == 200, where
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            events = sse_events(resp.content)
            assert events and events[-1]["type"] in TERMINAL, where
            final = events[-1]["response"]
        else:
            final = resp.json()
        assert final.get("object") == "response", where
        # A background response answers at once, queued; a streamed one runs to its end like any other.
        queued = ("queued", "in_progress") if b'"background"' in raw else ()
        assert final.get("status") in ("completed", "incomplete", "failed", *queued), where
        assert (final.get("error") or {}).get("code") not in ("internal_error", "server_error"), where


TERMINAL = ("response.completed", "response.incomplete", "response.failed")


# ---------------------------------------------------------------------------------------------- strategies
# Mostly valid values with junk mixed in at every level (``w``): a body that is wrong everywhere only ever
# reaches the first check, so each field is valid most of the time and the interesting code runs.

ODD_TEXT = st.sampled_from([
    "", " ", "\x00", "\u202e", "\ufeff", "\U0001f600", "a\u0301", "\uffff", "𝔘𝔫𝔦", "\n\r\t", "\\", '"', "null",
    "x" * 70, "a" * 300, "é" * 40, "\u2028\u2029",
])
LONE_SURROGATES = st.sampled_from(["\ud800", "a\udfffb"])  # json.dumps escapes them; orjson refuses them
TEXT = st.one_of(ODD_TEXT, st.text(max_size=20))
HUGE_TEXT = st.sampled_from(["y" * 100_000, "\U0001f600" * 20_000])
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324, 1.5]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)


def rare(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in ``one_in`` draws (a middle value: hypothesis favours the bounds of a range)."""
    return draw(st.integers(0, 2 * one_in)) in (one_in, one_in + 1)


@st.composite
def w(draw: st.DrawFn, valid: st.SearchStrategy[Any], weight: int = 6) -> Any:
    """``valid`` most of the time, any JSON value about once in ``weight`` draws."""
    return draw(JUNK) if rare(draw, weight) else draw(valid)


def maybe(key_values: dict[str, st.SearchStrategy[Any]], **required: st.SearchStrategy[Any]
          ) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts with the ``required`` keys (usually valid) and any of the optional ones."""
    return st.fixed_dictionaries(required, optional=key_values)


def one(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


TOOL_NAMES = ("f", "g", "apply_patch", "h-1")
NAME = w(one(*TOOL_NAMES, "ns", "a" * 64, "a" * 65, "bad name", "", "x" * 200), 8)
NS_NAME = w(one("ns", "other", "n" * 70))
LARK = one("start: /a+/", 'start: "x" | "y"', "start: /[^\\n]*/", "start: ", "%import x", "start: /(/",
           "start: a\na: /b/+", "start: (" + "a " * 50 + ")")
REGEX = one("[a-z]+", "(", "a{99999}", ".*", "(?P<x>a)(?P=y)", "\\", "[", "x" * 1000)
FORMAT = w(st.one_of(
    st.just({"type": "text"}),
    maybe({}, type=st.just("grammar"), syntax=st.just("lark"), definition=w(LARK)),
    maybe({}, type=st.just("grammar"), syntax=st.just("regex"), definition=w(REGEX)),
    maybe({"type": w(one("text", "grammar")), "syntax": w(one("lark", "regex", "ebnf")), "definition": JUNK}),
))
SCHEMA = w(one(
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    {"type": "object", "properties": {}}, {"type": "object"}, {}, {"$schema": "http://nope"},
    {"type": "nonsense"}, {"type": "string"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}, "required": ["a"]},
    {"enum": []}, {"type": "object", "minProperties": 1}, {"not": {}}, {"type": "array"},
    {"type": "object", "required": "a"}, {"type": "object", "properties": {"a": {"format": "regex", "type": "string"}}},
))
FUNCTION = maybe({"description": w(TEXT), "parameters": SCHEMA, "strict": w(st.booleans()),
                  "defer_loading": JUNK}, type=st.just("function"), name=NAME)
CUSTOM = maybe({"description": w(TEXT), "format": FORMAT}, type=st.just("custom"), name=NAME)
MEMBER = w(st.one_of(FUNCTION, CUSTOM), 8)
NAMESPACE = maybe({"description": w(TEXT)}, type=st.just("namespace"), name=NS_NAME,
                  tools=w(st.lists(MEMBER, min_size=1, max_size=3)))
HOSTED = maybe({"x": JUNK}, type=one("web_search", "mcp", "file_search", "image_generation", "code_interpreter"))
LABEL = w(one("s1", "s2", "bad label", ""))
MCP = maybe({"server_url": w(one("http://mcp.test/sse", "https://10.0.0.1/mcp", "file:///etc/passwd", "")),
             "allowed_tools": w(st.one_of(st.lists(NAME, max_size=2), st.just({"tool_names": ["t"]}))),
             "require_approval": w(one("always", "never", {"never": {"tool_names": ["t"]}})),
             "headers": w(st.dictionaries(TEXT, TEXT, max_size=2)), "authorization": w(TEXT),
             "server_description": w(TEXT)}, type=st.just("mcp"), server_label=LABEL)
TOOL = w(st.one_of(FUNCTION, FUNCTION, CUSTOM, CUSTOM, NAMESPACE, HOSTED, MCP), 10)
TOOLS = w(st.lists(TOOL, max_size=4), 8)
NAMED = maybe({"namespace": NS_NAME}, type=w(one("function", "custom")), name=NAME)
MCP_CHOICE = maybe({"name": NAME}, type=st.just("mcp"), server_label=LABEL)
TOOL_CHOICE = w(st.one_of(
    one("none", "auto", "required", "any"), NAMED, NAMED, MCP_CHOICE,
    maybe({}, type=st.just("allowed_tools"), mode=w(one("auto", "required")), tools=w(st.lists(w(st.one_of(
        NAMED, maybe({}, type=st.just("namespace"), name=NS_NAME), HOSTED, MCP_CHOICE)), max_size=3))),
    maybe({"x": JUNK}, type=one("web_search", "mcp", "namespace", "file_search")),
))
PART = w(st.one_of(
    maybe({}, type=one("input_text", "output_text", "text", "summary_text", "reasoning_text"), text=w(TEXT)),
    maybe({}, type=st.just("refusal"), refusal=w(TEXT)),
    maybe({"detail": w(one("auto", "low", None))}, type=st.just("input_image"),
          image_url=w(one("data:image/png;base64,AAAA", "http://x/y.png", ""))),
    maybe({"file_id": JUNK}, type=one("input_image", "input_file")),
    maybe({"file_data": w(TEXT), "filename": w(TEXT)}, type=st.just("input_file")),
), 10)
PARTS = w(st.lists(PART, max_size=3))
CONTENT = st.one_of(w(TEXT), PARTS)
ROLE = w(one("user", "assistant", "system", "developer", "tool"))
CALL_ID = w(one("call_1", "call_2"))
ITEM = w(st.one_of(
    maybe({"type": w(st.just("message")), "id": w(one("msg_1", "x"))}, role=ROLE, content=CONTENT),
    maybe({"tools": TOOLS, "type": w(st.just("message"))}, role=st.just("developer"), content=CONTENT),
    maybe({"id": w(one("fc_1", "x")), "namespace": NS_NAME, "status": JUNK}, type=st.just("function_call"),
          call_id=CALL_ID, name=NAME, arguments=w(one("{}", "", "[", "null", '{"a": "b"}'))),
    maybe({}, type=one("function_call_output", "custom_tool_call_output"), call_id=CALL_ID,
          output=st.one_of(w(TEXT), PARTS)),
    maybe({"namespace": NS_NAME, "id": JUNK}, type=st.just("custom_tool_call"), call_id=CALL_ID, name=NAME,
          input=w(TEXT)),
    maybe({"summary": w(st.lists(PART, max_size=2)), "content": PARTS, "encrypted_content": JUNK},
          type=st.just("reasoning"), id=w(st.just("rs_1"))),
    maybe({}, type=st.just("item_reference"), id=w(st.one_of(TEXT, one("msg_1", "fc_1", "rs_1")))),
    maybe({"error": JUNK, "output": w(TEXT)}, type=st.just("mcp_call"), id=w(one("mcp_1")), server_label=LABEL,
          name=NAME, arguments=w(one("{}", "[", '{"a": 1}'))),
    maybe({"tools": w(st.lists(maybe({"description": w(TEXT), "input_schema": SCHEMA}, name=NAME), max_size=2))},
          type=st.just("mcp_list_tools"), id=w(one("mcpl_1")), server_label=LABEL),
    maybe({}, type=st.just("mcp_approval_request"), id=w(one("mcpr_1", "mcpr_2")), server_label=LABEL, name=NAME,
          arguments=w(one("{}", "x"))),
    maybe({"reason": w(TEXT)}, type=st.just("mcp_approval_response"),
          approval_request_id=w(one("mcpr_1", "mcpr_2")), approve=w(st.booleans())),
    maybe({"x": JUNK}, type=one("web_search_call", "mcp_call", "nonsense")),
), 10)
INPUT = w(st.one_of(TEXT, st.lists(ITEM, max_size=4), st.lists(ITEM, max_size=4)), 8)

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "instructions": w(TEXT), "stream": w(st.booleans()), "store": w(st.booleans()),
    "background": w(st.booleans()), "previous_response_id": w(one(PREVIOUS, PREVIOUS, "resp_nope", "")),
    "metadata": w(st.dictionaries(TEXT, TEXT, max_size=3)), "max_output_tokens": w(NUMBERS),
    "temperature": w(NUMBERS), "top_p": w(NUMBERS), "parallel_tool_calls": w(st.booleans()),
    "tools": TOOLS, "tool_choice": TOOL_CHOICE,
    "include": w(st.lists(w(one("reasoning.encrypted_content", "message.output_text.logprobs", "nope")),
                          max_size=3)),
    "text": w(maybe({"format": w(st.one_of(
        maybe({"strict": w(st.booleans()), "name": w(TEXT)}, type=st.just("json_schema"), schema=SCHEMA),
        st.just({"type": "json_object"}), st.just({"type": "text"})))})),
    "reasoning": w(maybe({"effort": w(one("low", "high")), "summary": w(one("auto"))})),
    "top_logprobs": w(NUMBERS), "truncation": w(one("auto", "disabled")), "user": w(TEXT), "seed": w(NUMBERS),
    "stop": w(st.one_of(TEXT, st.lists(TEXT, max_size=2))), "n": w(NUMBERS), "conversation": JUNK,
    "prompt": JUNK, "service_tier": w(one("auto")), "max_tool_calls": w(NUMBERS), "structured_outputs": JUNK,
    "top_k": w(NUMBERS), "logit_bias": JUNK, "chat_template_kwargs": JUNK, "frequency_penalty": w(NUMBERS),
}
_COMMON = ("tools", "tool_choice", "parallel_tool_calls", "include", "previous_response_id")
BODIES = st.fixed_dictionaries({"model": w(st.just("tiny"), 10), "input": INPUT, "stream": w(st.booleans(), 10)},
                               optional={k: v for k, v in FIELDS.items() if k in _COMMON})


# A coherent request (declared tools, a tool_choice naming them, a history whose calls use them), which
# reaches enforcement and the upstream; ``mutate`` then breaks it in one place, anywhere in the tree.
GOOD_SCHEMAS = one(None, {}, {"type": "object"}, {"type": "object", "properties": {"a": {"type": "string"}},
                                                  "required": ["a"]},
                   {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, {"type": "string"},
                   {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}})
GOOD_FORMATS = one(None, {"type": "text"}, {"type": "grammar", "syntax": "lark", "definition": "start: /a+/"},
                   {"type": "grammar", "syntax": "lark", "definition": "start: /[^\\n]*/"},
                   {"type": "grammar", "syntax": "lark", "definition": "start: "},
                   {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"},
                   {"type": "grammar", "syntax": "regex", "definition": "("})


def _without_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@st.composite
def coherent_bodies(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(one("f", "g", "apply_patch", "h"), unique=True, max_size=3))
    tools: list[dict[str, Any]] = []
    declared: list[dict[str, Any]] = []  # what a tool_choice may name
    for name in names:
        if draw(st.booleans()):
            tools.append(_without_none({"type": "function", "name": name, "parameters": draw(GOOD_SCHEMAS),
                                        "description": draw(st.one_of(st.none(), TEXT))}))
            declared.append({"type": "function", "name": name})
        else:
            tools.append(_without_none({"type": "custom", "name": name, "format": draw(GOOD_FORMATS)}))
            declared.append({"type": "custom", "name": name})
    if draw(st.booleans()):
        tools.append({"type": "namespace", "name": "ns", "tools": [
            {"type": "function", "name": "m1"}, _without_none({"type": "custom", "name": "m2",
                                                               "format": draw(GOOD_FORMATS)})]})
        declared += [{"type": "function", "name": "m1", "namespace": "ns"}, {"type": "custom", "name": "m2"}]
    if draw(st.booleans()):
        tools.append({"type": draw(one("web_search", "file_search", "image_generation"))})
    choices: list[Any] = ["auto", "none", "required", None] if tools else [None, "none"]
    choices += declared
    if declared:
        picked = draw(st.lists(st.sampled_from(declared), min_size=1, max_size=3, unique_by=lambda t: t["name"]))
        choices.append({"type": "allowed_tools", "mode": draw(one("auto", "required")), "tools": picked})
    choice = draw(st.sampled_from(choices))
    call_names = [t["name"] for t in declared] or ["f"]
    items: list[Any] = []
    for n in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(call_names))
        kind = draw(one("message", "assistant", "function", "custom", "reasoning", "developer"))
        if kind == "message":
            items.append({"role": draw(one("user", "system", "developer")), "content": draw(CONTENT)})
        elif kind == "assistant":
            items.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": draw(TEXT)}]})
        elif kind == "function":
            items += [{"type": "function_call", "call_id": f"call_{n}", "name": name,
                       "arguments": draw(one("{}", '{"a": "b"}', "[", ""))},
                      {"type": "function_call_output", "call_id": f"call_{n}",
                       "output": draw(st.one_of(TEXT, st.lists(PART, max_size=2)))}]
        elif kind == "custom":
            items += [{"type": "custom_tool_call", "call_id": f"call_{n}", "name": name, "input": draw(TEXT)},
                      {"type": "custom_tool_call_output", "call_id": f"call_{n}", "output": draw(TEXT)}]
        elif kind == "reasoning":
            items.append({"type": "reasoning", "id": f"rs_{n}", "summary": [
                {"type": "summary_text", "text": draw(TEXT)}]})
        else:
            items.append({"role": "developer", "content": "", "tools": [
                {"type": "function", "name": f"dyn{n}", "parameters": draw(GOOD_SCHEMAS) or {}}]})
    items.append({"role": "user", "content": draw(TEXT)})
    body: dict[str, Any] = {"model": "tiny", "input": items if len(items) > 1 or draw(st.booleans()) else "hi",
                            "stream": draw(st.booleans())}
    if tools:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    for key in draw(st.lists(one("parallel_tool_calls", "max_output_tokens", "instructions", "previous_response_id",
                                 "text", "include", "metadata", "reasoning", "temperature"), unique=True,
                             max_size=3)):
        body[key] = draw(FIELDS[key])
    return body


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def mutate(draw: st.DrawFn, body: dict[str, Any]) -> None:
    """Replace one value anywhere in ``body`` by any JSON value (or, in an object, drop it)."""
    paths = list(_paths(body))[1:]
    if not paths:
        return
    path = draw(st.sampled_from(paths))
    parent: Any = body
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rare(draw, 4):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JUNK)


DEEP = "\x00deep\x00"  # stands for a deeply nested value until the body is serialized


def nested_json(depth: int, leaf: str = "1") -> str:
    """``depth`` nested containers, alternating arrays and objects, as JSON text (no recursion)."""
    opens = "".join("[" if i % 2 == 0 else '{"a":' for i in range(depth))
    closes = "".join("]" if i % 2 == 0 else "}" for i in reversed(range(depth)))
    return opens + leaf + closes


def _deep_somewhere(draw: st.DrawFn, body: dict[str, Any]) -> int:
    depth = draw(st.sampled_from([56, 60, 61, 62, 64, 70, 200, 250, 254, 256, 300, 1100]))
    where = draw(st.sampled_from(["metadata", "tools", "tool_choice", "input", "text", "top", "item"]))
    if where == "tools":
        body["tools"] = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
            "a": DEEP}}}]
    elif where == "tool_choice":
        body["tool_choice"] = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "x": DEEP}]}
    elif where == "input":
        body["input"] = [{"role": "user", "content": [{"type": "input_text", "text": "hi", "x": DEEP}]}]
    elif where == "item":
        body["input"] = [{"type": "function_call_output", "call_id": "c", "output": DEEP}]
    elif where == "text":
        body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}
    else:
        body[draw(st.sampled_from(["metadata", "extra", "reasoning", "user"]))] = DEEP
    return depth


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        body = copy.deepcopy(draw(coherent_bodies()))  # sampled values are shared between examples
        for _ in range(draw(st.integers(0, 4)) // 2):  # 0 (often: the request is valid), 1 or 2 breakages
            mutate(draw, body)
    else:
        body = draw(BODIES)
    for key in draw(st.lists(st.sampled_from(sorted(set(FIELDS) - set(_COMMON))), max_size=3, unique=True)):
        body[key] = draw(FIELDS[key])
    if body and rare(draw, 10):  # a required field missing
        body.pop(draw(st.sampled_from(sorted(body))))
    if rare(draw, 10):
        body[draw(st.sampled_from(["input", "instructions", "metadata", "tools"]))] = draw(HUGE_TEXT)
    depth = _deep_somewhere(draw, body) if rare(draw, 6) else 0
    if rare(draw, 20):
        body[draw(st.sampled_from(["input", "instructions", "model", "metadata"]))] = draw(LONE_SURROGATES)
    how = draw(st.integers(0, 40)) - 18
    # json.dumps escapes lone surrogates (\\udc80) and keeps big ints exact; orjson refuses both.
    text = json.dumps(body, ensure_ascii=draw(st.booleans()) or _has_surrogate(body))
    if depth:
        text = text.replace(json.dumps(DEEP), nested_json(depth), 1)
    if how == 0:  # a raw mutation: invalid UTF-8, a truncated body, an escaped lone surrogate
        mutation = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b'"\\ud800"', b"\\u", b"1e400",
                                         b"NaN", b"]", b"\x00"]))
        raw = text.encode("utf-8", "surrogatepass")
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + mutation + raw[at:]
    if how == 1 and body:  # a duplicate key: the last one wins in orjson
        key = draw(st.sampled_from(sorted(body)))
        return (text[:-1] + ("," if len(text) > 2 else "") + json.dumps(key) + ":" +
                json.dumps(draw(JUNK)) + "}").encode("utf-8", "surrogatepass")
    if how == 2:  # not an object at all
        return json.dumps(draw(JUNK)).encode()
    if how == 3:  # an out-of-range number in a numeric field
        key = draw(st.sampled_from(["max_output_tokens", "temperature", "top_logprobs", "seed", "n"]))
        number = draw(st.sampled_from(["1e400", "-1e999", "123456789012345678901234567890", "-0", "1E-400"]))
        return (text[:-1] + ("," if len(text) > 2 else "") + f'"{key}":{number}}}').encode("utf-8",
                                                                                           "surrogatepass")
    return text.encode("utf-8", "surrogatepass")


def _has_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---------------------------------------------------------------------------------------------- the tests

@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(raw=raw_bodies())
def test_fuzzed_bodies_never_get_a_5xx(gateway: InProcessGateway, raw: bytes) -> None:
    check_answer(gateway.post(raw), raw)


@pytest.mark.parametrize("raw", [
    b"", b" ", b"null", b"[]", b'"x"', b"1", b"{", b"\xff", b'{"input": "\\ud800"}', b'{"input": "\xed\xa0\x80"}',
    b'{"model": "a", "model": 1}', b'{"max_output_tokens": 1e400}', b'{"max_output_tokens": 18446744073709551616}',
    b'{"input": "hi", "include": [1]}', b'{"input": "hi", "include": "x"}',
    b"[" * 5000 + b"]" * 5000, b'{"a":' * 2000 + b"1" + b"}" * 2000,
])
def test_fixed_bad_bodies(gateway: InProcessGateway, raw: bytes) -> None:
    check_answer(gateway.post(raw), raw)


LONG = "a" * 80  # longer than vLLM's 64: a namespaced name is then shortened (and hashed)

# Each was a 500 (the fuzz test found them): a 400 naming the place on every path.
FOUND_400 = [
    ({"input": "x", "include": [[1]]}, "include[0]"),
    ({"input": "x", "include": [{}]}, "include[0]"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": LONG, "input": "x", "namespace": {"a": 1}}]},
     "input[0].namespace"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": LONG, "arguments": "{}", "namespace": [1]}]},
     "input[0].namespace"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "mcp", "server_label": ["x"]}}, "tool_choice.server_label"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "server_label": {"a": 1}}]}},
     "tool_choice.tools[0].server_label"),
    ({"input": [{"type": "mcp_approval_response", "approval_request_id": ["x"], "approve": False}]},
     "input[0].approval_request_id"),
]
# The Responses path hands these to vLLM as they are (its 400); the chat path converts them: a 400 there.
FOUND_CHAT_400 = [
    ({"input": [{"type": "message", "role": "assistant", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": 5}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "summary": [], "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0]"),
]
FOUND_OK = [{"input": [{"type": "mcp_approval_request", "id": ["x"]}, {"role": "user", "content": "x"}]}]


@pytest.mark.parametrize(("body", "param"), FOUND_400 + FOUND_CHAT_400, ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("stream", [False, True])
def test_former_500s_are_400s_naming_the_param(gateway: InProcessGateway, body: dict[str, Any], param: str,
                                               stream: bool) -> None:
    raw = orjson.dumps({"model": "tiny", **body, "stream": stream})
    resp = gateway.post(raw)
    check_answer(resp, raw)
    if (body, param) in FOUND_CHAT_400 and gateway.upstream_api != "chat":
        return
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("body", FOUND_OK)
def test_former_500s_are_answered(gateway: InProcessGateway, body: dict[str, Any]) -> None:
    raw = orjson.dumps({"model": "tiny", **body})
    resp = gateway.post(raw)
    check_answer(resp, raw)
    assert resp.status_code == 200


def _schema(depth: int) -> dict[str, Any]:
    """A realistic JSON Schema (objects with properties) ``depth`` JSON levels deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema if depth % 2 else {"type": "object", "properties": {"a": schema}, "x": {}}


# (where, body with the deep value as DEEP, containers open around it): the depth of the whole body is the limit.
DEEP_PLACES = [
    ("tools", {"tools": [{"type": "function", "name": "f", "parameters": DEEP}],
               "tool_choice": {"type": "function", "name": "f"}}, 3),
    ("text", {"text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}}, 3),
    ("input", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "x": DEEP}]}]}, 5),
    ("tool_choice", {"tools": [{"type": "web_search"}], "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search", "x": DEEP}]}}, 4),
    ("extra", {"reasoning": {"effort": "low", "x": DEEP}}, 2),
]


@pytest.mark.parametrize(("where", "template", "opened"), DEEP_PLACES, ids=[p[0] for p in DEEP_PLACES])
@pytest.mark.parametrize("stream", [False, True])
def test_nesting_at_the_limit_goes_all_the_way_and_one_more_is_a_400(
        gateway: InProcessGateway, where: str, template: dict[str, Any], opened: int, stream: bool) -> None:
    from gateway.protocol.request import MAX_DEPTH

    for depth, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        deep = _schema(depth - opened) if where in ("tools", "text") else orjson.loads(nested_json(depth - opened))
        body = {"model": "tiny", "input": "hi", **template, "stream": stream}
        raw = orjson.dumps(body).replace(orjson.dumps(DEEP), orjson.dumps(deep))
        resp = gateway.post(raw)
        check_answer(resp, raw)
        if ok:
            assert resp.status_code == 200, resp.text
        else:
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "nesting_too_deep", resp.text


# Schemas and grammars that once crashed gateway/enforce (a 500, or a stream broken mid-way): now unchecked.
ENFORCE_CRASHES = [
    pytest.param({"type": "function", "name": "f", "parameters": {"$schema": 5}}, id="schema-$schema-int"),
    pytest.param({"type": "function", "name": "f", "parameters": {"$schema": ["x"]}}, id="schema-$schema-list"),
    pytest.param({"type": "function", "name": "f", "parameters": {"type": "object", "$ref": "#/nope"}},
                 id="schema-dangling-ref"),
    pytest.param({"type": "function", "name": "f", "parameters": {"$defs": {"x": {"$ref": "#/$defs/x"}},
                                                                  "$ref": "#/$defs/x"}}, id="schema-ref-loop"),
    pytest.param({"type": "function", "name": "f", "parameters": {"$ref": "#"}}, id="schema-ref-self"),
    pytest.param({"type": "custom", "name": "f", "format": {"type": "grammar", "syntax": "lark",
                                                            "definition": "start: /\\p{L}/"}}, id="lark-unicode-class"),
    pytest.param({"type": "custom", "name": "f", "format": {"type": "grammar", "syntax": "lark",
                                                            "definition": "%import nope.X\nstart: X"}},
                 id="lark-import-missing"),
]


@pytest.mark.parametrize("choice", ["named", "auto"])
@pytest.mark.parametrize("tool", ENFORCE_CRASHES)
def test_schemas_and_grammars_enforcement_cannot_use_are_never_a_500(tool: dict[str, Any], choice: str) -> None:
    if choice == "auto" and tool["type"] == "function":
        pytest.skip("only a pinned function call is checked against its schema")
    gw = InProcessGateway(upstream_api="responses", tool_choice_enforcement="constrain", log_level="error")
    try:
        tool_choice = {"type": tool["type"], "name": "f"} if choice == "named" else "auto"
        for stream in (False, True):
            for pad in ("", "x"):  # the fake upstream calls the tool for one of the two (see _call)
                raw = orjson.dumps({"model": "tiny", "input": "hi", "tools": [tool], "tool_choice": tool_choice,
                                    "stream": stream, "pad": pad})
                check_answer(gw.post(raw), raw)
    finally:
        gw.close()
