"""Write synthesized /v1/chat/completions cassettes: chat answers the tiny model cannot give (it has no
reasoning parser), in vLLM 0.32's exact chunk framing (key order, compact JSON, ``data:`` lines without
``event:``, the usage chunk, ``data: [DONE]``, as in cassettes/vllm/chat_*_stream.yaml).

Each file says SYNTHESIZED in its header. Run: .venv/bin/python tools/synthesize_chat_cassettes.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parents[1] / "cassettes" / "synthesized"
CREATED = 1795973037
FINGERPRINT = "vllm-0.32.0-ed9cb571"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class ChatStream:
    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.frames: list[str] = []
        self.chunk({"role": "assistant", "content": ""}, first=True)

    def chunk(self, delta: dict[str, Any], *, finish: str | None = None, first: bool = False) -> ChatStream:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        if not first:
            choice["token_ids"] = None
        obj: dict[str, Any] = {"id": self.cid, "object": "chat.completion.chunk", "created": CREATED, "model": "tiny",
                               "choices": [choice]}
        if first:
            obj.update(prompt_token_ids=None, prompt_text=None)
        self.frames.append(f"data: {_dumps(obj)}\n\n")
        return self

    def usage(self, prompt: int, completion: int) -> ChatStream:
        obj = {"id": self.cid, "object": "chat.completion.chunk", "created": CREATED, "model": "tiny", "choices": [],
               "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                         "completion_tokens": completion}, "system_fingerprint": FINGERPRINT}
        self.frames.append(f"data: {_dumps(obj)}\n\n")
        return self

    def raw(self, text: str) -> ChatStream:
        self.frames.append(text)
        return self

    def body(self) -> str:
        return "".join(self.frames) + "data: [DONE]\n\n"


def completion(cid: str, *, content: str | None, reasoning: str | None, tool_calls: list[dict[str, Any]] | None,
               finish: str, prompt: int, completion_tokens: int) -> str:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                           "audio": None, "function_call": None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    msg["reasoning"] = reasoning
    return _dumps({
        "id": cid, "object": "chat.completion", "created": CREATED, "model": "tiny",
        "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                     "token_ids": None, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": FINGERPRINT,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                  "completion_tokens": completion_tokens, "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
        "ec_transfer_params": None, "metrics": None})


def write(name: str, description: str, body: str, request: dict[str, Any], *, stream: bool) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {
        "interactions": [{
            "request": {"body": json.dumps(request), "headers": {}, "method": "POST",
                        "uri": "http://127.0.0.1:8011/v1/chat/completions"},
            "response": {"body": {"string": body},
                         "headers": {"content-type": ["text/event-stream; charset=utf-8" if stream
                                                      else "application/json"]},
                         "status": {"code": 200, "message": "OK"}},
        }],
        "version": 1,
    }
    header = (f"# scenario: {name}\n# SYNTHESIZED (not recorded from vLLM): {description}\n"
              "# framing: vLLM 0.32.0's /v1/chat/completions, as in cassettes/vllm/chat_*.yaml "
              "(built by tools/synthesize_chat_cassettes.py)\n")
    (OUT / f"{name}.yaml").write_text(header + yaml.safe_dump(doc, allow_unicode=True, width=10_000, sort_keys=False),
                                      encoding="utf-8")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def main() -> None:
    text_req = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
                "stream_options": {"include_usage": True}}
    s = ChatStream("chatcmpl-5y7h0000000000r1")
    for piece in ["The user ", "wants a ", "greeting."]:
        s.chunk({"reasoning": piece})
    for piece in ["Hel", "lo!"]:
        s.chunk({"content": piece})
    s.chunk({}, finish="stop").usage(20, 9)
    write("chat_reasoning_stream", "a reasoning model's chat stream: `reasoning` deltas, then content, stop, usage",
          s.body(), text_req, stream=True)
    write("chat_reasoning_nonstream", "the same answer non-streamed: message.reasoning and message.content",
          completion("chatcmpl-5y7h0000000000r2", content="Hello!", reasoning="The user wants a greeting.",
                     tool_calls=None, finish="stop", prompt=20, completion_tokens=9),
          {k: v for k, v in text_req.items() if k not in ("stream", "stream_options")}, stream=False)

    call_req = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                "stream": True, "stream_options": {"include_usage": True}}
    s = ChatStream("chatcmpl-5y7h0000000000r3")
    s.chunk({"reasoning": "I should call get_weather."})
    s.chunk({"content": None, "tool_calls": [{"id": "chatcmpl-tool-5y7h0000000000c1", "type": "function", "index": 0,
                                              "function": {"name": "get_weather"}}]})
    for piece in ['{"city"', ': "Pa', 'ris"}']:
        s.chunk({"content": None, "tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    s.chunk({"content": None, "tool_calls": [{"id": "chatcmpl-tool-5y7h0000000000c2", "type": "function", "index": 1,
                                              "function": {"name": "get_weather"}}]})
    s.chunk({"content": None, "tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Rome"}'}}]})
    s.chunk({}, finish="tool_calls").usage(180, 30)
    write("chat_reasoning_calls_stream", "reasoning, then two parallel tool calls (hermes framing: name first, "
          "then argument chunks carrying only the index), finish tool_calls", s.body(), call_req, stream=True)
    write("chat_reasoning_calls_nonstream", "the same answer non-streamed",
          completion("chatcmpl-5y7h0000000000r4", content=None, reasoning="I should call get_weather.",
                     tool_calls=[{"id": "chatcmpl-tool-5y7h0000000000c1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                                 {"id": "chatcmpl-tool-5y7h0000000000c2", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}],
                     finish="tool_calls", prompt=180, completion_tokens=30),
          {k: v for k, v in call_req.items() if k not in ("stream", "stream_options")}, stream=False)

    s = ChatStream("chatcmpl-5y7h0000000000r5")
    s.chunk({"content": "Hel"})
    error = {"object": "error", "message": "EngineCore encountered an issue.", "type": "InternalServerError",
             "param": None, "code": 500}
    s.raw(f"data: {_dumps({'error': error})}\n\n")
    write("chat_error_midstream_stream", "an engine error after the first content chunk: vLLM's mid-stream "
          "`data: {\"error\": ...}` chunk, then [DONE]", s.body(), text_req, stream=True)


if __name__ == "__main__":
    main()
