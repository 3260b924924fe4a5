"""Compaction (issue 20): ``/v1/responses/compact``, ``context_management`` and ``compaction_trigger``.

The upstream is SCRIPTED (hand-written, in vLLM 0.32's framing from tests/vllm_frames.py, and an OpenAI-shaped
chat completion for the chat path): it records every body it receives and answers a summarization turn (the
gateway's compaction instructions) with a summary, anything else with "Done.". The context meter is a fake whose
count each test sets (the real one asks vLLM's /tokenize; gateway.engine.context).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    CompactedResponse,
    Response,
    ResponseCompactionItem,
    ResponseInputMessageItem,
    ResponseStreamEvent,
    ResponseUsage,
)
from pydantic import TypeAdapter
from structlog.testing import capture_logs

import gateway.server.app as app_module
from gateway.engine.compaction import open_compactions
from gateway.engine.context import ContextMeter
from gateway.engine.history import from_newest_compaction
from gateway.translate.compaction_prompt import (
    COMPACTION_INSTRUCTIONS,
    SUMMARY_PREFIX,
    render_transcript,
    summary_message,
)
from gateway.translate.sealing import ReasoningSealer, parse_keys
from tests.conversation_support import fresh_store
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events
from tests.vllm_frames import VllmStream

SUMMARY = "SUMMARY-7f3: the user asked for a patch to utils.py; tests pass; next: update the README."
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
EVENTS = TypeAdapter(ResponseStreamEvent)


class Upstream:
    """Records each body; a summarization turn gets SUMMARY, any other turn "Done." (both APIs)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def summarizations(self) -> list[dict[str, Any]]:
        return [b for b in self.bodies if _is_summarization(b)]

    def answers(self) -> list[dict[str, Any]]:
        return [b for b in self.bodies if not _is_summarization(b)]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        text = SUMMARY if _is_summarization(body) else "Done."
        if request.url.path.endswith("/chat/completions"):
            return httpx.Response(200, json={
                "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 120, "completion_tokens": 40, "total_tokens": 160}})
        s = VllmStream().start().message(f"msg_{len(self.bodies):016x}", [text]).complete()
        if not body.get("stream"):
            return httpx.Response(200, headers={"content-type": "application/json"}, content=s.nonstream_body())
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=s.body())


def _is_summarization(body: Mapping[str, Any]) -> bool:
    if body.get("instructions") == COMPACTION_INSTRUCTIONS:
        return True
    messages = body.get("messages") or []
    return bool(messages) and messages[0].get("content") == COMPACTION_INSTRUCTIONS


class FakeMeter(ContextMeter):
    """The context meter with a count the test sets (and a 32k window); records what it was asked to count."""

    tokens = 0

    def __init__(self, upstream: Any, **kw: Any) -> None:
        super().__init__(upstream, **kw)
        self.counted: list[dict[str, Any]] = []

    async def window(self, model: str, headers: Mapping[str, str]) -> int | None:
        return 32768

    def could_reach(self, upstream_body: Mapping[str, Any], tokens: int) -> bool:
        return True

    async def count(self, upstream_body: Mapping[str, Any], headers: Mapping[str, str]) -> int:
        self.counted.append(dict(upstream_body))
        return FakeMeter.tokens


@pytest.fixture
def meter(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeMeter]]:
    monkeypatch.setattr(app_module, "ContextMeter", FakeMeter)
    FakeMeter.tokens = 0
    yield FakeMeter


@pytest.fixture
def gateway(tmp_path: Path, meter: type[FakeMeter]) -> Iterator[tuple[str, Upstream]]:
    up = Upstream()
    with fresh_store("sqlite", tmp_path) as st, running_gateway(transport=httpx.MockTransport(up), store=st,
                                                                 api_keys=(KEY_A, KEY_B)) as url:
        yield url, up


def client(url: str, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30)


HISTORY: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": "Patch utils.py so parse() accepts spaces."},
    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"cmd\":\"pytest -q\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "3 passed"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Patched; tests pass."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now the README."}]},
]


