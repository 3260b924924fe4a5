"""Stateful Responses: store, previous_response_id, retrieval, deletion — through a running gateway."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from gateway.store import SqliteResponseStore
from tests.fake_upstream import serving
from tests.invariants import check_stream
from tests.support import ROOT, free_port, fresh_pg_database, replay, running_gateway, sse_events

PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
PG_DSN = os.environ.get("GATEWAY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def terminal(raw: bytes) -> dict[str, Any]:
    events = sse_events(raw)
    check_stream(events)
    return events[-1]["response"]


def test_three_turn_conversation_with_a_custom_tool_through_previous_response_id(tmp_path: Path) -> None:
    transport = replay("custom_tool_call_strict_nonstream", "continuation_stream", "text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        c = sdk(url)
        r1 = c.responses.create(model="tiny", instructions="Be brief.", input="patch the file", tools=[PATCH],
                                tool_choice={"type": "custom", "name": "apply_patch"})
        [call] = r1.output
        assert call.type == "custom_tool_call"
        # turn 2 streamed: the terminal event's response must already be stored when it arrives
        with httpx.stream("POST", url + "/v1/responses", json={
                "model": "tiny", "previous_response_id": r1.id, "tools": [PATCH], "stream": True,
                "input": [{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."}]}) as r:
            r2 = terminal(r.read())
        assert r2["previous_response_id"] == r1.id
        r3 = c.responses.create(model="tiny", previous_response_id=r2["id"], input="thanks", tools=[PATCH])
        assert r3.previous_response_id == r2["id"]
        stored = c.responses.retrieve(r2["id"])
        assert stored.id == r2["id"] and stored.output[0].type == "message"

    sent = [r["body"] for r in transport.requests]
    assert all(b["store"] is False and "previous_response_id" not in b for b in sent)
    assert sent[0]["instructions"] == "Be brief." and "instructions" not in sent[1]  # not inherited
    turn2 = sent[1]["input"]
    assert [i.get("type") for i in turn2] == ["message", "function_call", "function_call_output"]
    assert turn2[0]["content"][0]["text"] == "patch the file"
    assert turn2[1]["call_id"] == call.call_id and turn2[1]["name"] == "apply_patch"
    assert json.loads(turn2[1]["arguments"]) == {"input": call.input}
    assert turn2[2] == {"type": "function_call_output", "call_id": call.call_id, "output": "Done."}
    turn3 = sent[2]["input"]
    assert [i.get("type") for i in turn3] == ["message", "function_call", "function_call_output", "message",
                                              "message"]
    assert turn3[3]["role"] == "assistant" and turn3[4] == {"type": "message", "role": "user", "content": "thanks"}


def test_endpoints_get_delete_input_items_cancel(tmp_path: Path) -> None:
    transport = replay("custom_tool_call_strict_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        c = sdk(url)
        items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
        r = c.responses.create(model="tiny", input=items, tools=[PATCH], metadata={"k": "v"})
        got = c.responses.retrieve(r.id)
        assert got.model_dump() == r.model_dump()
        assert got.output[0].id.startswith("ctc_") and got.metadata == {"k": "v"}
        page = c.responses.input_items.list(r.id, limit=2, order="asc")
        raw = httpx.get(f"{url}/v1/responses/{r.id}/input_items", params={"limit": 2, "order": "asc"}).json()
        assert [i.id for i in page.data] == [d["id"] for d in raw["data"]] and page.has_more is True
        assert raw["object"] == "list" and len(raw["data"]) == 2 and raw["has_more"] is True
        assert raw["first_id"] == raw["data"][0]["id"] and raw["last_id"] == raw["data"][1]["id"]
        nxt = httpx.get(f"{url}/v1/responses/{r.id}/input_items",
                        params={"limit": 10, "order": "asc", "after": raw["last_id"]}).json()
        # listed in the SDK's item shape: the string content the client sent as an input_text part
        assert [d["content"] for d in nxt["data"]] == [[{"type": "input_text", "text": f"m{i}"}] for i in (2, 3, 4)]
        assert nxt["has_more"] is False
        desc = httpx.get(f"{url}/v1/responses/{r.id}/input_items").json()
        assert [d["content"][0]["text"] for d in desc["data"]] == ["m4", "m3", "m2", "m1", "m0"]
        assert httpx.get(f"{url}/v1/responses/{r.id}", params={"stream": "true"}).status_code == 400
        cancel = httpx.post(f"{url}/v1/responses/{r.id}/cancel")
        assert cancel.status_code == 400 and cancel.json()["error"]["param"] == "response_id"
        deleted = httpx.delete(f"{url}/v1/responses/{r.id}").json()
        assert deleted == {"id": r.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError) as exc:
            c.responses.retrieve(r.id)
        assert exc.value.body["param"] == "response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="tiny", input="x", previous_response_id=r.id)
        assert len(transport.requests) == 1  # the 404 was answered without calling the upstream


def test_store_false_writes_nothing_and_unknown_previous_id_is_404(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.db")
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_nonstream"), store=store) as url:
        c = sdk(url)
        r = c.responses.create(model="tiny", input="x", store=False)
        assert r.store is False
        assert httpx.get(f"{url}/v1/responses/{r.id}").status_code == 404
        err = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x",
                                                      "previous_response_id": "resp_nope"})
        assert err.status_code == 404 and err.json()["error"]["param"] == "previous_response_id"


def test_concurrent_continuations_of_one_parent_both_succeed(tmp_path: Path) -> None:
    transport = replay("text_nonstream", "continuation_nonstream", "continuation_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        parent = sdk(url).responses.create(model="tiny", input="x")

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url) as http:
                return list(await asyncio.gather(*(http.post("/v1/responses", json={
                    "model": "tiny", "input": f"child {i}", "previous_response_id": parent.id}) for i in range(2))))

        children = asyncio.run(both())
        assert [r.status_code for r in children] == [200, 200]
        ids = {r.json()["id"] for r in children}
        for cid in ids:
            assert httpx.get(f"{url}/v1/responses/{cid}").json()["previous_response_id"] == parent.id


def test_agents_sdk_chains_turns_with_previous_response_id(tmp_path: Path) -> None:
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    transport = replay("text_completed_nonstream", "text_completed_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("tiny", client))

        async def chat() -> tuple[Any, Any]:
            first = await Runner.run(agent, "hello", run_config=RunConfig(tracing_disabled=True))
            second = await Runner.run(agent, "and again", previous_response_id=first.last_response_id,
                                      run_config=RunConfig(tracing_disabled=True))
            return first, second

        first, second = asyncio.run(chat())
    assert first.last_response_id and second.last_response_id and first.last_response_id != second.last_response_id
    history = transport.requests[1]["body"]["input"]
    assert history[0]["role"] == "user" and history[1]["role"] == "assistant" and history[-1]["role"] == "user"


# --- real processes ----------------------------------------------------------------------------------------

def _gateway_process(upstream: str, store: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GATEWAY_UPSTREAM_URL": upstream, "GATEWAY_PORT": str(port), "GATEWAY_STORE": store,
           "GATEWAY_LOG_LEVEL": "warning",
           "GATEWAY_TOOL_CHOICE_ENFORCEMENT": "off"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/responses/none", timeout=0.5)
            return proc
        except httpx.TransportError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "gateway exited") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway did not start")


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    """A fresh database on the test PostgreSQL; fails (not skips) when it is down."""
    try:
        with fresh_pg_database(PG_DSN) as dsn:
            yield dsn
    except (OSError, asyncpg.PostgresError) as exc:
        if os.environ.get("GATEWAY_TEST_SKIP_POSTGRES") == "1":
            pytest.skip(f"PostgreSQL unavailable: {exc!r}")
        pytest.fail(f"PostgreSQL at {PG_DSN} did not answer ({exc!r}); .ci/run starts one.", pytrace=False)


@pytest.mark.postgres
def test_two_gateway_processes_sharing_postgres_serve_each_others_chains(pg_dsn: str) -> None:
    transport = replay("custom_tool_call_strict_nonstream", "continuation_nonstream", "text_nonstream")
    with serving(transport) as upstream:
        pa, pb = free_port(), free_port()
        a = _gateway_process(upstream, pg_dsn, pa)
        b = _gateway_process(upstream, pg_dsn, pb)
        try:
            r1 = sdk(f"http://127.0.0.1:{pa}").responses.create(model="tiny", input="patch", tools=[PATCH],
                                                                 tool_choice={"type": "custom", "name": "apply_patch"})
            call = r1.output[0]
            r2 = sdk(f"http://127.0.0.1:{pb}").responses.create(
                model="tiny", previous_response_id=r1.id, tools=[PATCH],
                input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"}])
            r3 = sdk(f"http://127.0.0.1:{pa}").responses.create(model="tiny", previous_response_id=r2.id,
                                                                 input="more")
            assert sdk(f"http://127.0.0.1:{pb}").responses.retrieve(r3.id).previous_response_id == r2.id
        finally:
            for p in (a, b):
                p.terminate()
                p.wait(20)
    turn2 = transport.requests[1]["body"]["input"]
    assert [i["type"] for i in turn2] == ["message", "function_call", "function_call_output"]
    assert len(transport.requests[2]["body"]["input"]) == 5


class _SlowTail(httpx.AsyncBaseTransport):
    """The first request completes; the second streams its first frames and then stalls for a long time."""

    def __init__(self) -> None:
        self.inner = replay("text_stream", "continuation_stream")
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        resp = await self.inner.handle_async_request(request)
        if self.calls == 1:
            return resp
        frames = [c async for c in resp.stream]  # type: ignore[union-attr]

        class Stall(httpx.AsyncByteStream):
            async def __aiter__(self):  # type: ignore[no-untyped-def]
                for f in frames[:4]:
                    yield f
                await asyncio.sleep(3600)

        return httpx.Response(200, headers=resp.headers, stream=Stall())


def test_sigkill_mid_stream_loses_no_completed_response(tmp_path: Path) -> None:
    db = tmp_path / "kill.db"
    with serving(_SlowTail()) as upstream:
        port = free_port()
        proc = _gateway_process(upstream, f"sqlite:///{db}", port)
        try:
            url = f"http://127.0.0.1:{port}"
            with httpx.stream("POST", url + "/v1/responses", json={"model": "tiny", "input": "x", "stream": True}) as r:
                done = terminal(r.read())
            with httpx.stream("POST", url + "/v1/responses", timeout=30, json={
                    "model": "tiny", "input": "y", "stream": True, "previous_response_id": done["id"]}) as r:
                first = next(r.iter_raw())
                assert first.startswith(b"event: response.created")
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        proc2 = _gateway_process(upstream, f"sqlite:///{db}", port)
        try:
            got = httpx.get(f"{url}/v1/responses/{done['id']}")
            assert got.status_code == 200 and got.json()["output"] == done["output"]
        finally:
            proc2.terminate()
            proc2.wait(20)
