"""The README's quick start: ``responses-gateway demo`` serves a custom tool call out of the box."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai

from tests.support import ROOT, free_port


@contextlib.contextmanager
def demo_client() -> Iterator[openai.OpenAI]:
    """``responses-gateway demo`` as a newcomer starts it (no GATEWAY_* variables), and an SDK client for it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "demo", "--port", str(port), "--drain-timeout", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "demo did not start"
                time.sleep(0.1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    finally:
        proc.terminate()
        proc.wait(30)


def test_demo_serves_custom_tools_and_chaining_out_of_the_box() -> None:
    with demo_client() as client:
        resp = client.responses.create(
            model="tiny", input="Fix the bug.",
            tools=[{"type": "custom", "name": "apply_patch", "description": "Apply a patch."}],
            tool_choice={"type": "custom", "name": "apply_patch"})
        [call] = resp.output
        assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.id.startswith("ctc_")
        follow = client.responses.create(model="tiny", previous_response_id=resp.id, input=[
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."}])
        assert follow.status == "completed" and follow.previous_response_id == resp.id
        with client.responses.stream(model="tiny", input="hi", tools=[{"type": "custom", "name": "run_sql"}],
                                     tool_choice="required") as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        assert final.output[0].type == "custom_tool_call" and final.output[0].name == "run_sql"


def test_demo_runs_an_mcp_round_trip_on_its_built_in_server() -> None:
    with demo_client() as client:
        with client.responses.stream(model="tiny", input="What is 2 + 3?",
                                     tools=[{"type": "mcp", "server_label": "demo"}]) as stream:  # type: ignore[list-item,typeddict-item]
            for _ in stream:
                pass
            resp = stream.get_final_response()
        kinds = [o.type for o in resp.output]
        assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message", kinds
        assert resp.output[1].name == "add" and resp.output[1].output == "5"  # type: ignore[union-attr]
