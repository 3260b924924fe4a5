"""What the popular third-party clients need from the wire: ``status`` on custom calls, OpenAI's usage shape,
``item_reference`` inputs resolved from the store — in streams, bodies and the store, on both upstream APIs.

Upstream answers are SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py); the usage carries the extra
per-turn arrays vLLM 0.32 puts in its details.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.store import SqliteResponseStore
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events
from tests.vllm_frames import VllmStream, args_deltas

PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
VLLM_USAGE = {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 3, "input_tokens_per_turn": [],
                                                            "cached_tokens_per_turn": []},
              "output_tokens": 40, "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                             "output_tokens_per_turn": []},
              "total_tokens": 160}
# the newest openai SDK requires cache_write_tokens: 0 when vLLM does not report it
OPENAI_USAGE = {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                "output_tokens": 40,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 160}


def _with_usage(body: bytes) -> bytes:
    """vLLM's usage (with its per-turn arrays) in the terminal frame, the last ``data:`` line."""
    text = body.decode()
    head, last = text.rstrip("\n").rsplit("data: ", 1)
    d = json.loads(last)
    d["response"]["usage"] = VLLM_USAGE
    return (head + "data: " + json.dumps(d, separators=(",", ":")) + "\n\n").encode()


def call_stream() -> VllmStream:
    s = VllmStream().start()
    s.message("msg_00000000000000c1", ["Patching."])
    s.call("fc_00000000000000c2", "call_c2", "apply_patch", args_deltas({"input": "*** Begin Patch\n*** End Patch\n"}))
    return s.complete()


class Upstream:
    """Answers /v1/responses with a custom call (turn 1) and then text; /v1/chat/completions likewise."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request.url.path, body))
        first = len(self.requests) == 1
        if request.url.path == "/v1/chat/completions":
            return self._chat(body, first)
        for item in body.get("input") or ():
            if isinstance(item, dict) and item.get("type") == "item_reference":  # as vLLM answers (no store)
                return httpx.Response(400, json={"error": {"message": "item_reference is not supported",
                                                           "type": "BadRequestError", "param": None, "code": 400}})
        s = call_stream() if first else VllmStream().start().message("msg_00000000000000d1", ["Done."]).complete()
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_with_usage(s.body()))
        resp = json.loads(s.nonstream_body())
        resp["usage"] = VLLM_USAGE
        return httpx.Response(200, json=resp)

    def _chat(self, body: dict[str, Any], first: bool) -> httpx.Response:
        msg: dict[str, Any] = {"role": "assistant", "content": "Done."}
        if first:
            fn = {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch\n*** End Patch\n"})}
            msg = {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call_c2", "type": "function", "function": fn}]}
        usage = {"prompt_tokens": 120, "completion_tokens": 40, "total_tokens": 160,
                 "prompt_tokens_details": {"cached_tokens": 3}}
        return httpx.Response(200, json={"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
                                         "choices": [{"index": 0, "message": msg,
                                                      "finish_reason": "tool_calls" if first else "stop"}],
                                         "usage": usage})


@pytest.mark.parametrize("stream", [False, True])
def test_custom_calls_carry_status_and_usage_is_openai_shaped(tmp_path: Path, stream: bool) -> None:
    up = Upstream()
    with running_gateway(transport=httpx.MockTransport(up), store=SqliteResponseStore(tmp_path / "r.db")) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "fix", "tools": [PATCH],
                                                    "stream": stream}, timeout=30)
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.content)
            check_stream(events)
            added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert added[1]["type"] == "custom_tool_call" and added[1]["status"] == "in_progress"
            assert done[1]["status"] == "completed"
            final = events[-1]["response"]
            assert events[0]["response"]["usage"] is None
        else:
            final = r.json()
        assert final["output"][1]["type"] == "custom_tool_call" and final["output"][1]["status"] == "completed"
        assert final["usage"] == OPENAI_USAGE
        stored = httpx.get(url + f"/v1/responses/{final['id']}").json()
        assert stored["usage"] == OPENAI_USAGE and stored["output"][1]["status"] == "completed"


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_item_references_are_resolved_from_the_store(tmp_path: Path, api: str) -> None:
    up = Upstream()
    with running_gateway(transport=httpx.MockTransport(up), store=SqliteResponseStore(tmp_path / "r.db"),
                         upstream_api=api) as url:
        r1 = httpx.post(url + "/v1/responses", json={"model": "tiny", "tools": [PATCH], "input": [
            {"type": "message", "role": "user", "content": "fix it", "id": "msg_user_1"}]}, timeout=30).json()
        call = next(i for i in r1["output"] if i["type"] == "custom_tool_call")
        assert call["id"].startswith("ctc_")
        # what the AI SDK sends on the next turn with the default store: references to stored items
        r2 = httpx.post(url + "/v1/responses", json={"model": "tiny", "tools": [PATCH], "input": [
            {"type": "item_reference", "id": "msg_user_1"},
            {"type": "item_reference", "id": call["id"]},
            {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "applied"}]}, timeout=30)
        assert r2.status_code == 200, r2.text
        _path, sent = up.requests[-1]
        if api == "responses":
            items = sent["input"]
            assert items[0]["role"] == "user" and items[0]["type"] == "message"
            assert items[1]["type"] == "function_call" and items[1]["name"] == "apply_patch"
            assert json.loads(items[1]["arguments"]) == {"input": call["input"]}
            assert items[1]["call_id"] == call["call_id"]
            assert items[2] == {"type": "function_call_output", "call_id": call["call_id"], "output": "applied"}
            assert "item_reference" not in json.dumps(sent)
        else:
            msgs = sent["messages"]
            assert msgs[0]["role"] == "user"
            assert msgs[1]["tool_calls"][0]["function"]["name"] == "apply_patch"
            assert msgs[2] == {"role": "tool", "tool_call_id": call["call_id"], "content": "applied"}
        # an id nobody stored is the client's mistake, named
        r3 = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": [
            {"type": "message", "role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_nope"}]})
        assert r3.status_code == 400
        assert r3.json()["error"]["param"] == "input[1].id" and "msg_nope" in r3.json()["error"]["message"]


def test_item_reference_without_a_store_is_a_clear_400() -> None:
    with running_gateway(transport=httpx.MockTransport(Upstream())) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": [{"type": "item_reference", "id": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "store_disabled"
