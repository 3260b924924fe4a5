"""Grammar custom tools under ``auto`` + ``constrain`` enforced by the upstream request itself (issue 18).

Two halves: the pure decision (gateway.enforce.onerequest: which route, and the exact body it sends), and the
engine against a fake vLLM (httpx.MockTransport) whose ``/v1/responses`` stream is SYNTHESIZED in vLLM 0.32's
framing (tests/vllm_frames.py) and whose chat stream is hand-written in vLLM's chunk framing: one upstream request
per response, the route in the metrics, a cut call closed ``incomplete``, the fallbacks. The conversions are
stubbed where only their use matters (the converter's own tests are tests/test_grammar_convert*.py); the live
tests (tests/test_live_grammar_onerequest.py) use the real ones against the real tiny vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import lark
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from gateway.config import Settings
from gateway.enforce.onerequest import GrammarRoutes, grammar_routes
from gateway.engine.grammar_routes import mark_cut_calls
from gateway.protocol.events import UpstreamEvent
from gateway.translate import grammar_convert
from gateway.translate.grammar_convert import GrammarConversionError
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo, resolve_tool_context
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events
from tests.test_ops_metrics import scrape, value
from tests.test_upstream_pool import LoopbackUpstream, _Conn, loopback_upstream
from tests.vllm_frames import VllmStream, args_deltas

GRAMMAR = 'start: "*** Begin Patch\\n" LINE* "*** End Patch"\nLINE: /[+ -][^\\n]*\\n/\n'
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
ZIP = {"type": "custom", "name": "zip_code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{5}"}}
NOTES = {"type": "custom", "name": "notes", "description": "Free text."}
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
VALID = "*** Begin Patch\n+hello\n*** End Patch"


def fake_ebnf(syntax: str, definition: str, escaped: bool) -> str:
    return f"root ::= {'ESCAPED' if escaped else 'RAW'}:{syntax}"


def fake_regex(syntax: str, definition: str) -> str:
    if syntax == "lark":
        return r"\*\*\* Begin Patch\n([+ -][^\n]*\n)*\*\*\* End Patch"
    return definition


def no_regex(syntax: str, definition: str) -> str:
    raise GrammarConversionError("not regular")


def routes(tools: list[dict[str, Any]], parser: str, *, mode: str = "constrain", capable: bool = True,
           to_regex: Callable[[str, str], str] = fake_regex, failures: list[tuple[str, str]] | None = None,
           **body: Any) -> tuple[GrammarRoutes, ResolvedToolContext]:
    req = {"model": "tiny", "input": "hi", "tools": tools, **body}
    ctx = resolve_tool_context(req)

    def fail(info: ToolInfo, form: str) -> None:
        if failures is not None:
            failures.append((info.upstream_name, form))

    return grammar_routes(ctx, req, mode=mode, parser=parser, capable=capable, to_ebnf=fake_ebnf,
                          to_regex=to_regex, on_failure=fail), ctx


# ---------------------------------------------------------------- the decision and the body it sends (pure)


def test_hermes_builds_one_structural_tag_for_every_tool_and_sends_them_non_strict() -> None:
    r, _ = routes([PATCH, WEATHER, NOTES], "hermes")
    assert r.routes == {"apply_patch": "structural_tag"} and r.used == ("structural_tag",)
    up = {"tools": [{"type": "function", "name": "apply_patch", "parameters": {}, "strict": True},
                    {**WEATHER}, {"type": "function", "name": "notes", "parameters": {}, "strict": True}]}
    r.apply(up)
    assert all(t["strict"] is False for t in up["tools"])  # vLLM would OR in its own strict-tool tag otherwise
    tag = json.loads(up["structured_outputs"]["structural_tag"])
    fmt = tag["format"]
    assert tag["type"] == "structural_tag" and fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    by_begin = {t["begin"]: t for t in fmt["tags"]}
    patch = by_begin['<tool_call>\n{"name": "apply_patch", "arguments": {"input": "']
    assert patch["content"] == {"type": "grammar", "grammar": "root ::= ESCAPED:lark"}  # JSON-escaped for hermes
    assert patch["end"] == '"}}\n</tool_call>'
    assert '<tool_call>{"name": "apply_patch", "arguments": {"input": "' in by_begin  # the compact layout too
    weather = by_begin['<tool_call>\n{"name": "get_weather", "arguments": ']
    assert weather["content"] == {"type": "json_schema", "json_schema": WEATHER["parameters"]}
    notes = by_begin['<tool_call>\n{"name": "notes", "arguments": ']
    assert notes["content"]["json_schema"]["properties"]["input"] == {"type": "string", "description": notes[
        "content"]["json_schema"]["properties"]["input"]["description"]}
    assert fmt["stop_after_first"] is False


def test_qwen3_coder_carries_the_raw_grammar_in_its_xml_parameter() -> None:
    r, _ = routes([PATCH, WEATHER], "qwen3_coder", parallel_tool_calls=False)
    up: dict[str, Any] = {"tools": [{"type": "function", "function": {"name": "apply_patch", "strict": True}},
                                    {"type": "function", "function": {"name": "get_weather", "strict": True}}]}
    r.apply(up)  # the chat shape: nested under "function"
    assert [t["function"]["strict"] for t in up["tools"]] == [False, False]
    fmt = json.loads(up["structured_outputs"]["structural_tag"])["format"]
    assert fmt["triggers"] == ["<tool_call>\n<function="] and fmt["stop_after_first"] is True
    [patch, weather] = fmt["tags"]
    assert patch == {"type": "tag", "begin": "<tool_call>\n<function=apply_patch>\n<parameter=input>\n",
                     "content": {"type": "grammar", "grammar": "root ::= RAW:lark"},
                     "end": "\n</parameter>\n</function>\n</tool_call>"}
    assert weather["content"]["style"] == "qwen_xml" and weather["end"] == "\n</function>\n</tool_call>"


def test_auto_parser_uses_vllms_strict_tool_pattern_where_the_grammar_is_regular() -> None:
    r, _ = routes([PATCH, ZIP, WEATHER], "auto")
    assert r.routes == {"apply_patch": "strict_pattern", "zip_code": "strict_pattern"}
    up = {"tools": [{"type": "function", "name": "apply_patch", "parameters": {}, "strict": True},
                    {"type": "function", "name": "zip_code", "parameters": {}, "strict": True}, {**WEATHER}]}
    r.apply(up)
    assert "structured_outputs" not in up
    patch, zipc, weather = up["tools"]
    assert patch["strict"] is True and patch["parameters"]["properties"]["input"]["pattern"] == fake_regex("lark", "")
    assert patch["parameters"]["required"] == ["input"] and patch["parameters"]["additionalProperties"] is False
    assert zipc["parameters"]["properties"]["input"]["pattern"] == "[0-9]{5}"
    assert weather == WEATHER


def test_a_grammar_that_does_not_convert_keeps_the_takeover_and_is_reported() -> None:
    failures: list[tuple[str, str]] = []
    r, _ = routes([PATCH, ZIP], "auto", to_regex=lambda s, d: no_regex(s, d) if s == "lark" else d,
                  failures=failures)
    assert r.routes == {"apply_patch": "takeover", "zip_code": "strict_pattern"}
    assert r.takeover == {"apply_patch"} and r.one_request == {"zip_code"}
    assert failures == [("apply_patch", "regex")] and set(r.used) == {"strict_pattern", "takeover"}

    def no_ebnf(syntax: str, definition: str, escaped: bool) -> str:
        raise GrammarConversionError("no")

    req = {"model": "tiny", "input": "hi", "tools": [PATCH]}
    ctx = resolve_tool_context(req)
    r = grammar_routes(ctx, req, mode="constrain", parser="hermes", capable=True, to_ebnf=no_ebnf,
                       to_regex=fake_regex, on_failure=lambda info, form: failures.append((info.name, form)))
    assert r.routes == {"apply_patch": "takeover"} and failures[-1] == ("apply_patch", "ebnf")
    # Its call can still open (under its plain {"input": string} schema) so that the takeover catches it.
    [first, _compact] = json.loads(orjson.dumps(r.structural_tag))["format"]["tags"]
    assert first["content"]["type"] == "json_schema"


@pytest.mark.parametrize(("kwargs", "route"), [
    ({"capable": False}, "takeover"),
    ({"mode": "validate"}, "validate"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}, "takeover"),
    ({"structured_outputs": {"regex": "a+"}}, "takeover"),
])
def test_what_keeps_the_old_routes(kwargs: dict[str, Any], route: str) -> None:
    for parser in ("auto", "hermes"):
        r, _ = routes([PATCH], parser, **kwargs)
        assert r.routes == {"apply_patch": route} and not r.changes_body


def test_no_grammar_tool_no_route() -> None:
    r, _ = routes([WEATHER, NOTES], "hermes")
    assert r.routes == {} and not r.changes_body and r.used == ()


# ---------------------------------------------------------------- the engine against a fake vLLM


def grammar_stream(value: str, *, status: str = "completed", pieces: int = 12) -> bytes:
    stream = VllmStream().start()
    stream.message("msg_00000000000000b1", ["Patching ", "now."])
    stream.call("fc_00000000000000a1", "chatcmpl-tool-00000000000000a1", "apply_patch",
                args_deltas({"input": value}, pieces=pieces) if status == "completed" else
                args_deltas({"input": value}, pieces=pieces)[:-1])
    return stream.complete(status).body()


def chat_stream(value: str) -> bytes:
    """vLLM 0.32's hermes chat framing for one call (hand-written): name first, then argument pieces."""
    args = json.dumps({"input": value})
    pieces = [args[i:i + 6] for i in range(0, len(args), 6)]
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1",
                                                                           "type": "function", "function": {
                                                                               "name": "apply_patch",
                                                                               "arguments": ""}}]},
                                    "finish_reason": None}]}]
    chunks += [{**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]},
                                     "finish_reason": None}]} for p in pieces]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class FakeVllm:
    def __init__(self, version: str | None = "0.32.0", value: str = VALID, status: str = "completed",
                 chat_status: int = 200) -> None:
        self.version, self.value, self.status, self.chat_status = version, value, status, chat_status
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/version":
            if self.version is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"version": self.version})
        sse = {"content-type": "text/event-stream"}
        if request.url.path == "/v1/responses":
            stream = grammar_stream(self.value, status=self.status)
            if not body.get("stream"):  # the terminal event's response is the non-streamed body
                last = [f for f in stream.split(b"\n\n") if f.strip()][-1]
                data = orjson.loads(last.split(b"data: ", 1)[1])
                return httpx.Response(200, json=data["response"])
            return httpx.Response(200, headers=sse, content=stream)
        if request.url.path == "/v1/chat/completions":
            if self.chat_status != 200:
                return httpx.Response(self.chat_status, json={"error": {"message": "no", "type": "x", "code": 1}})
            return httpx.Response(200, headers=sse, content=chat_stream(self.value))
        return httpx.Response(404)

    @property
    def generation_requests(self) -> list[tuple[str, str, Any]]:
        return [r for r in self.requests if r[0] == "POST"]


