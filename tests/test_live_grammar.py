"""Grammar custom calls under ``tool_choice: auto`` stream live in every enforcement mode.

The paced upstream below is a real loopback HTTP server that writes one frame at a time with a pause between
frames, as vLLM does per token. Its ``/v1/responses`` stream is SYNTHESIZED in vLLM 0.32's framing
(tests/vllm_frames.py); its ``/v1/chat/completions`` stream replays the real vLLM's grammar-constrained answer
recorded in cassettes/vllm/enforce_custom_lark_stream.yaml, frame by frame.

Liveness is judged by arrival order, not by thresholds tuned to a machine: the client's first input delta must
arrive before the upstream has even written the last frame of the call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import lark
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from structlog.testing import capture_logs

from gateway.config import Settings
from gateway.engine import enforcer as runner
from gateway.translate.custom_input import InputDecoder
from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import cassette, running_gateway, serve_in_thread, sse_events
from tests.vllm_frames import VllmStream, args_deltas

RECORDED = load_cassette(cassette("enforce_custom_lark_stream"))
GRAMMAR_REQUEST = RECORDED.interactions[0]
GRAMMAR = GRAMMAR_REQUEST.request_body["structured_outputs"]["grammar"]  # type: ignore[index]
LARK_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
             "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
PACE = 0.015  # seconds between frames


def _frames(body: bytes) -> list[bytes]:
    return [f + b"\n\n" for f in body.split(b"\n\n") if f.strip()]


class PacedUpstream:
    """/v1/responses: a message, then an apply_patch call whose input does NOT match the grammar, paced;
    /v1/chat/completions: the recorded constrained stream, paced (or 404 when ``chat`` is False)."""

    def __init__(self, *, chat: bool = True, invalid_input: str = "*** Begin Patch\nnot a patch at all, sorry") -> None:
        self.chat = chat
        stream = VllmStream().start()
        stream.message("msg_00000000000000b1", ["I will ", "patch ", "it now."])
        stream.call("fc_00000000000000a1", "chatcmpl-tool-00000000000000a1", "apply_patch",
                    args_deltas({"input": invalid_input}, pieces=20))
        self.responses_frames = _frames(stream.complete().body())
        self.nonstream_body = stream.nonstream_body()
        self.chat_frames = _frames(GRAMMAR_REQUEST.body)
        self.last_frame_at: dict[str, float] = {}
        self.sent_at: dict[str, list[float]] = {}  # when each frame was handed to the server, per path
        self.closed_early: dict[str, bool] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    async def paced(self, path: str, frames: list[bytes]) -> StreamingResponse:
        """``frames`` one at a time, PACE apart, each one's hand-over time recorded under ``path``."""
        async def gen():  # type: ignore[no-untyped-def]
            self.closed_early[path] = True
            sent = self.sent_at[path] = []
            for frame in frames:
                yield frame
                self.last_frame_at[path] = time.monotonic()
                sent.append(self.last_frame_at[path])
                await asyncio.sleep(PACE)
            self.closed_early[path] = False

        return StreamingResponse(gen(), media_type="text/event-stream")

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body = orjson.loads(await request.body())
            self.requests.append(("/v1/responses", body))
            if not body.get("stream"):
                return Response(self.nonstream_body, media_type="application/json")
            return await self.paced("/v1/responses", self.responses_frames)

        async def chat(request: Request) -> Any:
            self.requests.append(("/v1/chat/completions", orjson.loads(await request.body())))
            if not self.chat:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return await self.paced("/v1/chat/completions", self.chat_frames)

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"])])


