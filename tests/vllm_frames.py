"""Build upstream streams in vLLM 0.32's exact framing, for scenarios the tiny model cannot produce.

Key order, compact JSON, ``event:``/``data:`` lines and the trailing blank line follow the recorded
cassettes (cassettes/vllm/*_stream.yaml); the response object template is taken from one of them.
Everything built here is synthesized and is labelled so wherever it is written down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.upstream.replay import load_cassette

ROOT = Path(__file__).resolve().parents[1]


def _dumps(obj: Any) -> str:
    # vLLM serializes with pydantic: compact separators, non-ASCII kept as is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _template() -> dict[str, Any]:
    body = load_cassette(ROOT / "cassettes/vllm/function_call_stream.yaml").interactions[0].body.decode()
    first = body.split("\n\n")[0]
    return json.loads(first.split("data: ", 1)[1])["response"]


class VllmStream:
    def __init__(self, response_id: str = "resp_5y7h0000000000aa", tools: list[dict[str, Any]] | None = None) -> None:
        self.seq = 0
        self.index = 0
        self.frames: list[str] = []
        self.output: list[dict[str, Any]] = []
        self.response = _template()
        self.response.update(id=response_id, tools=tools or [], tool_choice="auto", output=[], status="in_progress")

    def event(self, etype: str, payload: dict[str, Any]) -> None:
        payload = {**payload, "sequence_number": self.seq, "type": etype}
        self.seq += 1
        self.frames.append(f"event: {etype}\ndata: {_dumps(payload)}\n\n")

    def raw(self, text: str) -> None:
        self.frames.append(text)

    def start(self) -> VllmStream:
        self.event("response.created", {"response": dict(self.response)})
        self.event("response.in_progress", {"response": dict(self.response)})
        return self

    def message(self, item_id: str, deltas: list[str], *, announce: bool = True) -> VllmStream:
        idx = self.index
        self.index += 1
        text = "".join(deltas)
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        done = {"id": item_id, "content": [part], "role": "assistant", "status": "completed", "type": "message",
                "phase": None}
        if announce:
            self.event("response.output_item.added", {"item": {**done, "content": [], "status": "in_progress"},
                                                      "output_index": idx})
            self.event("response.content_part.added", {
                "content_index": 0, "item_id": item_id, "output_index": idx,
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})
            for d in deltas:
                self.event("response.output_text.delta", {"content_index": 0, "delta": d, "item_id": item_id,
                                                          "logprobs": [], "output_index": idx})
            self.event("response.output_text.done", {"content_index": 0, "item_id": item_id, "logprobs": [],
                                                     "output_index": idx, "text": text})
            self.event("response.content_part.done", {"content_index": 0, "item_id": item_id, "output_index": idx,
                                                      "part": part})
        self.event("response.output_item.done", {"item": done, "output_index": idx})
        self.output.append(done)
        return self

    def reasoning(self, item_id: str, deltas: list[str]) -> VllmStream:
        idx = self.index
        self.index += 1
        text = "".join(deltas)
        self.event("response.output_item.added", {"item": {"id": item_id, "summary": [], "type": "reasoning",
                                                           "content": None, "encrypted_content": None,
                                                           "status": "in_progress"}, "output_index": idx})
        self.event("response.content_part.added", {"content_index": 0, "item_id": item_id, "output_index": idx,
                                                   "part": {"text": "", "type": "reasoning_text"}})
        for d in deltas:
            self.event("response.reasoning_text.delta", {"content_index": 0, "delta": d, "item_id": item_id,
                                                         "output_index": idx})
        self.event("response.reasoning_text.done", {"content_index": 0, "item_id": item_id, "output_index": idx,
                                                    "text": text})
        self.event("response.content_part.done", {"content_index": 0, "item_id": item_id, "output_index": idx,
                                                  "part": {"text": text, "type": "reasoning_text"}})
        done = {"id": item_id, "summary": [], "type": "reasoning",
                "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None, "status": None}
        self.event("response.output_item.done", {"item": done, "output_index": idx})
        self.output.append(done)
        return self

    def call(self, item_id: str, call_id: str, name: str, deltas: list[str], *, name_in_added: bool = True,
             announce: bool = True, args_done: bool = True, item_done: bool = True) -> VllmStream:
        idx = self.index
        self.index += 1
        arguments = "".join(deltas)
        base = {"arguments": "", "call_id": call_id, "name": name if name_in_added else "", "type": "function_call",
                "id": item_id, "async": None, "caller": None, "namespace": None, "status": "in_progress"}
        done = {**base, "arguments": arguments, "name": name, "status": "completed"}
        if announce:
            self.event("response.output_item.added", {"item": base, "output_index": idx})
            for d in deltas:
                self.event("response.function_call_arguments.delta", {"delta": d, "item_id": item_id,
                                                                      "output_index": idx})
            if args_done:
                self.event("response.function_call_arguments.done", {"arguments": arguments, "item_id": item_id,
                                                                     "output_index": idx, "name": name})
        if item_done:
            self.event("response.output_item.done", {"item": done, "output_index": idx})
        self.output.append(done)
        return self

    def complete(self, status: str = "completed") -> VllmStream:
        resp = {**self.response, "status": status, "output": self.output,
                "usage": {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": 40, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 160}}
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        self.event("response.completed", {"response": resp})
        return self

    def body(self) -> bytes:
        return "".join(self.frames).encode()

    def nonstream_body(self) -> bytes:
        resp = {**self.response, "status": "completed", "output": self.output,
                "usage": {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": 40, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 160}}
        return _dumps(resp).encode()


def args_deltas(value: dict[str, Any] | str, pieces: int = 7) -> list[str]:
    """vLLM-style argument deltas: the JSON text cut into uneven pieces (here, evenly by count)."""
    text = json.dumps(value) if not isinstance(value, str) else value
    step = max(1, len(text) // pieces)
    return [text[i : i + step] for i in range(0, len(text), step)]
