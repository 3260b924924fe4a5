"""The Conversations API and ``conversation`` on POST /v1/responses, through a running gateway, with the official
SDK, on SQLite and PostgreSQL; plus the store methods underneath."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.conversations import Conversation

from gateway.store import (
    CursorNotFoundError,
    PostgresResponseStore,
    ResponseStore,
    SqliteResponseStore,
    StoredConversation,
)
from tests.conversation_support import BACKENDS, PG_DSN, Renumbered, fresh_store, require_postgres, sdk
from tests.invariants import check_stream
from tests.support import replay, running_gateway, sse_events

PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    with fresh_store(request.param, tmp_path) as st:
        yield st


def terminal(raw: bytes) -> dict[str, Any]:
    events = sse_events(raw)
    check_stream(events)
    return events[-1]["response"]


def test_conversation_lifecycle_two_turns_metadata_item_delete_delete(store: ResponseStore) -> None:
    transport = replay("text_completed_nonstream", "continuation_stream")
    with running_gateway(transport=transport, store=store) as url:
        c = sdk(url)
        conv = c.conversations.create(
            items=[{"type": "message", "role": "user", "content": "Remember: blue."},
                   {"type": "message", "role": "assistant", "content": "Noted.", "id": "msg_given"}],
            metadata={"topic": "colors"})
        assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "colors"}
        assert c.conversations.retrieve(conv.id) == conv

        r1 = c.responses.create(model="tiny", input="What colour?", conversation=conv.id)
        assert r1.conversation is not None and r1.conversation.id == conv.id
        with httpx.stream("POST", url + "/v1/responses", json={
                "model": "tiny", "input": "And again?", "conversation": {"id": conv.id}, "stream": True}) as r:
            r2 = terminal(r.read())
        assert r2["conversation"] == {"id": conv.id}
        assert c.responses.retrieve(r2["id"]).conversation.id == conv.id  # type: ignore[union-attr]

        items = list(c.conversations.items.list(conv.id, order="asc", limit=2))  # the SDK pages with `after`
        assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant")] * 3  # type: ignore[union-attr]
        assert items[1].id == "msg_given" and items[3].id == r1.output[0].id and items[5].id == r2["output"][0]["id"]
        assert items[2].id == c.responses.input_items.list(r1.id).data[0].id  # one id in the response and here
        assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Remember: blue."  # type: ignore[union-attr]
        assert items[1].content[0].type == "output_text" and items[1].status == "completed"  # type: ignore[union-attr]
        assert items[3].content[0].type == "output_text"  # type: ignore[union-attr]

        # What the upstream got as history: the conversation's items (upstream form), then the new input.
        sent = [q["body"] for q in transport.requests]
        assert all("conversation" not in b and b["store"] is False for b in sent)
        turn1, turn2 = sent[0]["input"], sent[1]["input"]
        assert [m["role"] for m in turn1] == ["user", "assistant", "user"]
        assert turn1[0]["content"] == [{"type": "input_text", "text": "Remember: blue."}]
        assert turn1[-1] == {"type": "message", "role": "user", "content": "What colour?"}
        assert [m["role"] for m in turn2] == ["user", "assistant", "user", "assistant", "user"]
        assert turn2[3]["id"] == r1.output[0].id and turn2[3]["content"][0]["text"] == r1.output_text
        assert turn2[-1] == {"type": "message", "role": "user", "content": "And again?"}

        # OpenAI's list shape, desc by default, `after` paging
        page = c.conversations.items.list(conv.id, limit=2)
        assert [i.id for i in page.data] == [items[5].id, items[4].id] and page.has_more is True
        raw = httpx.get(f"{url}/v1/conversations/{conv.id}/items", params={"limit": 3, "after": items[4].id}).json()
        assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"} and raw["object"] == "list"
        assert [d["id"] for d in raw["data"]] == [items[3].id, items[2].id, items[1].id] and raw["has_more"] is True
        assert raw["first_id"] == items[3].id and raw["last_id"] == items[1].id
        rest = httpx.get(f"{url}/v1/conversations/{conv.id}/items",
                         params={"order": "asc", "after": items[3].id}).json()
        assert [d["id"] for d in rest["data"]] == [items[4].id, items[5].id] and rest["has_more"] is False

        got = c.conversations.items.retrieve("msg_given", conversation_id=conv.id)
        assert got.id == "msg_given" and got.content[0].text == "Noted."  # type: ignore[union-attr]

        updated = c.conversations.update(conv.id, metadata={"topic": "colours", "n": "2"})
        assert updated.id == conv.id and updated.created_at == conv.created_at
        assert c.conversations.retrieve(conv.id).metadata == {"topic": "colours", "n": "2"}

        after_delete = c.conversations.items.delete("msg_given", conversation_id=conv.id)
        assert isinstance(after_delete, Conversation) and after_delete.id == conv.id  # OpenAI: the conversation
        assert "msg_given" not in [i.id for i in c.conversations.items.list(conv.id)]
        with pytest.raises(openai.NotFoundError):
            c.conversations.items.retrieve("msg_given", conversation_id=conv.id)
        with pytest.raises(openai.NotFoundError):
            c.conversations.items.delete("msg_given", conversation_id=conv.id)

        deleted = c.conversations.delete(conv.id)
        assert deleted.model_dump() == {"id": conv.id, "object": "conversation.deleted", "deleted": True}
        for call in (lambda: c.conversations.retrieve(conv.id), lambda: c.conversations.items.list(conv.id),
                     lambda: c.conversations.delete(conv.id),
                     lambda: c.conversations.items.retrieve(items[2].id, conversation_id=conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        err = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "conversation": conv.id})
        assert err.status_code == 404 and err.json()["error"]["param"] == "conversation"
        assert len(transport.requests) == 2  # the 404 never reached the upstream


def test_custom_tool_calls_in_a_conversation_keep_ctc_ids(store: ResponseStore) -> None:
    transport = replay("custom_tool_call_strict_nonstream", "continuation_nonstream")
    with running_gateway(transport=transport, store=store) as url:
        c = sdk(url)
        conv = c.conversations.create()
        r1 = c.responses.create(model="tiny", input="patch it", tools=[PATCH], conversation=conv.id,
                                tool_choice={"type": "custom", "name": "apply_patch"})
        [call] = r1.output
        assert call.type == "custom_tool_call" and call.id.startswith("ctc_")
        c.responses.create(model="tiny", tools=[PATCH], conversation={"id": conv.id},
                           input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."}])
        items = list(c.conversations.items.list(conv.id, order="asc"))
        assert [i.type for i in items] == ["message", "custom_tool_call", "custom_tool_call_output", "message"]
        assert items[1].id == call.id and items[1].input == call.input  # type: ignore[union-attr]
    history = transport.requests[1]["body"]["input"]
    assert [i["type"] for i in history] == ["message", "function_call", "function_call_output"]
    assert history[1]["call_id"] == call.call_id and json.loads(history[1]["arguments"]) == {"input": call.input}


def test_store_false_still_appends_and_errors(store: ResponseStore) -> None:
    transport = replay("text_completed_nonstream")
    with running_gateway(transport=transport, store=store) as url:
        c = sdk(url)
        conv = c.conversations.create(items=[{"role": "user", "content": "hi"}])
        r = c.responses.create(model="tiny", input="again", conversation=conv.id, store=False)
        assert httpx.get(f"{url}/v1/responses/{r.id}").status_code == 404  # the response itself is not stored
        assert [i.type for i in c.conversations.items.list(conv.id, order="asc")] == ["message"] * 3

        too_many = httpx.post(url + "/v1/conversations", json={"items": [{"role": "user", "content": "x"}] * 21})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "items"
        too_many = httpx.post(f"{url}/v1/conversations/{conv.id}/items",
                              json={"items": [{"role": "user", "content": "x"}] * 21})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "items"
        both = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "conversation": conv.id,
                                                       "previous_response_id": r.id})
        assert both.status_code == 400 and both.json()["error"]["param"] == "conversation"
        unknown = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "conversation": "conv_nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"] == {"message": "Conversation with id 'conv_nope' not found.",
                                           "type": "invalid_request_error", "param": "conversation",
                                           "code": "not_found"}
        bad = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "conversation": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "conversation"
        cursor = httpx.get(f"{url}/v1/conversations/{conv.id}/items", params={"after": "msg_nope"})
        assert cursor.status_code == 400 and cursor.json()["error"]["param"] == "after"
        for params in ({"limit": 0}, {"limit": 101}, {"order": "up"}):
            assert httpx.get(f"{url}/v1/conversations/{conv.id}/items", params=params).status_code == 400
        assert httpx.post(f"{url}/v1/conversations/{conv.id}", json={}).status_code == 400  # metadata required
        assert httpx.post(url + "/v1/conversations", json={"metadata": {"k": 1}}).status_code == 400
        missing = httpx.get(f"{url}/v1/conversations/{conv.id}/items/msg_nope")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "item_id"
        assert len(transport.requests) == 1


def test_an_item_resent_with_its_id_is_not_duplicated(store: ResponseStore) -> None:
    transport = replay("text_completed_nonstream")
    with running_gateway(transport=transport, store=store) as url:
        c = sdk(url)
        conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "a", "id": "msg_a"}])
        created = c.conversations.items.create(conv.id, items=[
            {"type": "message", "role": "user", "content": "a", "id": "msg_a"},
            {"type": "message", "role": "user", "content": "b"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"}])
        assert created.object == "list" and len(created.data) == 3
        b_id, out_id = created.data[1].id, created.data[2].id
        assert b_id.startswith("msg_") and out_id.startswith("fco_")
        c.conversations.items.create(conv.id, items=[{"type": "item_reference", "id": "msg_a"}])  # the same item
        r = c.responses.create(model="tiny", conversation=conv.id, input=[
            {"type": "message", "role": "user", "content": "b", "id": b_id},  # already in the conversation
            {"type": "message", "role": "user", "content": "c"}])
        ids = [i.id for i in c.conversations.items.list(conv.id, order="asc")]
        assert ids[:3] == ["msg_a", b_id, out_id] and len(ids) == 5 and ids[4] == r.output[0].id
        assert len(set(ids)) == len(ids)


def test_concurrent_turns_on_one_conversation_lose_no_items(store: ResponseStore) -> None:
    n = 5
    # Arrival n waits (n - k) * 0.25 s: the turns finish in the reverse of the order they reached the upstream.
    transport = Renumbered(replay("text_completed_nonstream"), "msg_bd69d9528f59c63c",
                           delays=[(n - k) * 0.25 for k in range(n)])
    with running_gateway(transport=transport, store=store) as url:
        conv = sdk(url).conversations.create()

        async def turns() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                return list(await asyncio.gather(*(http.post("/v1/responses", json={
                    "model": "tiny", "conversation": conv.id, "input": f"turn {i}"}) for i in range(n))))

        answers = asyncio.run(turns())
        assert [a.status_code for a in answers] == [200] * n
        items = list(sdk(url).conversations.items.list(conv.id, order="asc", limit=100))
    assert len(items) == 2 * n
    outputs = {a.json()["output"][0]["id"] for a in answers}
    for k in range(0, 2 * n, 2):  # each turn contiguous: its input, then its output
        user, reply = items[k], items[k + 1]
        assert user.role == "user" and reply.id in outputs  # type: ignore[union-attr]
        assert user.content[0].text == transport.bodies[reply.id]["input"]  # type: ignore[union-attr]
    assert [items[k].id for k in range(1, 2 * n, 2)] == transport.finished  # in completion order
    assert transport.finished == [f"msg_turn{k:04d}" for k in reversed(range(n))]


def test_concurrent_item_appends_keep_batches_whole(store: ResponseStore) -> None:
    with running_gateway(transport=replay("text_completed_nonstream"), store=store) as url:
        conv = sdk(url).conversations.create()

        async def appends() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                return list(await asyncio.gather(*(http.post(f"/v1/conversations/{conv.id}/items", json={"items": [
                    {"type": "message", "role": "user", "content": f"b{b}.{j}"} for j in range(3)]})
                    for b in range(12))))

        assert [r.status_code for r in asyncio.run(appends())] == [200] * 12
        texts = [i.content[0].text for i in sdk(url).conversations.items.list(conv.id, order="asc", limit=100)]  # type: ignore[union-attr]
    assert len(texts) == 36
    for k in range(0, 36, 3):
        batch = texts[k].split(".")[0]
        assert texts[k : k + 3] == [f"{batch}.{j}" for j in range(3)]


def test_agents_sdk_openai_conversations_session_two_turns(store: ResponseStore) -> None:
    from agents import Agent, OpenAIConversationsSession, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    # Both turns complete (the Agents SDK refuses an incomplete one), each with its own message id.
    transport = Renumbered(replay("text_completed_nonstream"), "msg_bd69d9528f59c63c")
    with running_gateway(transport=transport, store=store) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("tiny", client))

        async def chat() -> tuple[Any, Any, list[Any]]:
            session = OpenAIConversationsSession(openai_client=client)
            config = RunConfig(tracing_disabled=True)
            first = await Runner.run(agent, "hello", session=session, run_config=config)
            second = await Runner.run(agent, "and again", session=session, run_config=config)
            return first, second, await session.get_items()

        first, second, items = asyncio.run(chat())
    assert first.final_output and second.final_output is not None
    assert [(i.get("type"), i.get("role")) for i in items] == [("message", "user"), ("message", "assistant")] * 2
    assert items[0]["content"][0]["text"] == "hello" and items[2]["content"][0]["text"] == "and again"
    history = transport.bodies["msg_turn0001"]["input"]
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    assert history[1]["content"][0]["text"] == items[1]["content"][0]["text"]


def test_agents_sdk_server_managed_conversation_id(store: ResponseStore) -> None:
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    # Both turns complete (the Agents SDK refuses an incomplete one), each with its own message id.
    transport = Renumbered(replay("text_completed_nonstream"), "msg_bd69d9528f59c63c")
    with running_gateway(transport=transport, store=store) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("tiny", client))

        async def chat() -> list[Any]:
            conv = await client.conversations.create()
            config = RunConfig(tracing_disabled=True)
            await Runner.run(agent, "hello", conversation_id=conv.id, run_config=config)
            await Runner.run(agent, "and again", conversation_id=conv.id, run_config=config)
            return [i async for i in client.conversations.items.list(conv.id, order="asc")]

        items = asyncio.run(chat())
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant"]
    second = transport.bodies["msg_turn0001"]
    assert [m["role"] for m in second["input"]] == ["user", "assistant", "user"]
    assert "conversation" not in second and [i.id for i in items][1::2] == ["msg_turn0000", "msg_turn0001"]


# --- the store methods ------------------------------------------------------------------------------------

@pytest.fixture(params=BACKENDS)
async def started(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ResponseStore]:
    st: ResponseStore
    if request.param == "sqlite":
        st = SqliteResponseStore(tmp_path / "s.db")
    else:
        await asyncio.to_thread(require_postgres)
        st = PostgresResponseStore(PG_DSN, schema="conv_" + uuid.uuid4().hex[:12], max_size=8)
    await st.start()
    try:
        yield st
    finally:
        await st.close()
        if isinstance(st, PostgresResponseStore):
            import asyncpg

            conn = await asyncpg.connect(PG_DSN)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{st.schema}" CASCADE')
            finally:
                await conn.close()


def _msg(i: str) -> dict[str, Any]:
    return {"type": "message", "id": i, "role": "user", "content": [{"type": "input_text", "text": i}]}


async def test_store_conversation_methods(started: ResponseStore) -> None:
    st = started
    await st.create_conversation(StoredConversation("conv_a", 100, 100, {"k": "v"}, owner="o1"), [_msg("m0")])
    assert await st.get_conversation("conv_a") == StoredConversation("conv_a", 100, 100, {"k": "v"}, "o1")
    assert await st.get_conversation("conv_a", owner="o1") is not None
    assert await st.get_conversation("conv_a", owner="o2") is None
    assert await st.append_conversation_items("conv_a", [_msg("m1"), _msg("m0"), _msg("m2")], 150, owner="o1")
    assert not await st.append_conversation_items("conv_a", [_msg("m9")], 150, owner="o2")
    assert not await st.append_conversation_items("conv_nope", [_msg("m9")], 150)
    assert [i["id"] for i in await st.get_conversation_items("conv_a") or []] == ["m0", "m1", "m2"]
    assert await st.get_conversation_items("conv_a", owner="o2") is None
    assert await st.list_conversation_items("conv_a", limit=2) == ([_msg("m2"), _msg("m1")], True)
    assert await st.list_conversation_items("conv_a", limit=2, after="m1") == ([_msg("m0")], False)
    assert await st.list_conversation_items("conv_a", limit=5, order="asc", after="m0") == ([_msg("m1"), _msg("m2")],
                                                                                            False)
    with pytest.raises(CursorNotFoundError):
        await st.list_conversation_items("conv_a", limit=2, after="nope")
    assert await st.list_conversation_items("conv_a", limit=2, owner="o2") is None
    assert await st.get_conversation_item("conv_a", "m1") == _msg("m1")
    assert await st.get_conversation_item("conv_a", "m1", owner="o2") is None
    assert await st.get_items(["m1"], owner="o1") == {"m1": _msg("m1")}  # item_reference finds conversation items
    assert await st.get_items(["m1"], owner="o2") == {}
    assert not await st.delete_conversation_item("conv_a", "m1", 160, owner="o2")
    assert await st.delete_conversation_item("conv_a", "m1", 160, owner="o1")
    assert not await st.delete_conversation_item("conv_a", "m1", 160)
    updated = await st.update_conversation("conv_a", {"k": "w"}, 170)
    assert updated == StoredConversation("conv_a", 100, 170, {"k": "w"}, "o1")
    assert await st.update_conversation("conv_a", {}, 170, owner="o2") is None
    assert not await st.delete_conversation("conv_a", owner="o2")
    assert await st.delete_conversation("conv_a", owner="o1")
    assert await st.get_conversation_items("conv_a") is None
    assert await st.get_items(["m0"]) == {}  # its items went with it
    assert not await st.delete_conversation("conv_a")


async def test_store_concurrent_appends_and_sweep(started: ResponseStore) -> None:
    st = started
    await st.create_conversation(StoredConversation("conv_c", 100, 100, {}), [])
    batches = [[_msg(f"b{b}.{j}") for j in range(4)] for b in range(16)]
    assert all(await asyncio.gather(*(st.append_conversation_items("conv_c", batch, 200) for batch in batches)))
    ids = [i["id"] for i in await st.get_conversation_items("conv_c") or []]
    assert len(ids) == 64
    for k in range(0, 64, 4):
        b = ids[k].split(".")[0]
        assert ids[k : k + 4] == [f"{b}.{j}" for j in range(4)]

    await st.create_conversation(StoredConversation("conv_old", 100, 100, {}), [_msg("o1")])
    now = int(time.time())
    assert await st.sweep(150) == 1  # conv_c was updated at 200: kept
    assert await st.get_conversation("conv_old") is None and await st.get_items(["o1"]) == {}
    assert await st.get_conversation("conv_c") is not None
    assert await st.sweep(now) == 1
    assert await st.get_conversation_items("conv_c") is None
