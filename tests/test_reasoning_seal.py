"""Reasoning across ``store: false`` turns: the gateway seals reasoning as ``encrypted_content`` and opens it.

Upstream streams are SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py), with a reasoning item as vLLM
sends it under ``--reasoning-parser``.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import httpx
import pytest

from gateway.translate.sealing import ReasoningSealer, open_sealed_reasoning, parse_keys
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events
from tests.vllm_frames import VllmStream

THOUGHT = "SECRET-THOUGHT: the user wants a patch for utils.py"
KEY_A = base64.b64encode(os.urandom(32)).decode()
KEY_B = base64.b64encode(os.urandom(32)).decode()


def test_seal_and_open_round_trip_and_the_blob_reveals_nothing() -> None:
    sealer = ReasoningSealer(parse_keys(KEY_A), random_bytes=os.urandom)
    item = {"id": "rs_1", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]}
    blob = sealer.seal(item)
    assert sealer.open(blob) == {"id": "rs_1", "text": THOUGHT}
    raw = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
    for probe in ("SECRET", "utils.py", "rs_1"):
        assert probe not in blob and probe.encode() not in raw
        assert base64.b64encode(probe.encode()).decode()[:6] not in blob
    assert sealer.seal(item) != blob  # a fresh nonce each time


def test_key_rotation_and_tampering() -> None:
    old = ReasoningSealer(parse_keys(KEY_A), random_bytes=os.urandom)
    blob = old.seal({"id": "rs_2", "content": [{"type": "reasoning_text", "text": "t"}]})
    # the new key seals, the old one still opens
    rotated = ReasoningSealer(parse_keys(f"{KEY_B},{KEY_A}"), random_bytes=os.urandom)
    assert rotated.open(blob) == {"id": "rs_2", "text": "t"}
    assert ReasoningSealer(parse_keys(KEY_B), random_bytes=os.urandom).open(blob) is None
    tampered = blob[:-3] + ("A" if blob[-3] != "A" else "B") + blob[-2:]
    assert rotated.open(tampered) is None and rotated.open("not a blob") is None and rotated.open(None) is None
    with pytest.raises(ValueError):
        parse_keys("c2hvcnQ=")  # 5 bytes


def test_open_sealed_reasoning_drops_what_does_not_open() -> None:
    sealer = ReasoningSealer(parse_keys(KEY_A), random_bytes=os.urandom)
    good = {"type": "reasoning", "id": "rs_a", "summary": [], "encrypted_content": sealer.seal(
        {"id": "rs_a", "content": [{"type": "reasoning_text", "text": THOUGHT}]})}
    bad_empty = {"type": "reasoning", "id": "rs_b", "summary": [], "encrypted_content": "garbage"}
    bad_with_text = {"type": "reasoning", "id": "rs_c", "summary": [{"type": "summary_text", "text": "s"}],
                     "encrypted_content": "garbage"}
    plain = {"type": "reasoning", "id": "rs_d", "summary": [], "content": [{"type": "reasoning_text", "text": "p"}]}
    out, rejected = open_sealed_reasoning([good, bad_empty, bad_with_text, plain], sealer)
    assert rejected == 2
    assert out[0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}] and "encrypted_content" not in out[0]
    assert [i["id"] for i in out] == ["rs_a", "rs_c", "rs_d"] and out[2] is plain


class Upstream:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        s = VllmStream().start().reasoning("rs_00000000000000f1", ["SECRET-THOUGHT: ", "the user wants a patch ",
                                                                     "for utils.py"])
        s.message("msg_00000000000000f2", ["Done."]).complete()
        if not self.bodies[-1].get("stream"):
            return httpx.Response(200, headers={"content-type": "application/json"}, content=s.nonstream_body())
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=s.body())


def test_reasoning_round_trip_across_two_store_false_turns() -> None:
    up = Upstream()
    turn = {"model": "tiny", "store": False, "stream": True, "include": ["reasoning.encrypted_content"]}
    with running_gateway(transport=httpx.MockTransport(up), reasoning_key=f"{KEY_B},{KEY_A}") as url:
        r1 = httpx.post(url + "/v1/responses", json={**turn, "input": "patch it"}, timeout=30)
        events = sse_events(r1.content)
        check_stream(events)
        reasoning = events[-1]["response"]["output"][0]
        assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
        done = next(e["item"] for e in events if e["type"] == "response.output_item.done")
        assert done["encrypted_content"] == reasoning["encrypted_content"]
        assert "SECRET" not in reasoning["encrypted_content"]
        # Codex replays the reasoning item (here without its readable content) with the rest of the history
        replay = {k: v for k, v in reasoning.items() if k not in ("content", "status")}
        tampered = {**replay, "id": "rs_x", "encrypted_content": replay["encrypted_content"][:-4] + "AAAA"}
        plain = {"type": "reasoning", "id": "rs_p", "summary": [], "content": [{"type": "reasoning_text",
                                                                                 "text": "plain"}]}
        r2 = httpx.post(url + "/v1/responses", json={**turn, "input": [
            {"type": "message", "role": "user", "content": "patch it"}, replay, tampered, plain,
            {"type": "message", "role": "user", "content": "go on"}]}, timeout=30)
        assert r2.status_code == 200
        metrics = httpx.get(url + "/metrics").text
    sent = up.bodies[1]["input"]
    assert "encrypted_content" not in json.dumps(sent)
    kinds = [(i.get("type"), i.get("id")) for i in sent]
    assert ("reasoning", reasoning["id"]) in kinds and ("reasoning", "rs_x") not in kinds
    opened = next(i for i in sent if i.get("id") == reasoning["id"])
    assert opened["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert next(i for i in sent if i.get("id") == "rs_p") == plain  # unchanged
    assert "responses_gateway_reasoning_blobs_rejected_total 1.0" in metrics


def test_without_the_include_nothing_is_sealed_and_non_streamed_bodies_seal_too() -> None:
    up = Upstream()
    with running_gateway(transport=httpx.MockTransport(up), reasoning_key=KEY_A) as url:
        body = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x"}, timeout=30).json()
        sealed = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "store": False,
                                                         "include": ["reasoning.encrypted_content"]}, timeout=30).json()
    assert body["output"][0]["type"] == "reasoning" and not body["output"][0].get("encrypted_content")
    blob = sealed["output"][0]["encrypted_content"]
    opened = ReasoningSealer(parse_keys(KEY_A), random_bytes=os.urandom).open(blob)
    assert opened == {"id": "rs_00000000000000f1", "text": THOUGHT}