def stream_with_times(url: str, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """Each client event with the monotonic time its bytes arrived."""
    out: list[tuple[float, dict[str, Any]]] = []
    buf = b""
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            now = time.monotonic()
            buf += chunk
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                for ev in sse_events(frame + b"\n\n"):
                    out.append((now, ev))
    return out


def upstream_text_so_far(frames: list[bytes], path: str) -> list[str]:
    """The tool input the upstream had produced after each of its frames (what the client may have seen)."""
    out, text = [], ""
    decoder = InputDecoder()
    for frame in frames:
        data = frame.split(b"data: ", 1)[1].strip()
        if data != b"[DONE]":
            d = orjson.loads(data)
            if path == "/v1/chat/completions":
                text += "".join(c.get("delta", {}).get("content") or "" for c in d.get("choices") or ())
            elif d.get("type") == "response.function_call_arguments.delta":
                text += decoder.feed(d["delta"])
        out.append(text)
    return out


def assert_every_delta_live(timed: list[tuple[float, dict[str, Any]]], up: PacedUpstream, path: str) -> None:
    """Each input delta reached the client before the upstream had written two more frames after the frame that
    produced it: nothing waited for the rest of the call (arrival order against the upstream's own clock)."""
    produced = upstream_text_so_far(up.responses_frames if path == "/v1/responses" else up.chat_frames, path)
    sent = up.sent_at[path]
    seen = ""
    checked = 0
    for arrived, event in timed:
        if event["type"] != "response.custom_tool_call_input.delta":
            continue
        seen += event["delta"]
        j = next(i for i, text in enumerate(produced) if len(text) >= len(seen))  # the frame that produced it
        if j + 2 < len(sent):
            assert arrived < sent[j + 2], f"delta {checked} arrived after upstream frame {j + 2} was written"
            checked += 1
    assert checked > 10


def request_body() -> dict[str, Any]:
    return {"model": "tiny", "input": "Add a file hello.txt saying hi.", "tools": [LARK_TOOL], "tool_choice": "auto",
            "stream": True, "seed": 1}


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


def test_default_mode_is_constrain() -> None:
    assert Settings().tool_choice_enforcement == "constrain"


def test_constrain_streams_a_grammar_call_live_and_it_always_parses() -> None:
    up = PacedUpstream()
    with serve_in_thread(up.app()) as (up_url, _), \
            running_gateway(Settings(upstream_url=up_url, store="none")) as url:
        timed = stream_with_times(url, request_body())
        text = metrics(url)
    events = [e for _, e in timed]
    summary = check_stream(events, request_body())
    message, call = summary["items"]
    assert message["type"] == "message" and call["type"] == "custom_tool_call"
    assert call["id"] == "ctc_00000000000000a1" and call["status"] == "completed"
    lark.Lark(GRAMMAR, parser="earley").parse(call["input"])
    deltas = [(t, e) for t, e in timed if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(e["delta"] for _, e in deltas) == call["input"]
    # live: the first input delta arrived before the upstream had written the call's last frame, and the deltas
    # arrived in many reads, not as one lump at the end
    assert deltas[0][0] < up.last_frame_at["/v1/chat/completions"]
    assert len({t for t, _ in deltas}) > 5
    assert_every_delta_live(timed, up, "/v1/chat/completions")
    # the message text before the call reached the client before the call opened, in order
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.delta") < kinds.index("response.custom_tool_call_input.delta")
    # the upstream's own (invalid) generation was closed once the constrained step answered
    assert up.closed_early["/v1/responses"] is True
    [(_, chat_body)] = [r for r in up.requests if r[0] == "/v1/chat/completions"]
    assert chat_body["structured_outputs"] == {"grammar": GRAMMAR} and chat_body["stream"] is True
    # the conversation plus the assistant text streamed so far
    assert chat_body["messages"][1] == {"role": "assistant", "content": "I will patch it now."}
    assert "not a patch" not in "".join(orjson.dumps(e).decode() for e in events)
    assert 'responses_gateway_tool_choice_enforcement_total{outcome="constrained"} 1.0' in text
    final = events[-1]["response"]
    assert final["usage"]["input_tokens"] == 322 and final["usage"]["output_tokens"] == 231


def test_validate_streams_a_grammar_call_as_it_comes_and_counts_the_mismatch() -> None:
    up = PacedUpstream()
    with serve_in_thread(up.app()) as (up_url, _), capture_logs() as logs, \
            running_gateway(Settings(upstream_url=up_url, store="none", tool_choice_enforcement="validate")) as url:
        timed = stream_with_times(url, request_body())
        text = metrics(url)
    events = [e for _, e in timed]
    summary = check_stream(events, request_body())
    call = summary["items"][1]
    assert call["input"] == "*** Begin Patch\nnot a patch at all, sorry"  # passed on as the model wrote it
    deltas = [(t, e) for t, e in timed if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(e["delta"] for _, e in deltas) == call["input"]
    assert deltas[0][0] < up.last_frame_at["/v1/responses"]
    assert len({t for t, _ in deltas}) > 5
    assert_every_delta_live(timed, up, "/v1/responses")
    assert events[-1]["type"] == "response.completed"  # a mismatch under auto is counted, never failed
    assert 'responses_gateway_tool_choice_enforcement_total{outcome="violated"} 1.0' in text
    assert [p for p, _ in up.requests] == ["/v1/responses"]
    assert any(e.get("outcome") == "violated" for e in logs)
    assert "not a patch" not in repr(logs)


def test_constrain_without_a_chat_endpoint_falls_back_to_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_warned_no_chat", False)
    up = PacedUpstream(chat=False)
    with serve_in_thread(up.app()) as (up_url, _), capture_logs() as logs, \
            running_gateway(Settings(upstream_url=up_url, store="none")) as url:
        first = [e for _, e in stream_with_times(url, request_body())]
        second = [e for _, e in stream_with_times(url, request_body())]
        text = metrics(url)
    for events in (first, second):
        summary = check_stream(events, request_body())
        assert events[-1]["type"] == "response.completed"
        assert summary["items"][1]["input"].startswith("*** Begin Patch\nnot a patch")
    assert 'outcome="fallback_validate"} 2.0' in text
    assert 'outcome="violated"} 2.0' in text
    warned = [e for e in logs if e["event"] == "chat_completions_missing"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"  # once per process


def test_named_tool_choice_without_a_chat_endpoint_is_answered_under_validate_not_404() -> None:
    up = PacedUpstream(chat=False)
    body = {**request_body(), "tool_choice": {"type": "custom", "name": "apply_patch"}}
    with serve_in_thread(up.app()) as (up_url, _), \
            running_gateway(Settings(upstream_url=up_url, store="none")) as url:
        events = [e for _, e in stream_with_times(url, body)]
        r = httpx.post(url + "/v1/responses", json={**body, "stream": False}, timeout=30)
    # the upstream's call does not match the grammar, so validate fails the pinned request clearly
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "tool_choice_violation"
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "failed" and r.json()["error"]["code"] == "tool_choice_violation"
    assert [p for p, _ in up.requests].count("/v1/responses") == 2


def _chat_frames(text: list[str], call_id: str, name: str, args: list[str]) -> list[bytes]:
    """vLLM's /v1/chat/completions stream shape: assistant text, then one tool call whose arguments stream."""
    head = {"id": "chatcmpl-00000000000000c1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + orjson.dumps({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                              "finish_reason": finish}]}) + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": piece}) for piece in text]
    out.append(chunk({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                      "function": {"name": name, "arguments": ""}}]}))
    out += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}) for piece in args]
    out.append(chunk({}, "tool_calls"))
    usage = {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340}
    out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


