"""--tool-choice-enforcement constrain against answers recorded from the real tiny vLLM.

Each enforce_* cassette holds the upstream steps (choice, then arguments) that the gateway's own code
built for one client request (tools/record_cassettes.py); the tests send that client request and check
that the gateway sent exactly the recorded steps, with their structured_outputs constraint, and that the
call it returned is valid.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import lark
import openai
import pytest

from gateway.upstream.replay import CassetteTransport, load_cassette
from tests.invariants import check_stream
from tests.support import cassette, replay, running_gateway, sse_events
from tests.vllm_frames import VllmStream, args_deltas


def client_request(name: str) -> dict[str, Any]:
    """The client request the cassette was recorded for (its header says so)."""
    text = cassette(name).read_text(encoding="utf-8")
    line = next(ln for ln in text.splitlines() if ln.startswith("# client request"))
    return json.loads(line.split("): ", 1)[1])


def recorded_bodies(name: str) -> list[dict[str, Any]]:
    return [i.request_body or {} for i in load_cassette(cassette(name)).interactions]


def run(name: str, request: dict[str, Any] | None = None, **settings: Any) -> tuple[dict[str, Any], CassetteTransport]:
    request = request or client_request(name)
    transport = replay(name)
    with running_gateway(transport=transport, tool_choice_enforcement="constrain", **settings) as url:
        r = httpx.post(url + "/v1/responses", json=request, timeout=30)
    assert r.status_code == 200, r.text
    if request.get("stream"):
        summary = check_stream(sse_events(r.content), request)
        assert summary["terminal"] == "response.completed"
        final = summary["response"]
        final["_events"] = sse_events(r.content)
    else:
        final = r.json()
    return final, transport


def sent(transport: CassetteTransport) -> list[dict[str, Any]]:
    return [r["body"] for r in transport.requests]


VARIANTS = ["nonstream", "stream"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_named_function_is_pinned_to_its_schema(variant: str, api: str) -> None:
    name = f"enforce_named_function_{variant}"
    request = client_request(name)
    final, transport = run(name, upstream_api=api)
    assert sent(transport) == recorded_bodies(name)
    [step] = sent(transport)
    schema = request["tools"][0]["parameters"]
    assert transport.requests[0]["path"] == "/v1/chat/completions"
    assert step["structured_outputs"] == {"json": schema} and "tools" not in step
    [call] = final["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["id"].startswith("fc_")
    jsonschema.validate(json.loads(call["arguments"]), schema)
    assert final["status"] == "completed" and final["error"] is None
    assert final["tool_choice"] == {"type": "function", "name": "get_weather"}
    if variant == "stream":
        deltas = [e["delta"] for e in final["_events"] if e["type"] == "response.function_call_arguments.delta"]
        assert len(deltas) > 3 and "".join(deltas) == call["arguments"]  # streamed as generated


@pytest.mark.parametrize("variant", VARIANTS)
def test_required_among_three_tools_is_resolved_by_choice(variant: str) -> None:
    name = f"enforce_required_three_{variant}"
    request = client_request(name)
    final, transport = run(name)
    assert sent(transport) == recorded_bodies(name)
    pick, args = sent(transport)
    assert pick["structured_outputs"] == {"choice": ["get_weather", "get_time", "zip_code"]}
    assert pick.get("stream") is not True
    for tool in request["tools"]:
        assert tool["name"] in pick["messages"][-1]["content"]
        assert tool.get("description", "") in pick["messages"][-1]["content"]
    picked = load_cassette(cassette(name)).interactions[0].body
    picked_name = json.loads(picked)["choices"][0]["message"]["content"]
    [call] = final["output"]
    assert call["name"] == picked_name == "zip_code"
    assert args["structured_outputs"] == {"regex": "[0-9]{5}"}
    assert call["type"] == "custom_tool_call" and re.fullmatch("[0-9]{5}", call["input"])
    # the choice step's tokens are part of the answer's usage
    assert final["usage"]["input_tokens"] > 0 and final["usage"]["output_tokens"] >= 6


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_tool_with_a_lark_grammar(variant: str) -> None:
    name = f"enforce_custom_lark_{variant}"
    request = client_request(name)
    grammar = request["tools"][0]["format"]["definition"]
    final, transport = run(name)
    [step] = sent(transport)
    assert step == recorded_bodies(name)[0] and step["structured_outputs"] == {"grammar": grammar}
    [call] = final["output"]
    assert call["type"] == "custom_tool_call" and call["id"].startswith("ctc_") and call["name"] == "apply_patch"
    lark.Lark(grammar, parser="earley").parse(call["input"])  # the Python lark package agrees
    assert call["input"].startswith("*** Begin Patch\n*** Add File: ")
    if variant == "stream":
        deltas = [e["delta"] for e in final["_events"] if e["type"] == "response.custom_tool_call_input.delta"]
        assert len(deltas) > 3 and "".join(deltas) == call["input"]
        assert not [e for e in final["_events"] if e["type"].startswith("response.function_call")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_regex_custom_tool(variant: str) -> None:
    name = f"enforce_custom_regex_{variant}"
    final, transport = run(name)
    [step] = sent(transport)
    assert step == recorded_bodies(name)[0] and step["structured_outputs"] == {"regex": "[0-9]{5}"}
    [call] = final["output"]
    assert call["type"] == "custom_tool_call" and re.fullmatch("[0-9]{5}", call["input"])


def test_openai_sdk_strict_stream_accepts_constrained_calls() -> None:
    for name in ("enforce_custom_lark_stream", "enforce_named_function_stream", "enforce_required_three_stream"):
        request = {k: v for k, v in client_request(name).items() if k not in ("stream", "seed")}
        seed = client_request(name)["seed"]  # a vLLM extra: the SDK sends it through extra_body
        with running_gateway(transport=replay(name), tool_choice_enforcement="constrain") as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with client.responses.stream(**request, extra_body={"seed": seed}) as stream:
                for _ in stream:
                    pass
                final = stream.get_final_response()
        assert final.status == "completed" and len(final.output) == 1
        assert final.output[0].type in ("function_call", "custom_tool_call")


def test_auto_grammar_call_is_taken_over_live_under_the_grammar() -> None:
    """auto + a grammar custom tool on an upstream that cannot constrain it in one request (this replay answers
    ``GET /version`` 404; vLLM 0.32 takes the one-request route: tests/test_grammar_onerequest.py): the upstream's
    own input would not parse; the gateway takes the call over when it opens, closes the upstream stream and
    streams a grammar-constrained input into the same item."""
    request = {**client_request("enforce_custom_lark_stream"), "tool_choice": "auto", "stream": True}
    grammar = request["tools"][0]["format"]["definition"]
    stream = VllmStream().start()
    stream.call("fc_00000000000000a1", "chatcmpl-tool-00000000000000a1", "apply_patch",
                args_deltas({"input": "*** Begin Patch\nnot a patch"}))
    body = stream.complete().body()
    recorded = load_cassette(cassette("enforce_custom_lark_stream"))  # the real vLLM's constrained stream
    responses_answer = type(recorded.interactions[0])(
        method="POST", path="/v1/responses", request_body=None, status=200,
        headers={"content-type": "text/event-stream; charset=utf-8"}, body=body)
    transport = CassetteTransport([type(recorded)("synth", recorded.path, (responses_answer,), True), recorded])
    with running_gateway(transport=transport, tool_choice_enforcement="constrain") as url:
        r = httpx.post(url + "/v1/responses", json=request, timeout=30)
    summary = check_stream(sse_events(r.content), request)
    [call] = summary["items"]
    assert call["type"] == "custom_tool_call" and call["id"] == "ctc_00000000000000a1"
    assert call["status"] == "completed"
    lark.Lark(grammar, parser="earley").parse(call["input"])
    assert summary["custom_inputs"] == [call["input"]]
    paths = [q["path"] for q in transport.requests]
    assert paths == ["/version", "/v1/responses", "/v1/chat/completions"]
    assert transport.requests[2]["body"] == recorded.interactions[0].request_body
    # the upstream's invalid input never reached the client
    assert "not a patch" not in r.text


def _chat_answer(content: str) -> httpx.Response:
    return httpx.Response(200, json={"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "tiny",
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                                  "finish_reason": "stop"}],
                                     "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_step_that_names_no_allowed_tool_fails_the_response_after_bounded_attempts(stream: bool) -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return _chat_answer("nonsense")  # what a server without structured outputs might answer

    request = {"model": "tiny", "input": "x", "tools": client_request("enforce_required_three_nonstream")["tools"],
               "tool_choice": "required", "stream": stream}
    with running_gateway(transport=httpx.MockTransport(handler), tool_choice_enforcement="constrain") as url:
        r = httpx.post(url + "/v1/responses", json=request, timeout=30)
    assert r.status_code == 200 and len(seen) == 2  # PICK_ATTEMPTS
    if stream:
        summary = check_stream(sse_events(r.content), request)
        assert summary["terminal"] == "response.failed"
        final = summary["response"]
    else:
        final = r.json()
    assert final["status"] == "failed" and final["error"]["code"] == "tool_choice_violation"
    assert final["output"] == []


def test_non_streamed_auto_grammar_call_is_regenerated() -> None:
    request = {**client_request("enforce_custom_lark_nonstream"), "tool_choice": "auto"}
    stream = VllmStream().start()
    stream.call("fc_00000000000000a2", "chatcmpl-tool-00000000000000a2", "apply_patch", ['{"input": "oops"}'])
    payload = json.loads(stream.complete().body().split(b"data: ")[-1])["response"]
    recorded = load_cassette(cassette("enforce_custom_lark_nonstream")).interactions[0].body
    answers = [httpx.Response(200, json=payload),
               httpx.Response(200, content=recorded, headers={"content-type": "application/json"})]
    paths: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/version":  # not a vLLM that constrains grammar calls in one request: the old route
            return httpx.Response(404, json={"detail": "Not Found"})
        paths.append(req.url.path)
        return answers[len(paths) - 1]

    with running_gateway(transport=httpx.MockTransport(handler), tool_choice_enforcement="constrain") as url:
        final = httpx.post(url + "/v1/responses", json=request, timeout=30).json()
    assert paths == ["/v1/responses", "/v1/chat/completions"]
    [call] = final["output"]
    lark.Lark(request["tools"][0]["format"]["definition"], parser="earley").parse(call["input"])
    assert final["status"] == "completed"
