"""The OpenAI Agents SDK (Python) with its built-in client tools against the gateway: ``ApplyPatchTool`` (an editor
writing into a temp folder), ``ShellTool`` and ``LocalShellTool`` (executors that record what they were asked).
The SDK's own parsers and runners are the judges.

The upstream is SYNTHESIZED in vLLM 0.32's /v1/responses framing (tests/test_js_clients.Upstream, built on
tests/vllm_frames.py from the recorded cassettes): each turn answers the next scripted call once the previous
call's output is in the input.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ApplyPatchTool,
    LocalShellCommandRequest,
    LocalShellTool,
    OpenAIResponsesModel,
    Runner,
    ShellCommandOutput,
    ShellCommandRequest,
    ShellResult,
    ShellTool,
    set_tracing_disabled,
)
from agents.apply_diff import apply_diff
from agents.editor import ApplyPatchOperation, ApplyPatchResult

from gateway.store import SqliteResponseStore
from tests.support import npm_packages, running_gateway
from tests.test_js_clients import JS, ScriptedVllm, Upstream, _hex, run_js
from tests.vllm_frames import args_deltas

CREATE = {"operation": {"type": "create_file", "path": "notes.txt", "diff": "+hello\n+world\n"}}
UPDATE = {"operation": {"type": "update_file", "path": "notes.txt", "diff": "@@\n hello\n-world\n+gateway\n"}}
SHELL = {"action": {"commands": ["cat notes.txt"], "timeout_ms": 2000}}
LOCAL = {"action": {"command": ["echo", "hi"], "env": {"LANG": "C"}}}
SCRIPT: list[tuple[str, dict[str, Any]]] = [("apply_patch", CREATE), ("apply_patch", UPDATE), ("shell", SHELL),
                                            ("local_shell", LOCAL)]


def _outputs(body: dict[str, Any]) -> int:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    return sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")


def scripted(body: dict[str, Any], resp: ScriptedVllm) -> None:
    step = _outputs(body)
    if step < len(SCRIPT):
        name, args = SCRIPT[step]
        resp.call(f"fc_{_hex()}", f"call_{_hex()}", name, args_deltas(args, 6))
    else:
        resp.message(f"msg_{_hex()}", ["All ", "done."])


class FolderEditor:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ops: list[tuple[str, str]] = []

    def create_file(self, op: ApplyPatchOperation) -> ApplyPatchResult:
        self.ops.append(("create_file", op.path))
        (self.root / op.path).write_text(apply_diff("", op.diff or "", mode="create"))
        return ApplyPatchResult(status="completed", output=f"created {op.path}")

    def update_file(self, op: ApplyPatchOperation) -> ApplyPatchResult:
        self.ops.append(("update_file", op.path))
        target = self.root / op.path
        target.write_text(apply_diff(target.read_text(), op.diff or ""))
        return ApplyPatchResult(status="completed", output=f"updated {op.path}")

    def delete_file(self, op: ApplyPatchOperation) -> ApplyPatchResult:
        self.ops.append(("delete_file", op.path))
        return ApplyPatchResult(status="failed", output="not allowed")


def test_agents_sdk_streamed_run_patches_a_file_and_runs_commands(tmp_path: Path) -> None:
    set_tracing_disabled(True)
    editor = FolderEditor(tmp_path)
    shell_asked: list[list[str]] = []
    local_asked: list[list[str]] = []

    def run_shell(request: ShellCommandRequest) -> ShellResult:
        shell_asked.append(list(request.data.action.commands))
        return ShellResult(output=[ShellCommandOutput(stdout=(tmp_path / "notes.txt").read_text(), stderr="")])

    def run_local(request: LocalShellCommandRequest) -> str:
        local_asked.append(list(request.data.action.command))
        return json.dumps({"stdout": "hi\n", "exit_code": 0})

    upstream = Upstream(scripted)

    async def run(url: str) -> tuple[Any, list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="test", max_retries=0)
        agent = Agent(name="coder", instructions="Edit files.",
                      model=OpenAIResponsesModel(model="tiny", openai_client=client),
                      tools=[ApplyPatchTool(editor=editor), ShellTool(executor=run_shell),
                             LocalShellTool(executor=run_local)])
        result = Runner.run_streamed(agent, "Create notes.txt, fix it, then show it.", max_turns=8)
        raw_types: list[str] = []
        items: list[str] = []
        async for event in result.stream_events():
            if event.type == "raw_response_event":
                raw_types.append(event.data.type)
            elif event.type == "run_item_stream_event":
                raw = event.item.raw_item
                items.append(f"{event.name}:{raw.get('type') if isinstance(raw, dict) else raw.type}")
        return result, raw_types, items

    with running_gateway(transport=upstream.transport) as url:
        result, raw_types, items = asyncio.run(run(url))

    assert result.final_output == "All done."
    assert editor.ops == [("create_file", "notes.txt"), ("update_file", "notes.txt")]
    assert (tmp_path / "notes.txt").read_text() == "hello\ngateway"  # apply_diff's own result
    assert shell_asked == [["cat notes.txt"]] and local_asked == [["echo", "hi"]]
    # the diff streamed as OpenAI streams it; the calls reached the SDK as its built-in items
    assert "response.apply_patch_call_operation_diff.delta" in raw_types
    assert "response.apply_patch_call_operation_diff.done" in raw_types
    for kind in ("apply_patch_call", "shell_call", "local_shell_call"):
        assert f"tool_called:{kind}" in items, items
    assert "tool_output:apply_patch_call_output" in items and "tool_output:shell_call_output" in items, items
    # vLLM was offered functions and got each call back with its output, as function call + output
    first = upstream.requests[0]
    assert {t["name"] for t in first["tools"]} == {"apply_patch", "shell", "local_shell"}
    assert all(t["type"] == "function" for t in first["tools"])
    last = upstream.requests[-1]["input"]
    calls = [i for i in last if i.get("type") == "function_call"]
    assert [c["name"] for c in calls] == ["apply_patch", "apply_patch", "shell", "local_shell"]
    assert json.loads(calls[1]["arguments"]) == UPDATE
    outs = [i for i in last if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outs] == [c["call_id"] for c in calls]
    assert "gateway" in outs[2]["output"] and '"stdout": "hi\\n"' in outs[3]["output"]


# --- the Vercel AI SDK (tests/js, the judges' pinned packages) ----------------------------------------------------

AI_SDK_SCRIPT: list[tuple[str, dict[str, Any]]] = [("apply_patch", CREATE), ("shell", {"action": {"commands": [
    "cat notes.txt"]}})]


@pytest.fixture(scope="module")
def js_clients() -> Path:
    npm_packages(JS, "the JavaScript client tests")
    return JS


@pytest.mark.parametrize("mode", ["stream", "generate"])
def test_ai_sdk_apply_patch_and_shell_in_a_tool_loop(js_clients: Path, tmp_path: Path, mode: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_SDK_MODE", mode)  # streamText, or generateText (non-streamed responses)
    def answer(body: dict[str, Any], resp: ScriptedVllm) -> None:
        step = _outputs(body)
        if step < len(AI_SDK_SCRIPT):
            name, args = AI_SDK_SCRIPT[step]
            resp.call(f"fc_{_hex()}", f"call_{_hex()}", name, args_deltas(args, 6))
        else:
            resp.message(f"msg_{_hex()}", ["Done."])

    upstream = Upstream(answer)
    with running_gateway(transport=upstream.transport, store=SqliteResponseStore(tmp_path / "r.db")) as url:
        seen = run_js(js_clients, "ai_sdk_builtin_tools.mjs", url)
    assert seen.get("error") is None and seen["errors"] == [], seen
    assert seen["toolTypes"] == ["apply_patch", "shell"], seen
    [patch] = seen["patches"]
    assert patch["operation"] == CREATE["operation"], seen
    assert seen["commands"] == [["cat notes.txt"]], seen
    assert [c["toolName"] for c in seen["toolCalls"]] == ["apply_patch", "shell"], seen
    assert not any(c["invalid"] for c in seen["toolCalls"]), seen
    assert seen["toolCalls"][0]["itemId"].startswith("apc_") and seen["toolCalls"][1]["itemId"].startswith("sh_")
    if mode == "stream":  # the AI SDK rebuilt the apply_patch input from the streamed diff deltas
        assert json.loads("".join(seen["inputDeltas"]))["operation"] == CREATE["operation"], seen
    assert seen["text"] == "Done." and seen["finishReason"] == "stop", seen
    assert all(r["status"] == 200 for r in seen["requests"]) and len(seen["requests"]) == 3, seen
    assert all(bool(r.get("stream")) is (mode == "stream") for r in upstream.requests)
    assert "apply_patch_call_output" in seen["requests"][1]["inputTypes"], seen
    assert "shell_call_output" in seen["requests"][2]["inputTypes"], seen
    # vLLM got both calls back with their outputs as function calls
    last = upstream.requests[-1]["input"]
    assert [i["name"] for i in last if i.get("type") == "function_call"] == ["apply_patch", "shell"], last
    assert sum(1 for i in last if i.get("type") == "function_call_output") == 2, last


def test_openai_python_stream_helper_accumulates_the_builtin_calls() -> None:
    def answer(body: dict[str, Any], resp: ScriptedVllm) -> None:
        resp.call("fc_1", "call_1", "apply_patch", args_deltas(CREATE, 5))
        resp.call("fc_2", "call_2", "shell", args_deltas({"action": {"commands": ["ls", "pwd"]}}, 5))

    upstream = Upstream(answer)
    with running_gateway(transport=upstream.transport) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with client.responses.stream(model="tiny", input="go", tools=[
                {"type": "apply_patch"}, {"type": "shell", "environment": {"type": "local"}}]) as stream:
            types = {e.type for e in stream}
            final = stream.get_final_response()
    assert {"response.apply_patch_call_operation_diff.delta", "response.shell_call_command.done"} <= types
    patch, shell = final.output
    assert patch.type == "apply_patch_call" and patch.operation.type == "create_file"
    assert patch.operation.diff == CREATE["operation"]["diff"]  # type: ignore[union-attr]
    assert shell.type == "shell_call" and shell.action.commands == ["ls", "pwd"]
