"""The context window (issue 20): counts through vLLM's ``/tokenize`` only when a request could reach the window,
``truncation: "disabled"`` answered with a 400 before vLLM is asked, ``"auto"`` dropping whole items (a call never
parted from its output, the instructions and developer messages kept), and ``POST /v1/responses/input_tokens``.

The upstream here is scripted (it records what it receives): ``/v1/models`` reports the window, ``/tokenize``
counts ``TOKENS_PER_MESSAGE`` per rendered message plus one per 8 bytes of their JSON (any monotone count would
do: that the gateway's counts equal vLLM's own is the live test's and the recorded cassette's job,
tests/test_context_live.py), and ``/v1/responses`` answers with the text cassette's recorded body."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.store import SqliteResponseStore
from gateway.translate.context_window import (
    droppable_groups,
    input_token_bound,
    request_token_bound,
    tokenize_request,
)
from gateway.upstream.replay import load_cassette
from tests.support import cassette, running_gateway

TOKENS_PER_MESSAGE = 20
TEXT_REPLY = load_cassette(cassette("text_nonstream")).interactions[0].body
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
TOOL = {"type": "function", "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def scripted_count(tokenize_body: dict[str, Any]) -> int:
    messages = tokenize_body.get("messages") or []
    return TOKENS_PER_MESSAGE * len(messages) + len(orjson.dumps(messages)) // 8 + 10 * len(
        tokenize_body.get("tools") or ())


class Upstream:
    """Answers like vLLM and keeps every request (method, path, JSON body)."""

    def __init__(self, window: int | None = 32768) -> None:
        self.window = window
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/v1/models":
            entry: dict[str, Any] = {"id": "tiny", "object": "model", "owned_by": "vllm"}
            if self.window is not None:
                entry["max_model_len"] = self.window
            return httpx.Response(200, json={"object": "list", "data": [entry]})
        if request.url.path == "/tokenize":
            n = scripted_count(body)
            return httpx.Response(200, json={"count": n, "max_model_len": self.window, "tokens": [1] * n,
                                             "token_strs": None})
        if request.url.path == "/v1/responses":
            return httpx.Response(200, content=TEXT_REPLY, headers={"content-type": "application/json"})
        return httpx.Response(404, json={"error": {"message": "no", "type": "NotFoundError", "code": 404}})

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.requests]

    def generations(self) -> list[dict[str, Any]]:
        return [b for _, p, b in self.requests if p == "/v1/responses"]


@pytest.fixture
def upstream() -> Upstream:
    return Upstream()


def gateway(up: Upstream, **kwargs: Any) -> Any:
    return running_gateway(transport=httpx.MockTransport(up), **kwargs)


def post(url: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=30)


# ---------------------------------------------------------------------------------------------- ordinary requests


def test_ordinary_small_requests_ask_nothing_about_the_context(upstream: Upstream) -> None:
    with gateway(upstream) as url:
        for body in ({"model": "tiny", "input": "Say hello."},
                     {"model": "tiny", "input": "Read it.", "tools": [TOOL], "instructions": "Be brief.",
                      "max_output_tokens": 64}):
            assert post(url, body).status_code == 200
    assert upstream.paths() == ["/v1/responses", "/v1/responses"]  # no /v1/models, no /tokenize


def test_a_request_that_could_reach_the_smallest_window_asks_the_window_once_and_counts_only_near_it(
        upstream: Upstream) -> None:
    medium = {"model": "tiny", "input": "x" * 6000}  # its bound passes 8192 tokens; far below 32768
    with gateway(upstream) as url:
        assert post(url, medium).status_code == 200
        assert post(url, medium).status_code == 200
    assert upstream.paths() == ["/v1/models", "/v1/responses", "/v1/responses"]  # window cached, never counted


def test_the_truncation_field_is_not_sent_to_vllm(upstream: Upstream) -> None:
    with gateway(upstream) as url:
        r = post(url, {"model": "tiny", "input": "hi", "truncation": "auto"})
    assert r.status_code == 200 and r.json()["truncation"] == "auto"
    assert "truncation" not in upstream.generations()[0]


def test_an_unknown_truncation_value_is_a_400(upstream: Upstream) -> None:
    with gateway(upstream) as url:
        r = post(url, {"model": "tiny", "input": "hi", "truncation": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation"
    assert upstream.generations() == []


def test_an_upstream_without_max_model_len_is_not_guarded(upstream: Upstream) -> None:
    upstream.window = None
    with gateway(upstream) as url:
        assert post(url, {"model": "tiny", "input": "x" * 50_000}).status_code == 200
        assert post(url, {"model": "tiny", "input": "y" * 50_000}).status_code == 200
    assert upstream.paths() == ["/v1/models", "/v1/responses", "/v1/responses"]


# ---------------------------------------------------------------------------------------------- disabled


def test_a_too_long_disabled_request_is_a_400_and_nothing_is_generated() -> None:
    up = Upstream(window=4096)
    with gateway(up) as url:
        r = post(url, {"model": "tiny", "input": "word " * 8000})
        r_out = post(url, {"model": "tiny", "input": "short " * 400, "max_output_tokens": 6000,
                           "truncation": "disabled"})
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="tiny", input="word " * 8000, stream=True)
    for resp in (r, r_out):
        assert resp.status_code == 400
        assert resp.json()["error"] == {**resp.json()["error"], "type": "invalid_request_error",
                                        "code": "context_length_exceeded", "param": "input"}
    assert exc.value.code == "context_length_exceeded"
    assert up.generations() == []  # vLLM was never asked to generate
    assert "/tokenize" in up.paths()


# ---------------------------------------------------------------------------------------------- auto


def _chain(turns: int) -> list[dict[str, Any]]:
    """A coding-agent history: each turn a user message, reasoning, a call, its output and an answer."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "developer", "content": "Repository rules."}]
    for t in range(turns):
        items += [
            {"type": "message", "role": "user", "content": f"Turn {t}: look at file {t}. " + "context " * 40},
            {"type": "reasoning", "id": f"rs_{t}", "summary": [], "content": [{"type": "reasoning_text",
                                                                                 "text": f"thinking {t}"}]},
            {"type": "function_call", "call_id": f"call_{t}", "name": "read_file",
             "arguments": json.dumps({"path": f"src/{t}.py"})},
            {"type": "function_call_output", "call_id": f"call_{t}", "output": "line\n" * 60},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Done {t}."}]},
        ]
    return items