@pytest.fixture
def stub_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_convert, "to_json_pattern", fake_regex)
    monkeypatch.setattr(grammar_convert, "to_ebnf", lambda s, d, *, json_escaped: fake_ebnf(s, d, json_escaped))


def request(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "Add a file.", "tools": [PATCH, WEATHER], "stream": True, **body}


def post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=request(**body), timeout=30)


def gateway(fake: FakeVllm, **settings: Any) -> Iterator[str]:
    return running_gateway(transport=httpx.MockTransport(fake), tool_choice_enforcement="constrain",
                           **settings)


@pytest.mark.usefixtures("stub_conversion")
@pytest.mark.parametrize(("api", "parser", "route"), [
    ("responses", "auto", "strict_pattern"), ("responses", "hermes", "structural_tag"),
    ("chat", "auto", "strict_pattern"), ("chat", "hermes", "structural_tag")])
def test_one_upstream_request_streamed_live_and_counted(api: str, parser: str, route: str) -> None:
    fake = FakeVllm()
    with gateway(fake, upstream_api=api, tool_call_parser=parser) as url:
        r1 = post(url)
        r2 = post(url)
        metrics = scrape(httpx.get(url + "/metrics").text)
    for r in (r1, r2):
        events = sse_events(r.content)
        summary = check_stream(events, request())
        final = summary["response"]
        assert final["status"] == "completed"
        [call] = [i for i in final["output"] if i["type"] == "custom_tool_call"]
        assert call["input"] == VALID and call["status"] == "completed" and call["id"].startswith("ctc_")
        deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
        assert len(deltas) > 3 and all(d["item_id"] == call["id"] for d in deltas)
    posts = fake.generation_requests
    assert [p[1] for p in posts] == ["/v1/" + ("chat/completions" if api == "chat" else "responses")] * 2
    assert [r[1] for r in fake.requests].count("/version") == 1  # asked once, cached
    body = posts[0][2]
    tools = {(t.get("function") or t)["name"]: (t.get("function") or t) for t in body["tools"]}
    if route == "strict_pattern":
        assert "structured_outputs" not in body and tools["apply_patch"]["strict"] is True
        assert tools["apply_patch"]["parameters"]["properties"]["input"]["pattern"] == fake_regex("lark", "")
    else:
        assert all(t["strict"] is False for t in tools.values())
        assert "<tool_call>" in json.loads(body["structured_outputs"]["structural_tag"])["format"]["triggers"]
    assert value(metrics, "responses_gateway_grammar_enforcement_total", route=route) == 2
    assert value(metrics, "responses_gateway_tool_choice_enforcement_total", outcome="constrained") == 2