class PacedChatUpstream(PacedUpstream):
    """``--upstream-api chat``: the answer itself comes from /v1/chat/completions too (a message, then an
    apply_patch call whose input does NOT match the grammar); a request with ``structured_outputs`` (the
    takeover step) gets the recorded constrained stream."""

    def __init__(self) -> None:
        super().__init__()
        self.answer_frames = _chat_frames(["I will ", "patch ", "it now."], "chatcmpl-tool-00000000000000a1",
                                          "apply_patch",
                                          args_deltas({"input": "*** Begin Patch\nnot a patch at all, sorry"},
                                                      pieces=20))

    def app(self) -> Starlette:
        async def chat(request: Request) -> Any:
            body = orjson.loads(await request.body())
            self.requests.append(("/v1/chat/completions", body))
            if "structured_outputs" in body:
                return await self.paced("step", self.chat_frames)
            return await self.paced("answer", self.answer_frames)

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_the_chat_path_grammar_takeover_fires_on_upstream_api_chat() -> None:
    """--upstream-api chat: the upstream's events are built by the gateway (converted chat chunks), and a grammar
    call opening among them is taken over exactly as on the Responses path."""
    up = PacedChatUpstream()
    with serve_in_thread(up.app()) as (up_url, _), \
            running_gateway(Settings(upstream_url=up_url, store="none", upstream_api="chat")) as url:
        timed = stream_with_times(url, request_body())
        text = metrics(url)
    events = [e for _, e in timed]
    summary = check_stream(events, request_body())
    message, call = summary["items"]
    assert message["type"] == "message" and call["type"] == "custom_tool_call"
    assert call["status"] == "completed"
    lark.Lark(GRAMMAR, parser="earley").parse(call["input"])
    assert "not a patch" not in "".join(orjson.dumps(e).decode() for e in events)
    answer, step = [b for _, b in up.requests]
    assert "structured_outputs" not in answer
    assert step["structured_outputs"] == {"grammar": GRAMMAR} and step["stream"] is True
    assert step["messages"][1] == {"role": "assistant", "content": "I will patch it now."}
    assert up.closed_early["answer"] is True  # the upstream's own (invalid) generation was closed
    assert 'responses_gateway_tool_choice_enforcement_total{outcome="constrained"} 1.0' in text