def _check_whole(sent: list[dict[str, Any]]) -> None:
    calls = {i["call_id"] for i in sent if i.get("type") == "function_call"}
    outputs = {i["call_id"] for i in sent if i.get("type") == "function_call_output"}
    assert calls == outputs  # never a call without its output, or an output without its call
    for k, item in enumerate(sent):  # reasoning goes with the call it led to
        if item.get("type") == "reasoning":
            assert sent[k + 1].get("type") == "function_call"


def test_auto_drops_the_fewest_whole_items_keeping_calls_with_outputs_and_the_instructions() -> None:
    window, max_out = 6000, 500
    up = Upstream(window=window)
    items = [*_chain(30), {"type": "message", "role": "user", "content": "Now fix the bug."}]
    body = {"model": "tiny", "instructions": "You are a coding agent.", "input": items, "tools": [TOOL],
            "truncation": "auto", "max_output_tokens": max_out, "store": False}
    with gateway(up) as url:
        r = post(url, body)
    assert r.status_code == 200, r.text
    [sent_body] = up.generations()
    sent = sent_body["input"]
    assert sent_body["instructions"] == "You are a coding agent."
    assert sent[0] == {"type": "message", "role": "developer", "content": "Repository rules."}
    assert sent[-1]["content"] == "Now fix the bug."
    assert len(sent) < len(items)
    _check_whole(sent)
    # What was sent fits; keeping the newest dropped turn as well would not have (the fewest were dropped).
    assert scripted_count(tokenize_request(sent_body)) + max_out <= window
    start = items.index(sent[1])  # the oldest item kept after the developer message
    newest_gone = items[start - 3:start] if items[start - 1]["type"] == "function_call_output" else [items[start - 1]]
    one_more = {**sent_body, "input": [items[0], *newest_gone, *items[start:]]}
    assert scripted_count(tokenize_request(one_more)) + max_out > window
    # The search is bounded: one count of the whole, then a binary search over the 90 droppable groups.
    assert up.paths().count("/tokenize") <= 1 + 1 + math.ceil(math.log2(90))


