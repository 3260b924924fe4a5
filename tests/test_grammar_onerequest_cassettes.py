"""One-request grammar enforcement replayed from the real tiny vLLM (issue 18).

The cassettes cassettes/vllm/onerequest_<api>_<parser>.yaml were recorded THROUGH the gateway by
tests/test_live_grammar_onerequest.py (``GATEWAY_RECORD_CASSETTES=1 pytest -m live_vllm``): vLLM 0.32's answer to
``GET /version`` and to the one generation request per client request, as the real server sent them. Replayed
here, the gateway must send the same requests (the conversions' own output aside: tests/test_grammar_convert*.py
judge those) — exactly one generation request per response — and every completed grammar call must parse under
its Lark grammar after streaming in several deltas.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import lark
import pytest

from gateway.translate import grammar_convert
from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import cassette, replay, running_gateway, sse_events

CASES = [("responses", "hermes"), ("chat", "hermes"), ("responses", "auto"), ("chat", "auto")]


def client_requests(name: str) -> list[dict[str, Any]]:
    text = cassette(name).read_text(encoding="utf-8")
    return [json.loads(line.split("): ", 1)[1]) for line in text.splitlines() if line.startswith("# client request")]


def without_conversions(body: dict[str, Any]) -> dict[str, Any]:
    """The body less what the grammar conversion produced (the structural tag, the tools' input pattern)."""
    out = {k: v for k, v in body.items() if k != "structured_outputs"}
    tools = []
    for tool in body.get("tools") or ():
        fn = tool.get("function") or tool
        props = ((fn.get("parameters") or {}).get("properties") or {})
        if "pattern" in (props.get("input") or {}):
            tool = json.loads(json.dumps(tool))
            ((tool.get("function") or tool)["parameters"]["properties"]["input"]).pop("pattern")
        tools.append(tool)
    out["tools"] = tools
    return out


@pytest.mark.parametrize(("api", "parser"), CASES)
def test_replayed_grammar_responses_cost_one_request_and_parse(api: str, parser: str) -> None:
    name = f"onerequest_{api}_{parser}"
    requests = client_requests(name)
    recorded = [i for i in load_cassette(cassette(name)).interactions if i.method == "POST"]
    assert len(recorded) == len(requests)  # one generation request per recorded response
    transport = replay(name)
    completed = cut = 0
    with running_gateway(transport=transport, tool_choice_enforcement="constrain", upstream_api=api,
                         tool_call_parser=parser) as url:
        for request, interaction in zip(requests, recorded, strict=True):
            before = len(transport.requests)
            r = httpx.post(url + "/v1/responses", json=request, timeout=30)
            assert r.status_code == 200, r.text
            events = sse_events(r.content)
            final = check_stream(events, request)["response"]
            sent = [q for q in transport.requests[before:] if q["method"] == "POST"]
            assert len(sent) == 1 and sent[0]["path"] == interaction.path
            body, want = sent[0]["body"], interaction.request_body or {}
            assert without_conversions(body) == without_conversions(want)
            grammar = request["tools"][0]["format"]["definition"]
            if parser == "hermes":
                tag = json.loads(body["structured_outputs"]["structural_tag"])
                contents = [t["content"] for t in tag["format"]["tags"] if t["content"]["type"] == "grammar"]
                assert contents and all(c["grammar"] == grammar_convert.to_ebnf("lark", grammar, json_escaped=True)
                                        for c in contents)
            else:
                [fn] = [t.get("function") or t for t in body["tools"] if (t.get("function") or t)["name"] ==
                        "apply_patch"]
                assert fn["strict"] is True
                pattern = fn["parameters"]["properties"]["input"]["pattern"]
                assert pattern == grammar_convert.to_json_pattern("lark", grammar)
            for item in final["output"]:
                if item["type"] != "custom_tool_call":
                    continue
                if item["status"] != "completed":  # cut at max_output_tokens: never a completed invalid call
                    assert item["status"] == "incomplete" and final["status"] == "incomplete"
                    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
                    cut += 1
                    continue
                completed += 1
                lark.Lark(grammar, parser="earley").parse(item["input"])
                deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"
                          and e["item_id"] == item["id"]]
                assert len(deltas) > 1
    assert [q["path"] for q in transport.requests].count("/version") == 1
    assert completed > 0 and cut > 0  # each cassette holds two completed calls and one cut call