@pytest.mark.usefixtures("stub_conversion")
def test_a_call_cut_by_max_output_tokens_ends_incomplete() -> None:
    fake = FakeVllm(value=VALID[:20], status="incomplete")
    with gateway(fake) as url:
        r = post(url, max_output_tokens=16)
        rn = post(url, max_output_tokens=16, stream=False)
        metrics = scrape(httpx.get(url + "/metrics").text)
    final = check_stream(sse_events(r.content), request(max_output_tokens=16))["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    [call] = [i for i in final["output"] if i["type"] == "custom_tool_call"]
    assert call["status"] == "incomplete"
    done = [e for e in sse_events(r.content) if e["type"] == "response.output_item.done"
            and e["item"]["type"] == "custom_tool_call"]
    assert [d["item"]["status"] for d in done] in ([], ["incomplete"])
    assert len(fake.generation_requests) == 2  # one each: never regenerated nor taken over
    assert value(metrics, "responses_gateway_tool_choice_enforcement_total", outcome="violated") == 2
    assert rn.status_code == 200, rn.text
    body = rn.json()
    [call] = [i for i in body["output"] if i["type"] == "custom_tool_call"]
    assert call["status"] == "incomplete" and body["status"] == "incomplete"


@pytest.mark.usefixtures("stub_conversion")
@pytest.mark.parametrize("version", ["0.31.2", None])
def test_an_upstream_that_cannot_keeps_the_takeover_and_the_metric_says_so(version: str | None) -> None:
    fake = FakeVllm(version=version, value="not a patch", chat_status=404)  # no chat endpoint: validate after all
    with gateway(fake) as url:
        r = post(url)
        metrics = scrape(httpx.get(url + "/metrics").text)
    final = check_stream(sse_events(r.content), request())["response"]
    assert final["status"] == "completed"
    body = fake.generation_requests[0][2]
    assert "structured_outputs" not in body
    assert "pattern" not in json.dumps(body["tools"])
    assert value(metrics, "responses_gateway_grammar_enforcement_total", route="takeover") == 1
    assert value(metrics, "responses_gateway_tool_choice_enforcement_total", outcome="fallback_validate") == 1
    assert [p[1] for p in fake.generation_requests] == ["/v1/responses", "/v1/chat/completions"]


def test_validate_mode_is_counted_as_validate() -> None:
    fake = FakeVllm()
    with running_gateway(transport=httpx.MockTransport(fake), tool_choice_enforcement="validate") as url:
        post(url)
        metrics = scrape(httpx.get(url + "/metrics").text)
    assert value(metrics, "responses_gateway_grammar_enforcement_total", route="validate") == 1
    assert "/version" not in [r[1] for r in fake.requests]


def test_conversion_failure_is_reported_once_per_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_convert, "to_json_pattern", no_regex)
    secret = 'start: "hunter2-" /[a-z]+/\n'
    tool = {**PATCH, "name": "secret_tool", "format": {**PATCH["format"], "definition": secret}}
    fake = FakeVllm(value="hunter2-abc", chat_status=404)
    with capture_logs() as logs, gateway(fake) as url:
        post(url, tools=[tool])
        post(url, tools=[tool])
        metrics = scrape(httpx.get(url + "/metrics").text)
    warned = [e for e in logs if e["event"] == "grammar_conversion_failed"]
    assert len(warned) == 1 and warned[0]["form"] == "regex" and warned[0]["tool"] == "secret_tool"
    assert "hunter2" not in repr(logs)
    assert value(metrics, "responses_gateway_grammar_conversion_failures_total", form="regex") == 1
    assert value(metrics, "responses_gateway_grammar_enforcement_total", route="takeover") == 2