def test_auto_cuts_a_stored_chain_and_the_newest_input_stays(tmp_path: Path) -> None:
    up = Upstream(window=4096)
    store = SqliteResponseStore(tmp_path / "r.db")
    with gateway(up, store=store) as url:
        prev = None
        for t in range(80):
            body: dict[str, Any] = {"model": "tiny", "input": _chain(1)[1:] if t else _chain(1),
                                    "instructions": "Agent.", "tools": [TOOL]}
            if prev:
                body["previous_response_id"] = prev
            r = post(url, body)
            if r.status_code == 400:
                assert r.json()["error"]["code"] == "context_length_exceeded"  # disabled: the chain outgrew it
                break
            prev = r.json()["id"]
        else:
            pytest.fail("the chain never outgrew the window")
        r = post(url, {**body, "truncation": "auto", "input": "And now?"})
    assert r.status_code == 200, r.text
    sent = up.generations()[-1]["input"]
    assert sent[0]["role"] == "developer" and sent[-1] == {"type": "message", "role": "user", "content": "And now?"}
    _check_whole(sent)


def test_a_window_below_the_smallest_guarded_one_is_learned_and_guards_auto_and_later_requests() -> None:
    """A small window (here 400 tokens) below SMALLEST_WINDOW: truncation "auto" asks for it even for a request
    whose bound is below 8192, and once known it guards "disabled" requests of that size too."""
    up = Upstream(window=400)
    items = [*_chain(1), {"type": "message", "role": "user", "content": "Now fix the bug."}]
    body = {"model": "tiny", "instructions": "You are a coding agent.", "input": items, "truncation": "auto",
            "max_output_tokens": 150, "store": False}
    assert request_token_bound(body, []) < 8192
    with gateway(up) as url:
        r = post(url, body)
        assert r.status_code == 200, r.text
        [sent_body] = up.generations()
        assert len(sent_body["input"]) < len(items) and sent_body["input"][-1]["content"] == "Now fix the bug."
        assert scripted_count(tokenize_request(sent_body)) + 150 <= 400
        _check_whole(sent_body["input"])
        r = post(url, {**body, "truncation": "disabled"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert up.paths().count("/v1/models") == 1 and len(up.generations()) == 1


def test_auto_with_nothing_left_to_drop_is_still_a_400() -> None:
    up = Upstream(window=4096)
    with gateway(up) as url:
        r = post(url, {"model": "tiny", "input": [{"role": "developer", "content": "rules " * 8000},
                                                   {"role": "user", "content": "hi"}], "truncation": "auto"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert up.generations() == []


# ---------------------------------------------------------------------------------------------- input_tokens


def test_input_tokens_counts_through_tokenize_with_tools_and_instructions(upstream: Upstream) -> None:
    items = _chain(2)
    with gateway(upstream) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        counted = client.responses.input_tokens.count(model="tiny", input=items, tools=[TOOL],  # type: ignore[list-item]
                                                      instructions="Be brief.")
    assert counted.object == "response.input_tokens"
    [(_, _, tok)] = [r for r in upstream.requests if r[1] == "/tokenize"]
    assert tok["messages"][0] == {"role": "system", "content": "Be brief."}
    assert tok["tools"][0]["function"]["name"] == "read_file"
    assert counted.input_tokens == scripted_count(tok)
    assert upstream.generations() == []


def test_input_tokens_loads_only_the_callers_own_history(tmp_path: Path, upstream: Upstream) -> None:
    store = SqliteResponseStore(tmp_path / "r.db")
    with gateway(upstream, store=store, api_keys=(KEY_A, KEY_B)) as url:
        rid = post(url, {"model": "tiny", "input": "remember this"}, KEY_A).json()["id"]
        a = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        b = openai.OpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0)
        alone = a.responses.input_tokens.count(model="tiny", input="and this")
        chained = a.responses.input_tokens.count(model="tiny", input="and this", previous_response_id=rid)
        with pytest.raises(openai.NotFoundError) as exc:
            b.responses.input_tokens.count(model="tiny", input="and this", previous_response_id=rid)
        unauthenticated = httpx.post(url + "/v1/responses/input_tokens", json={"input": "x"}, timeout=30)
    assert chained.input_tokens > alone.input_tokens
    assert exc.value.status_code == 404 and exc.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert unauthenticated.status_code == 401


def test_input_tokens_rejects_bad_bodies_in_openais_shape(upstream: Upstream) -> None:
    with gateway(upstream) as url:
        bad = httpx.post(url + "/v1/responses/input_tokens", content=b"[1]", timeout=30)
        wrong = httpx.post(url + "/v1/responses/input_tokens", json={"input": 5}, timeout=30)
    for r in (bad, wrong):
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "/tokenize" not in upstream.paths()


# ---------------------------------------------------------------------------------------------- properties

_ITEM = st.one_of(
    st.builds(lambda r, t: {"type": "message", "role": r, "content": t},
              st.sampled_from(["user", "assistant", "developer", "system"]), st.text(max_size=20)),
    st.builds(lambda c: {"type": "function_call", "call_id": f"c{c}", "name": "f", "arguments": "{}"},
              st.integers(0, 5)),
    st.builds(lambda c: {"type": "function_call_output", "call_id": f"c{c}", "output": "o"}, st.integers(0, 5)),
    st.builds(lambda c: {"type": "custom_tool_call", "call_id": f"c{c}", "name": "p", "input": "i"},
              st.integers(0, 5)),
    st.just({"type": "reasoning", "summary": []}),
    st.builds(lambda c: {"type": "mcp_approval_request", "id": f"a{c}"}, st.integers(0, 3)),
    st.builds(lambda c: {"type": "mcp_approval_response", "approval_request_id": f"a{c}", "approve": True},
              st.integers(0, 3)),
    st.just({"type": "mcp_list_tools", "server_label": "s", "tools": []}),
)


def _call_id(item: dict[str, Any]) -> Any:
    return item.get("call_id")


def _approval_id(item: dict[str, Any]) -> Any:
    return item.get("id") if item["type"] == "mcp_approval_request" else item.get("approval_request_id")


@settings(max_examples=150, deadline=None)
@given(st.lists(_ITEM, max_size=25))
def test_dropping_any_prefix_of_the_groups_never_splits_a_pair_nor_drops_the_frame(items: list[dict[str, Any]]
                                                                                 ) -> None:
    groups = droppable_groups(items)
    flat = [i for g in groups for i in g]
    assert len(flat) == len(set(flat))
    for k in range(len(groups) + 1):
        gone = {i for g in groups[:k] for i in g}
        kept = [it for i, it in enumerate(items) if i not in gone]
        for i in gone:
            item = items[i]
            assert item.get("role") not in ("system", "developer") and item["type"] != "mcp_list_tools"
        if items and any(it.get("role") not in ("system", "developer") and it["type"] != "mcp_list_tools"
                         for it in items):
            last = max(i for i, it in enumerate(items)
                       if it.get("role") not in ("system", "developer") and it["type"] != "mcp_list_tools")
            assert last not in gone
        for ident in (_call_id, _approval_id):
            ids_gone = {ident(items[i]) for i in gone} - {None}
            assert not ids_gone & {ident(it) for it in kept}  # a pair is dropped whole


@settings(max_examples=100, deadline=None)
@given(st.lists(_ITEM, max_size=25), st.text(max_size=200))
def test_the_byte_bound_is_above_the_scripted_rendering_and_grows_with_the_input(items: list[dict[str, Any]],
                                                                                 extra: str) -> None:
    body = {"model": "tiny", "input": items, "instructions": extra}
    assert input_token_bound(body) >= len(orjson.dumps(tokenize_request(body)["messages"]))
    longer = {**body, "input": [*items, {"type": "message", "role": "user", "content": extra + "x"}]}
    assert input_token_bound(longer) > input_token_bound(body)


def test_the_meters_caches_are_bounded() -> None:
    import asyncio

    from gateway.config import Settings
    from gateway.engine.context import ContextMeter
    from gateway.upstream.client import UpstreamClient

    up = Upstream()

    async def run() -> ContextMeter:
        client = UpstreamClient(Settings(upstream_url="http://upstream.test"), transport=httpx.MockTransport(up))
        meter = ContextMeter(client, max_models=2, max_counts=3)
        for m in ("a", "b", "c", "tiny"):
            await meter.window(m, {})
        for k in range(10):
            assert await meter.count({"input": f"text {k}"}, {}) > 0
        assert await meter.count({"input": "text 9"}, {}) > 0  # cached: no new /tokenize
        await client.aclose()
        return meter

    meter = asyncio.run(run())
    assert len(meter._windows) == 2 and len(meter._counts) == 3
    assert up.paths().count("/tokenize") == 10


_TOOLS = st.lists(st.one_of(
    st.builds(lambda n, d: {"type": "function", "name": f"f{n}", "description": d,
                            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}},
              st.integers(0, 3), st.text(max_size=30)),
    st.builds(lambda n, g: {"type": "custom", "name": f"c{n}",
                            "format": {"type": "grammar", "syntax": "lark", "definition": g}},
              st.integers(0, 3), st.text(max_size=60)),
    st.builds(lambda n: {"type": "custom", "name": f"p{n}"}, st.integers(0, 3))), max_size=4,
    unique_by=lambda t: t["name"])
_CALLS = st.lists(st.one_of(
    st.builds(lambda c, i: {"type": "custom_tool_call", "call_id": f"c{c}", "name": "p0", "input": i},
              st.integers(0, 5), st.text(max_size=80)),
    st.builds(lambda c: {"type": "function_call", "call_id": f"c{c}", "name": "f0", "arguments": "{\"a\": \"\\n\"}"},
              st.integers(0, 5)),
    st.builds(lambda c, o: {"type": "custom_tool_call_output", "call_id": f"c{c}", "output": o},
              st.integers(0, 5), st.text(max_size=40)),
    st.builds(lambda t: {"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]},
              st.text(max_size=40)),
    st.just({"type": "reasoning", "summary": [], "encrypted_content": None})), max_size=12)


@settings(max_examples=100, deadline=None)
@given(_TOOLS, _CALLS, _CALLS, st.one_of(st.none(), st.text(max_size=40)))
def test_the_request_bound_covers_the_upstream_body_on_both_apis(tools: list[dict[str, Any]],
                                                                 history: list[dict[str, Any]],
                                                                 new: list[dict[str, Any]], text: str | None) -> None:
    """The shortcut that skips building the upstream body for small requests never under-estimates it."""
    from gateway.translate.chat import build_chat_request
    from gateway.translate.rewrite import build_upstream_request
    from gateway.translate.tool_context import resolve_tool_context

    body: dict[str, Any] = {"model": "tiny", "input": text if text is not None else new, "tools": tools,
                            "instructions": "Be brief."}
    ctx = resolve_tool_context(body)
    quick = request_token_bound(body, history)
    assert quick >= input_token_bound(build_upstream_request(body, ctx, history))
    assert quick >= input_token_bound(build_chat_request(body, ctx, history))
