"""Write the synthesized cassettes: upstream streams the tiny model cannot be made to produce.

Each is built with tests/vllm_frames.py in vLLM 0.32's exact framing and says SYNTHESIZED in its header.
Run: .venv/bin/python tools/synthesize_cassettes.py  (writes cassettes/synthesized/*.yaml)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vllm_frames import VllmStream, args_deltas  # noqa: E402

OUT = ROOT / "cassettes" / "synthesized"
PATCH = "*** Begin Patch\n*** Add File: caf\u00e9.txt\n+h\u00e9llo \"w\u00f6rld\" \U0001f600\\n\n*** End Patch\n"
SHIM = {"type": "object", "properties": {"input": {"type": "string", "description": "The raw free-form input for this "
        "tool."}}, "required": ["input"], "additionalProperties": False}


def tricky_deltas() -> list[str]:
    """``{"input": PATCH}`` with ASCII escapes, cut inside escapes and surrogate pairs, as a tokenizer might."""
    text = json.dumps({"input": PATCH})
    cuts = [3, 9, 11, 30, 31, 33, 36, 52, 53, 58, 61, 64, 66, 70, 71, 72, 80]
    cuts = [c for c in cuts if c < len(text)]
    out, prev = [], 0
    for c in cuts:
        out.append(text[prev:c])
        prev = c
    out.append(text[prev:])
    return [d for d in out if d]


def write(name: str, description: str, body: bytes, *, stream: bool = True, status: int = 200,
          request: dict | None = None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {
        "interactions": [{
            "request": {"body": json.dumps(request or {"model": "tiny", "stream": stream}), "headers": {},
                        "method": "POST", "uri": "http://127.0.0.1:8011/v1/responses"},
            "response": {"body": {"string": body.decode()},
                         "headers": {"content-type": ["text/event-stream; charset=utf-8" if stream
                                                      else "application/json"]},
                         "status": {"code": status, "message": "OK"}},
        }],
        "version": 1,
    }
    header = (f"# scenario: {name}\n# SYNTHESIZED (not recorded from vLLM): {description}\n"
              "# framing: vLLM 0.32.0's, as in cassettes/vllm/*_stream.yaml (built by tools/synthesize_cassettes.py)\n")
    (OUT / f"{name}.yaml").write_text(header + yaml.safe_dump(doc, allow_unicode=True, width=10_000, sort_keys=False),
                                      encoding="utf-8")


def main() -> None:
    s = VllmStream().start().message("msg_00000000000000a1", ["Let me ", "patch that."])
    s.call("fc_00000000000000b1", "chatcmpl-tool-00000000000000b1", "apply_patch", tricky_deltas(),
           name_in_added=False).complete()
    write("unnamed_call_stream", "a custom-tool call whose name is empty in output_item.added and arrives in "
          "function_call_arguments.done; its input has escapes split across deltas", s.body())

    s = VllmStream().start()
    s.call("fc_00000000000000c1", "chatcmpl-tool-00000000000000c1", "apply_patch", ["", ""], name_in_added=False)
    s.call("fc_00000000000000c2", "chatcmpl-tool-00000000000000c2", "get_weather",
           args_deltas({"city": "Paris"}), name_in_added=False).complete()
    s.frames = [f.replace('"arguments":"","item_id":"fc_00000000000000c1"',
                          '"arguments":"{\\"input\\": \\"x\\"}","item_id":"fc_00000000000000c1"') for f in s.frames]
    write("unnamed_parallel_stream", "two consecutive unnamed calls (a custom and a function), each named only "
          "in function_call_arguments.done", s.body())

    s = VllmStream().start().reasoning("rs_00000000000000d0", ["Think", "ing."])
    s.call("fc_00000000000000d1", "chatcmpl-tool-00000000000000d1", "apply_patch",
           [json.dumps({"input": PATCH})], announce=False)
    s.message("msg_00000000000000d2", ["done"], announce=False).complete()
    write("done_only_stream", "after a full reasoning item, a custom call and a message that arrive only as "
          "output_item.done (no added, no deltas)", s.body())

    s = VllmStream().start()
    s.raw("event: response.output_item.added\ndata: {\"item\": {\"type\": \"function_call\", \n\n")
    s.call("fc_00000000000000e1", "chatcmpl-tool-00000000000000e1", "get_weather", ['{"city"', ': "Oslo"}'])
    s.complete()
    write("malformed_envelope_stream", "a data: line that is not JSON (cut off mid-object) before a normal call",
          s.body())

    s = VllmStream().start()
    s.call("fc_00000000000000f1", "chatcmpl-tool-00000000000000f1", "apply_patch",
           ['{"input": "*** Begin', ' Patch\\n'], args_done=False, item_done=False)
    write("truncated_stream", "the upstream stream stops mid-call: no output_item.done and no response.completed "
          "(vLLM's behaviour when its generator raises)", s.body())

    for name, calls in (("interleaved_two_calls", 2), ("interleaved_three_calls", 3)):
        s = VllmStream().start().message("msg_0000000000000101", ["Checking ", "the weather."])
        s.call("fc_0000000000000102", "chatcmpl-tool-0000000000000102", "get_weather",
               args_deltas({"city": "Paris"}))
        s.message("msg_0000000000000103", ["And ", "a patch."])
        s.call("fc_0000000000000104", "chatcmpl-tool-0000000000000104", "apply_patch",
               args_deltas({"input": PATCH}))
        if calls == 3:
            s.call("fc_0000000000000105", "chatcmpl-tool-0000000000000105", "get_time",
                   args_deltas({"tz": "UTC"}))
        s.complete()
        desc = f"{calls} tool calls (function, custom{', function' if calls == 3 else ''}) interleaved with text"
        write(f"{name}_stream", desc, s.body())
        write(f"{name}_nonstream", desc + " (non-streamed body)", s.nonstream_body(), stream=False)

    s = VllmStream().start()
    s.call("fc_0000000000000201", "chatcmpl-tool-0000000000000201", "crm__get_customer_profile",
           args_deltas({"customer_id": "c-42"}))
    s.call("fc_0000000000000202", "chatcmpl-tool-0000000000000202", "crm__crm_query",
           args_deltas({"input": "SELECT 1"}))
    s.complete()
    desc = "calls of namespace members under their flattened upstream names (ns__member)"
    write("namespace_calls_stream", desc, s.body())
    write("namespace_calls_nonstream", desc + " (non-streamed body)", s.nonstream_body(), stream=False)


if __name__ == "__main__":
    main()