@pytest.mark.usefixtures("stub_conversion")
def test_the_upstream_is_asked_again_after_a_transport_failure() -> None:
    fake = FakeVllm()
    broken = {"on": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if broken["on"] and request.url.path == "/v1/responses":
            broken["on"] = False
            raise httpx.ConnectError("refused")
        return fake(request)

    with running_gateway(transport=httpx.MockTransport(handler), tool_choice_enforcement="constrain") as url:
        post(url)
        broken["on"] = True
        assert post(url).status_code >= 500  # the upstream went away
        fake.version = "0.31.0"  # ... and came back as another server
        post(url)
    assert [r[1] for r in fake.requests].count("/version") == 2
    last = [r for r in fake.generation_requests if r[1] == "/v1/responses"][-1][2]
    assert "pattern" not in json.dumps(last["tools"])  # the old server gets the takeover route
    assert fake.generation_requests[-1][1] == "/v1/chat/completions"  # ... whose step takes the call over


# ---------------------------------------------------------------- connections come back


class GrammarLoopback(LoopbackUpstream):
    """The counting loopback server of tests/test_upstream_pool.py, answering as vLLM 0.32 does: ``GET /version``,
    and a streamed ``/v1/responses`` whose answer is one grammar call (its terminator in a write of its own)."""

    def __post_init__(self) -> None:
        self.frames = [f + b"\n\n" for f in grammar_stream(VALID).split(b"\n\n") if f.strip()]
        self.sent: list[dict[str, Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(opened=time.monotonic())
        with self.lock:
            self.conns.append(conn)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, val = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(val)
                body = orjson.loads(await reader.readexactly(length)) if length else {}
                conn.requests += 1
                if head.startswith(b"GET /version"):
                    v = b'{"version":"0.32.0"}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(v), v))
                    await writer.drain()
                    continue
                self.sent.append(body)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for frame in self.frames:
                    writer.write(b"%x\r\n%b\r\n" % (len(frame), frame))
                await writer.drain()
                await asyncio.sleep(0.001)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            conn.closed = time.monotonic()
            with contextlib.suppress(Exception):
                writer.close()


@pytest.mark.usefixtures("stub_conversion")
def test_300_sequential_grammar_tool_responses_reuse_a_handful_of_connections() -> None:
    upstream = GrammarLoopback()
    with loopback_upstream(upstream) as up, running_gateway(
            Settings(upstream_url=up, store="none", tool_choice_enforcement="constrain")) as url, \
            httpx.Client(timeout=10) as http:
        for _ in range(300):
            r = http.post(url + "/v1/responses", json={"model": "tiny", "input": "Add a file.", "tools": [PATCH],
                                                       "stream": True})
            final = sse_events(r.content)[-1]
            assert final["type"] == "response.completed"
            assert final["response"]["output"][-1]["input"] == VALID
    assert len(upstream.sent) == 300  # one generation request per response
    assert all("pattern" in json.dumps(b["tools"]) for b in upstream.sent)
    print(f"\n{upstream.accepted} upstream connection(s) for 300 sequential grammar-tool responses")
    assert upstream.accepted <= 8, f"{upstream.accepted} upstream connections for 300 sequential responses"


# ---------------------------------------------------------------- the end-of-call check (Hypothesis)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["+hello\n", " ctx\n", "-gone\n", "+\n"]), max_size=5), st.data())
def test_a_call_is_closed_incomplete_exactly_when_its_input_fails_the_grammar(lines: list[str],
                                                                              data: st.DataObject) -> None:
    """Whatever the cut point of a (valid) patch, the call's done item is left as it is when the input so far
    parses under the grammar and turned ``incomplete`` when it does not; every call is checked once."""
    full = "*** Begin Patch\n" + "".join(lines) + "*** End Patch"
    cut = data.draw(st.integers(0, len(full)))
    value = full[:cut]
    ctx = resolve_tool_context({"tools": [PATCH, WEATHER]})
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "apply_patch",
            "arguments": json.dumps({"input": value}), "status": "completed"}
    done = UpstreamEvent("response.output_item.done", json.dumps({"type": "response.output_item.done",
                                                                  "item": item, "output_index": 0}))
    other = UpstreamEvent("response.output_item.done", json.dumps({
        "type": "response.output_item.done", "output_index": 1,
        "item": {**item, "id": "fc_2", "name": "get_weather", "arguments": "{}"}}))
    notes: list[str] = []
    checked: set[str] = set()

    async def batches() -> AsyncIterator[list[UpstreamEvent]]:
        yield [done, other]

    async def run() -> list[list[UpstreamEvent]]:
        return [b async for b in mark_cut_calls(batches(), ctx, frozenset({"apply_patch"}), checked,
                                                lambda step, outcome, **kw: notes.append(outcome))]

    [[first, second]] = asyncio.run(run())
    valid = lark.Lark(GRAMMAR, parser="earley")
    try:
        valid.parse(value)
        ok = True
    except lark.exceptions.LarkError:
        ok = False
    assert first.json()["item"]["status"] == ("completed" if ok else "incomplete")
    assert second is other  # another tool's call passes untouched
    assert notes == ["constrained" if ok else "violated"] and checked == {"ctc_1"}


@pytest.mark.usefixtures("stub_conversion")
@pytest.mark.parametrize("stream", [True, False])
def test_an_upstream_refusing_the_constraint_gets_the_request_without_it(stream: bool) -> None:
    """A 400 to the changed body (a pattern or schema the structured-output backend does not take): sent again as
    before issue 18, and the takeover enforces the call; a client's own bad request still gets its 400."""
    fake = FakeVllm(chat_status=404)

    def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        if request.url.path == "/v1/responses" and "pattern" in json.dumps(body.get("tools")):
            fake.requests.append((request.method, request.url.path, body))
            return httpx.Response(400, json={"error": {"message": "bad pattern", "type": "BadRequestError",
                                                       "param": None, "code": 400}})
        return fake(request)

    with capture_logs() as logs, running_gateway(transport=httpx.MockTransport(handler),
                                                 tool_choice_enforcement="constrain") as url:
        r = post(url, stream=stream)
        metrics = scrape(httpx.get(url + "/metrics").text)
    assert r.status_code == 200, r.text
    final = check_stream(sse_events(r.content), request())["response"] if stream else r.json()
    assert final["status"] == "completed"
    sent = [p for p in fake.generation_requests if p[1] == "/v1/responses"]
    assert len(sent) == 2 and "pattern" not in json.dumps(sent[1][2]["tools"])
    assert value(metrics, "responses_gateway_grammar_enforcement_total", route="takeover") == 1
    assert value(metrics, "responses_gateway_grammar_enforcement_total", route="strict_pattern") == 0
    assert [e["status"] for e in logs if e["event"] == "grammar_constraint_refused"] == [400]


# --- live delivery: each delta reaches the client before the upstream writes the next ---------------------------


class LockstepVllm(FakeVllm):
    """A fake vLLM 0.32 that writes each argument delta of the grammar call only after the client has received the
    previous one (the test hands it a token per delta the client saw). A gateway that held a delta back — to check
    the call first, or to batch frames — never lets the client see it, the upstream waits for a token that never
    comes, and the test fails. It records when it wrote each delta, the client when it read each one."""

    PIECES: tuple[str, ...] = ('{"input": "*** Begin', " Patch\\n", "+hel",
                                "lo\\n", "+wor", "ld\\n", "*** End", " Patch", '"}')

    def __init__(self) -> None:
        super().__init__()
        self.gate: queue.Queue[None] = queue.Queue()
        self.written: list[float] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/responses":
            return super().__call__(request)
        self.requests.append((request.method, request.url.path, orjson.loads(request.content)))
        stream = VllmStream().start()
        stream.call("fc_00000000000000a1", "chatcmpl-tool-00000000000000a1", "apply_patch", list(self.PIECES))
        frames = [f.encode() for f in stream.complete().frames]

        async def body() -> AsyncIterator[bytes]:
            deltas = 0
            for frame in frames:
                if b"response.function_call_arguments.delta" in frame and deltas < len(self.PIECES) - 1:
                    # every delta but the closing '"}' (which carries no input) waits for the client's token
                    await asyncio.to_thread(self.gate.get, True, 10)
                    self.written.append(time.perf_counter())
                    deltas += 1
                yield frame

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


@pytest.mark.usefixtures("stub_conversion")
@pytest.mark.parametrize("parser", ["auto", "hermes"])
def test_every_input_delta_reaches_the_client_before_the_upstream_writes_the_next(parser: str) -> None:
    fake = LockstepVllm()
    received: list[float] = []
    text = ""
    with gateway(fake, tool_call_parser=parser) as url, \
            httpx.stream("POST", url + "/v1/responses", json=request(), timeout=30) as r:
        fake.gate.put(None)  # the first delta may go
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line[6:])
            if event["type"] == "response.custom_tool_call_input.delta":
                received.append(time.perf_counter())
                text += event["delta"]
                fake.gate.put(None)  # seen: the upstream may write the next one
    n = len(LockstepVllm.PIECES) - 1
    assert text == json.loads("".join(LockstepVllm.PIECES))["input"] and len(received) == n and len(fake.written) == n
    # delta k arrived before the upstream wrote delta k+1: nothing was held or batched on the way
    assert all(received[k] < fake.written[k + 1] for k in range(n - 1))
    assert [p[1] for p in fake.generation_requests] == ["/v1/responses"]