def _sdk_usage(obj: Any) -> Any:
    """``obj`` with every usage given ``cache_write_tokens: 0``: the newest SDK's ResponseUsage requires it, and the
    gateway's usage (gateway.translate.usage) does not carry it yet — a project-wide gap outside compaction, so the
    SDK models here check everything else."""
    if isinstance(obj, dict):
        out = {k: _sdk_usage(v) for k, v in obj.items()}
        details = out.get("input_tokens_details")
        if "input_tokens" in out and isinstance(details, dict):
            out["input_tokens_details"] = {"cache_write_tokens": 0, **details}
        return out
    if isinstance(obj, list):
        return [_sdk_usage(v) for v in obj]
    return obj


def _sent_text(body: Mapping[str, Any]) -> str:
    return json.dumps(body.get("input") if "input" in body else body.get("messages"))


def _check_compacted(payload: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response.compaction shape, checked with the SDK's models; the compaction item."""
    assert payload["object"] == "response.compaction" and payload["id"] and payload["created_at"] > 0
    CompactedResponse.model_construct(**payload)  # the envelope's fields are all there
    ResponseUsage.model_validate(_sdk_usage(payload["usage"]))
    *messages, item = payload["output"]
    for m in messages:
        ResponseInputMessageItem.model_validate(m)
        assert m["role"] == "user"
    ResponseCompactionItem.model_validate(item)
    assert item["type"] == "compaction" and item["id"] and item["encrypted_content"]
    return item


# ---------------------------------------------------------------------------------------------- pure parts


def test_the_compaction_seal_is_its_own_purpose() -> None:
    sealer = ReasoningSealer(parse_keys(base64.b64encode(os.urandom(32)).decode()), random_bytes=os.urandom)
    blob = sealer.seal({"id": "cmp_1", "content": [{"text": SUMMARY}]}, "owner-a", purpose="compaction")
    assert sealer.open(blob, "owner-a", purpose="compaction") == {"id": "cmp_1", "text": SUMMARY}
    assert sealer.open(blob, "owner-b", purpose="compaction") is None
    assert sealer.open(blob, "owner-a") is None  # never opens as a reasoning blob, nor the other way round
    reasoning = sealer.seal({"id": "rs_1", "content": [{"text": "x"}]}, "owner-a")
    assert sealer.open(reasoning, "owner-a", purpose="compaction") is None
    assert "SUMMARY" not in blob


def test_history_loads_from_the_newest_compaction_item() -> None:
    a, c1, b = {"type": "message", "id": "a"}, {"type": "compaction", "id": "c1"}, {"type": "message", "id": "b"}
    c2, d = {"type": "compaction", "id": "c2"}, {"type": "message", "id": "d"}
    assert from_newest_compaction([a, c1, b, c2, d]) == [c2, d]
    assert from_newest_compaction([a, b]) == [a, b]


def test_the_transcript_carries_calls_and_outputs_and_clips_huge_items() -> None:
    text = render_transcript([*HISTORY, {"type": "function_call_output", "call_id": "c", "output": "x" * 50_000}])
    assert "[tool call shell (call_1)]" in text and "3 passed" in text and "Now the README." in text
    assert "characters left out" in text and len(text) < 40_000


_TEXT = st.text(max_size=40)
_ITEMS = st.lists(st.one_of(
    st.builds(lambda r, t: {"type": "message", "role": r, "content": t}, st.sampled_from(["user", "assistant"]),
              _TEXT),
    st.builds(lambda c, a: {"type": "function_call", "call_id": c, "name": "f", "arguments": a}, _TEXT, _TEXT),
    st.builds(lambda c, o: {"type": "function_call_output", "call_id": c, "output": o}, _TEXT, _TEXT),
    st.builds(lambda t: {"type": "compaction", "summary": t}, _TEXT),
    st.dictionaries(st.sampled_from(["type", "id", "x"]), st.one_of(_TEXT, st.integers(), st.none()), max_size=3),
), max_size=12)
_SEALER = ReasoningSealer(parse_keys(base64.b64encode(bytes(32)).decode()), random_bytes=os.urandom)


@settings(max_examples=60, deadline=None)
@given(_ITEMS, st.sampled_from([None, "owner-a"]))
def test_every_sealed_item_opens_in_place_and_history_loads_from_the_newest(items: list[dict[str, Any]],
                                                                           owner: str | None) -> None:
    """Property: each compaction item (sealed for the owner) opens into exactly its summary, in place, the other
    items untouched; the transcript renders whatever the items are; a history starts at its newest one."""
    sealed = [{"type": "compaction", "id": f"cmp_{i}",
               "encrypted_content": _SEALER.seal({"id": f"cmp_{i}", "content": [{"text": it["summary"]}]}, owner,
                                                 purpose="compaction")}
              if it.get("type") == "compaction" else it for i, it in enumerate(items)]
    opened, bad = open_compactions(sealed, _SEALER, owner)
    assert bad is None and len(opened) == len(items)
    for before, after in zip(items, opened, strict=True):
        if before.get("type") == "compaction":
            assert after == summary_message(before["summary"])
        else:
            assert after is before
    assert isinstance(render_transcript(opened), str)
    loaded = from_newest_compaction(sealed)
    kinds = [i.get("type") for i in sealed]
    if "compaction" in kinds:
        assert loaded[0]["type"] == "compaction" and "compaction" not in [i.get("type") for i in loaded[1:]]
        assert sealed[len(sealed) - len(loaded):] == loaded
    else:
        assert loaded == sealed
    other = "owner-b" if owner else "owner-a"
    if "compaction" in kinds:  # another owner's sealing never opens, and says which item
        assert open_compactions(sealed, _SEALER, other)[1] == kinds.index("compaction")


# ------------------------------------------------------------------------------------ /v1/responses/compact


def test_compact_by_input_then_the_item_opens_into_its_summary_upstream(gateway: tuple[str, Upstream]) -> None:
    url, up = gateway
    with client(url) as a:
        r = a.post("/v1/responses/compact", json={"model": "tiny", "input": HISTORY, "instructions": "Be terse."})
        assert r.status_code == 200, r.text
        payload = r.json()
        item = _check_compacted(payload)
        assert [m["content"][0]["text"] for m in payload["output"][:-1]] == [
            "Patch utils.py so parse() accepts spaces.", "Now the README."]
        assert payload["usage"]["input_tokens"] == 120 and payload["usage"]["total_tokens"] == 160
        assert "SUMMARY" not in item["encrypted_content"] and "utils" not in item["encrypted_content"]
        [summarization] = up.bodies
        assert summarization["instructions"] == COMPACTION_INSTRUCTIONS and summarization["store"] is False
        transcript = _sent_text(summarization)
        assert "Be terse." in transcript and "3 passed" in transcript and "Now the README." in transcript

        # the next turn: the compacted window plus a new message; upstream gets the summary, never the blob
        nxt = a.post("/v1/responses", json={"model": "tiny", "input": [
            *payload["output"], {"type": "message", "role": "user", "content": "go on"}]})
        assert nxt.status_code == 200, nxt.text
        sent = up.bodies[-1]
        assert not _is_summarization(sent)
        text = _sent_text(sent)
        assert "encrypted_content" not in text and item["encrypted_content"] not in text
        summary_msgs = [i for i in sent["input"] if SUMMARY_PREFIX[:40] in json.dumps(i)]
        assert len(summary_msgs) == 1 and SUMMARY in json.dumps(summary_msgs[0])
        assert summary_msgs[0]["role"] == "user"
        # stored and listed like any other item
        rid = nxt.json()["id"]
        listed = a.get(f"/v1/responses/{rid}/input_items", params={"order": "asc"}).json()["data"]
        assert [i["type"] for i in listed][-2:] == ["compaction", "message"]
        assert listed[-2]["encrypted_content"] == item["encrypted_content"]
        # ... and by item_reference
        ref = a.post("/v1/responses", json={"model": "tiny", "input": [
            {"type": "item_reference", "id": listed[-2]["id"]}, {"role": "user", "content": "and?"}]})
        assert ref.status_code == 200, ref.text
        assert SUMMARY in _sent_text(up.bodies[-1]) and "encrypted_content" not in _sent_text(up.bodies[-1])


def test_compact_by_previous_response_id_and_the_chain_stops_at_the_compaction(
        gateway: tuple[str, Upstream]) -> None:
    url, up = gateway
    with client(url) as a:
        first = a.post("/v1/responses", json={"model": "tiny", "input": "FIRST-QUESTION about parse()"}).json()
        r = a.post("/v1/responses/compact", json={"model": "tiny", "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        payload = r.json()
        item = _check_compacted(payload)
        transcript = _sent_text(up.summarizations()[0])
        assert "FIRST-QUESTION" in transcript and "Done." in transcript  # the chain's input and output
        second = a.post("/v1/responses", json={"model": "tiny", "input": [
            *payload["output"], {"role": "user", "content": "SECOND"}]}).json()
        a.post("/v1/responses", json={"model": "tiny", "previous_response_id": second["id"],
                                      "input": "THIRD"}).raise_for_status()
        sent = _sent_text(up.bodies[-1])
        # from the compaction item on: its summary, the second turn's message and answer, the new input
        assert SUMMARY in sent and "SECOND" in sent and "THIRD" in sent
        assert "FIRST-QUESTION" not in sent and item["encrypted_content"] not in sent


def test_compact_needs_a_model_and_something_to_compact(gateway: tuple[str, Upstream]) -> None:
    url, up = gateway
    with client(url) as a:
        assert a.post("/v1/responses/compact", json={"input": "x"}).json()["error"]["param"] == "model"
        r = a.post("/v1/responses/compact", json={"model": "tiny"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = a.post("/v1/responses/compact", json={"model": "tiny", "previous_response_id": "resp_" + "0" * 24})
        assert r.status_code == 404
    assert up.bodies == []


# ------------------------------------------------------------------------------ items that do not open


def test_tampered_and_other_owners_items_are_refused_warned_and_counted(gateway: tuple[str, Upstream]) -> None:
    url, up = gateway
    with client(url, KEY_A) as a, client(url, KEY_B) as b:
        item = _check_compacted(a.post("/v1/responses/compact", json={"model": "tiny", "input": HISTORY}).json())
        calls = len(up.bodies)
        blob = item["encrypted_content"]
        tampered = {**item, "encrypted_content": blob[:-6] + ("AAAAAA" if not blob.endswith("AAAAAA") else "BBBBBB")}
        with capture_logs() as logs:
            r1 = a.post("/v1/responses", json={"model": "tiny", "input": [
                {"role": "user", "content": "hi"}, tampered, {"role": "user", "content": "go on"}]})
            r2 = b.post("/v1/responses", json={"model": "tiny", "stream": True, "input": [item]})
            r3 = a.post("/v1/responses", json={"model": "tiny", "input": [{**item, "encrypted_content": "x"}]})
            r4 = b.post("/v1/responses/compact", json={"model": "tiny", "input": [item]})
        for r, param in ((r1, "input[1].encrypted_content"), (r2, "input[0].encrypted_content"),
                         (r3, "input[0].encrypted_content"), (r4, "input[0].encrypted_content")):
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param
            assert err["code"] == "invalid_encrypted_content"
        assert len(up.bodies) == calls  # nothing went upstream
        warnings = [e for e in logs if e["event"] == "compaction_blob_rejected"]
        assert len(warnings) == 4 and all(e["log_level"] == "warning" for e in warnings)
        assert blob not in json.dumps(warnings, default=str)
        metrics = httpx.get(url + "/metrics").text
        assert "responses_gateway_compaction_blobs_rejected_total 4.0" in metrics


# ---------------------------------------------------------------------------------- context_management


def test_context_management_below_the_threshold_compacts_nothing(gateway: tuple[str, Upstream],
                                                                  meter: type[FakeMeter]) -> None:
    url, up = gateway
    meter.tokens = 999
    with client(url) as a:
        r = a.post("/v1/responses", json={"model": "tiny", "input": HISTORY,
                                          "context_management": [{"type": "compaction", "compact_threshold": 1000}]})
        assert r.status_code == 200, r.text
        assert [i["type"] for i in r.json()["output"]] == ["message"]
    [sent] = up.bodies
    assert not _is_summarization(sent) and "context_management" not in sent
    assert "Patch utils.py" in _sent_text(sent)


@pytest.mark.parametrize("stream", [False, True])
def test_context_management_above_the_threshold_compacts_first(gateway: tuple[str, Upstream],
                                                               meter: type[FakeMeter], stream: bool) -> None:
    url, up = gateway
    meter.tokens = 1000
    with client(url) as a:
        r = a.post("/v1/responses", json={"model": "tiny", "input": HISTORY, "stream": stream,
                                          "context_management": [{"type": "compaction", "compact_threshold": 1000}]})
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.content)
            check_stream(events)
            for e in events:
                EVENTS.validate_python(_sdk_usage(e))
            types = [e["type"] for e in events]
            assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.compaction.compacting", "response.output_item.done"]
            compacting = events[3]
            assert compacting["output_index"] == 0 and compacting["item_id"] == events[2]["item"]["id"]
            final = events[-1]["response"]
        else:
            final = r.json()
        Response.model_validate(_sdk_usage(final))
        assert [i["type"] for i in final["output"]] == ["compaction", "message"]
        item = final["output"][0]
        assert final["usage"]["input_tokens"] == 240 and final["usage"]["total_tokens"] == 320  # both passes
        [summarization] = up.summarizations()
        assert "Patch utils.py" in _sent_text(summarization)
        [answer] = up.answers()
        sent = _sent_text(answer)
        # the answer turn: the summary, then the current task from its last user message on
        assert SUMMARY in sent and "Now the README." in sent and "3 passed" not in sent
        # the next turn loads from the compaction item on: nothing it replaced goes upstream again
        meter.tokens = 10
        a.post("/v1/responses", json={"model": "tiny", "previous_response_id": final["id"], "input": "more",
                                      "context_management": [{"type": "compaction", "compact_threshold": 1000}]}
               ).raise_for_status()
        sent = _sent_text(up.bodies[-1])
        assert SUMMARY in sent and "more" in sent and "Patch utils.py" not in sent
        assert item["encrypted_content"] not in sent and len(up.summarizations()) == 1


class HeldSummary(Upstream):
    """Holds the summarization turn until the test releases it (or answers it with ``refuse``'s 400)."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.release = threading.Event()
        self.refuse = refuse

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if _is_summarization(json.loads(request.content)):
            await asyncio.to_thread(self.release.wait, 60)
            if self.refuse:
                self.bodies.append(json.loads(request.content))
                return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 2048",
                                                           "type": "BadRequestError", "code": 400}})
        return self(request)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_streamed_compaction_is_announced_before_the_summary_is_written(tmp_path: Path, meter: type[FakeMeter],
                                                                           refuse: bool) -> None:
    up = HeldSummary(refuse)
    meter.tokens = 5000
    with fresh_store("sqlite", tmp_path) as st, running_gateway(transport=httpx.MockTransport(up.handle),
                                                                 store=st) as url:
        body = {"model": "tiny", "input": HISTORY, "stream": True,
                "context_management": [{"type": "compaction", "compact_threshold": 4000}]}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen: list[str] = []
            for line in lines:  # the opening arrives while the summarization turn is still held upstream
                seen.append(line)
                if "response.compaction.compacting" in line and line.startswith("data:"):
                    break
            assert not up.release.is_set()
            up.release.set()
            rest = list(lines)
    events = sse_events(("\n".join([*seen, *rest]) + "\n").encode())
    check_stream(events)
    for e in events:
        EVENTS.validate_python(_sdk_usage(e))
    added = events[2]
    assert added["type"] == "response.output_item.added" and added["item"]["encrypted_content"] == ""
    final = events[-1]["response"]
    if refuse:  # the stream had begun: it ends with response.failed carrying the upstream's reason
        assert events[-1]["type"] == "response.failed" and "maximum context length" in final["error"]["message"]
        assert up.answers() == []
    else:
        done = events[4]
        assert done["type"] == "response.output_item.done" and done["item"]["id"] == added["item"]["id"]
        assert done["item"]["encrypted_content"] and final["output"][0] == done["item"]
        assert events[-1]["type"] == "response.completed" and len(up.answers()) == 1


def test_context_management_is_checked(gateway: tuple[str, Upstream]) -> None:
    url, up = gateway
    with client(url) as a:
        for value, param in (("x", "context_management"), ([{"type": "other"}], "context_management[0].type"),
                             ([{"type": "compaction", "compact_threshold": -1}],
                              "context_management[0].compact_threshold")):
            r = a.post("/v1/responses", json={"model": "tiny", "input": "hi", "context_management": value})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert up.bodies == []


# ---------------------------------------------------------------------------------- compaction_trigger


@pytest.mark.parametrize("stream", [False, True])
def test_a_compaction_trigger_makes_a_response_of_one_compaction_item(gateway: tuple[str, Upstream],
                                                                      stream: bool) -> None:
    url, up = gateway
    with client(url) as a:
        r = a.post("/v1/responses", json={"model": "tiny", "stream": stream,
                                          "input": [*HISTORY, {"type": "compaction_trigger"}]})
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.content)
            check_stream(events)
            for e in events:
                EVENTS.validate_python(_sdk_usage(e))
            assert "response.compaction.compacting" in [e["type"] for e in events]
            final = events[-1]["response"]
        else:
            final = r.json()
        Response.model_validate(_sdk_usage(final))
        assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["compaction"]
        assert final["usage"]["total_tokens"] == 160
        assert len(up.bodies) == 1 and _is_summarization(up.bodies[0])
        assert "compaction_trigger" not in _sent_text(up.bodies[0])
        nxt = a.post("/v1/responses", json={"model": "tiny", "previous_response_id": final["id"], "input": "next"})
        assert nxt.status_code == 200
        sent = _sent_text(up.bodies[-1])
        assert SUMMARY in sent and "Patch utils.py" not in sent
        bad = a.post("/v1/responses", json={"model": "tiny", "input": [{"type": "compaction_trigger"},
                                                                          {"role": "user", "content": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0]"


def test_a_conversation_keeps_its_compaction_item_and_loads_from_it(gateway: tuple[str, Upstream]) -> None:
    url, up = gateway
    with client(url) as a, client(url, KEY_B) as b:
        cid = a.post("/v1/conversations", json={"items": HISTORY[:1]}).json()["id"]
        a.post("/v1/responses", json={"model": "tiny", "conversation": cid, "input": "OLD-TURN"}).raise_for_status()
        r = a.post("/v1/responses", json={"model": "tiny", "conversation": cid,
                                          "input": [{"type": "compaction_trigger"}]})
        assert r.status_code == 200, r.text
        assert "OLD-TURN" in _sent_text(up.summarizations()[0])
        items = a.get(f"/v1/conversations/{cid}/items", params={"order": "asc"}).json()["data"]
        assert "compaction_trigger" not in [i["type"] for i in items]  # a request, not an item to list
        compaction = [i for i in items if i["type"] == "compaction"]
        assert len(compaction) == 1 and compaction[0]["encrypted_content"] == r.json()["output"][0]["encrypted_content"]
        a.post("/v1/responses", json={"model": "tiny", "conversation": cid, "input": "NEW-TURN"}).raise_for_status()
        sent = _sent_text(up.bodies[-1])
        assert SUMMARY in sent and "NEW-TURN" in sent and "OLD-TURN" not in sent and "Patch utils.py" not in sent
        # another key can neither list it nor use it by reference
        assert b.get(f"/v1/conversations/{cid}/items").status_code == 404
        ref = b.post("/v1/responses", json={"model": "tiny", "input": [{"type": "item_reference",
                                                                       "id": compaction[0]["id"]}]})
        assert ref.status_code == 400 and ref.json()["error"]["code"] == "item_not_found"


def test_compaction_over_the_websocket_with_store_false(meter: type[FakeMeter]) -> None:
    """Codex's way: store false, chained over one WebSocket connection; a trigger compacts, and the next turn
    loads the connection's own history from the compaction item on."""
    up = Upstream()
    with running_gateway(transport=httpx.MockTransport(up)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).responses.connect() as conn:
        conn.response.create(model="tiny", input=HISTORY, store=False)
        first = _until_terminal(conn)[-1].response
        conn.response.create(model="tiny", store=False, previous_response_id=first.id,
                             input=[{"type": "compaction_trigger"}])
        events = _until_terminal(conn)
        assert "response.compaction.compacting" in [e.type for e in events]
        compacted = events[-1].response
        assert [i.type for i in compacted.output] == ["compaction"]
        conn.response.create(model="tiny", store=False, previous_response_id=compacted.id, input="NEXT")
        assert _until_terminal(conn)[-1].type == "response.completed"
    assert "Patch utils.py" in _sent_text(up.summarizations()[0])
    sent = _sent_text(up.bodies[-1])
    assert SUMMARY in sent and "NEXT" in sent and "Patch utils.py" not in sent


def _until_terminal(conn: Any) -> list[Any]:
    out = []
    for event in conn:
        out.append(event)
        if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
            break
    return out


# ------------------------------------------------------------------------------------ the chat upstream


def test_compaction_over_the_chat_upstream_api(tmp_path: Path, meter: type[FakeMeter]) -> None:
    up = Upstream()
    with fresh_store("sqlite", tmp_path) as st, running_gateway(transport=httpx.MockTransport(up), store=st,
                                                                 upstream_api="chat") as url, client(url) as a:
        r = a.post("/v1/responses/compact", json={"model": "tiny", "input": HISTORY})
        assert r.status_code == 200, r.text
        payload = r.json()
        _check_compacted(payload)
        assert payload["usage"]["input_tokens"] == 120
        nxt = a.post("/v1/responses", json={"model": "tiny", "store": False, "input": [
            *payload["output"], {"role": "user", "content": "go on"}]})
        assert nxt.status_code == 200, nxt.text
        sent = up.bodies[-1]
        assert "messages" in sent and SUMMARY in json.dumps(sent["messages"])
        assert "encrypted_content" not in json.dumps(sent)


# ------------------------------------------------------------------------------------ the Agents SDK as judge


def test_agents_sdk_compaction_session_compacts_and_the_next_turn_accepts_it(
        gateway: tuple[str, Upstream], tmp_path: Path) -> None:
    """OpenAIResponsesCompactionSession calls client.responses.compact after a turn (its model-name check wants
    an OpenAI name, which the gateway passes on as it is) and sends the compacted window on the next turn."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, SQLiteSession, set_tracing_disabled
    from agents.memory import OpenAIResponsesCompactionSession

    set_tracing_disabled(True)
    url, up = gateway
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
    agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("tiny", client))
    config = RunConfig(tracing_disabled=True)

    async def chat() -> tuple[list[Any], Any, list[Any]]:
        session = OpenAIResponsesCompactionSession("s1", SQLiteSession("s1", str(tmp_path / "s.db")),
                                                   client=client, model="gpt-4.1",
                                                   should_trigger_compaction=lambda _ctx: True)
        await Runner.run(agent, "FIRST-QUESTION", session=session, run_config=config)
        compacted = await session.get_items()
        second = await Runner.run(agent, "SECOND", session=session, run_config=config)
        return compacted, second, await session.get_items()

    compacted, second, _items = asyncio.run(chat())
    assert any(isinstance(i, dict) and i.get("type") == "compaction" for i in compacted), compacted
    assert second.final_output == "Done."
    assert len(up.summarizations()) >= 1
    turn2 = next(b for b in up.answers() if "SECOND" in _sent_text(b))
    sent = _sent_text(turn2)
    assert SUMMARY in sent and "encrypted_content" not in sent


def test_agents_sdk_context_management_threshold(gateway: tuple[str, Upstream], meter: type[FakeMeter]) -> None:
    """ModelSettings.context_management: the gateway compacts past the threshold; the SDK keeps the compaction
    item and the next turn (store: false, the SDK's own input list) opens it into its summary."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    url, up = gateway
    meter.tokens = 5000
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
    settings = ModelSettings(store=False, context_management=[{"type": "compaction", "compact_threshold": 4000}])
    agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("tiny", client),
                  model_settings=settings)
    config = RunConfig(tracing_disabled=True)

    async def chat() -> tuple[Any, Any]:
        first = await Runner.run(agent, "FIRST-QUESTION", run_config=config)
        meter.tokens = 10
        second = await Runner.run(agent, [*first.to_input_list(), {"role": "user", "content": "SECOND"}],
                                  run_config=config)
        return first, second

    first, second = asyncio.run(chat())
    items = first.to_input_list()
    assert any(isinstance(i, dict) and i.get("type") == "compaction" for i in items), items
    assert second.final_output == "Done."
    sent = _sent_text(up.bodies[-1])
    assert SUMMARY in sent and "SECOND" in sent and "encrypted_content" not in sent
    assert len(up.summarizations()) == 1


def test_an_item_orjson_cannot_write_still_renders_into_the_transcript() -> None:
    """Found by the property above: an unknown item holding an integer past 64 bits (a row another writer stored)
    made the transcript raise TypeError; it is written by the stdlib's JSON instead."""
    text = render_transcript([{"type": "0", "x": -9223372036854775809}])
    assert "-9223372036854775809" in text
