"""Ownership under gateway API keys: one key's responses, items and conversations are invisible to another
key through every endpoint (each answers exactly as for an unknown id), while the owner sees them."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.auth import ApiKeyAuth
from gateway.store import ResponseStore, SqliteResponseStore
from tests.conversation_support import BACKENDS, fresh_store
from tests.support import replay, running_gateway

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    with fresh_store(request.param, tmp_path) as st:
        yield st


def client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30)


def same_as_unknown(call: Callable[[str], httpx.Response], real: str, fake: str) -> httpx.Response:
    """``call`` with another owner's id answers exactly what it answers for an id that does not exist."""
    theirs, unknown = call(real), call(fake)
    assert theirs.status_code == unknown.status_code, (theirs.text, unknown.text)
    assert theirs.text.replace(real, "ID") == unknown.text.replace(fake, "ID")
    return theirs


def test_two_keys_cannot_see_each_others_objects_through_any_endpoint(store: ResponseStore) -> None:
    transport = replay("custom_tool_call_strict_nonstream", "text_completed_nonstream", "continuation_nonstream",
                       "text_nonstream", "length_cutoff_nonstream")
    with running_gateway(transport=transport, store=store, api_keys=(KEY_A, KEY_B)) as url, \
            client(url, KEY_A) as a, client(url, KEY_B) as b:
        # A's objects: a stored response with a ctc_ call, a conversation with items and a turn in it
        r = a.post("/v1/responses", json={"model": "tiny", "input": "patch", "tools": [PATCH],
                                          "tool_choice": {"type": "custom", "name": "apply_patch"}}).json()
        rid, call = r["id"], r["output"][0]
        input_id = a.get(f"/v1/responses/{rid}/input_items").json()["data"][0]["id"]
        conv = a.post("/v1/conversations", json={"items": [{"role": "user", "content": "secret"}],
                                                 "metadata": {"who": "a"}}).json()
        cid = conv["id"]
        turn = a.post("/v1/responses", json={"model": "tiny", "input": "hi", "conversation": cid})
        assert turn.status_code == 200
        item_id = a.get(f"/v1/conversations/{cid}/items", params={"order": "asc"}).json()["data"][0]["id"]
        upstream_calls = len(transport.requests)

        fake_r, fake_c, fake_i = "resp_" + "0" * 24, "conv_" + "0" * 24, "msg_" + "0" * 24
        # responses
        same_as_unknown(lambda x: b.get(f"/v1/responses/{x}"), rid, fake_r)
        same_as_unknown(lambda x: b.get(f"/v1/responses/{x}/input_items"), rid, fake_r)
        same_as_unknown(lambda x: b.post(f"/v1/responses/{x}/cancel"), rid, fake_r)
        same_as_unknown(lambda x: b.delete(f"/v1/responses/{x}"), rid, fake_r)
        prev = same_as_unknown(lambda x: b.post("/v1/responses", json={"model": "tiny", "input": "x",
                                                                       "previous_response_id": x}), rid, fake_r)
        assert prev.status_code == 404 and prev.json()["error"]["param"] == "previous_response_id"
        conv_turn = same_as_unknown(lambda x: b.post("/v1/responses", json={"model": "tiny", "input": "x",
                                                                            "conversation": x}), cid, fake_c)
        assert conv_turn.status_code == 404 and conv_turn.json()["error"]["param"] == "conversation"
        for their_item in (call["id"], input_id, item_id):  # output, input and conversation items
            ref = same_as_unknown(lambda x: b.post("/v1/responses", json={
                "model": "tiny", "input": [{"type": "item_reference", "id": x}]}), their_item, fake_i)
            assert ref.json()["error"]["code"] == "item_not_found"
            same_as_unknown(lambda x: b.post("/v1/conversations", json={
                "items": [{"type": "item_reference", "id": x}]}), their_item, fake_i)
        # conversations
        same_as_unknown(lambda x: b.get(f"/v1/conversations/{x}"), cid, fake_c)
        same_as_unknown(lambda x: b.post(f"/v1/conversations/{x}", json={"metadata": {"who": "b"}}), cid, fake_c)
        same_as_unknown(lambda x: b.get(f"/v1/conversations/{x}/items"), cid, fake_c)
        same_as_unknown(lambda x: b.post(f"/v1/conversations/{x}/items",
                                         json={"items": [{"role": "user", "content": "inject"}]}), cid, fake_c)
        same_as_unknown(lambda x: b.get(f"/v1/conversations/{x}/items/{item_id}"), cid, fake_c)
        same_as_unknown(lambda x: b.delete(f"/v1/conversations/{x}/items/{item_id}"), cid, fake_c)
        same_as_unknown(lambda x: b.delete(f"/v1/conversations/{x}"), cid, fake_c)
        for status in (b.get(f"/v1/responses/{rid}").status_code, b.get(f"/v1/conversations/{cid}").status_code):
            assert status == 404
        assert len(transport.requests) == upstream_calls  # nothing B sent reached the upstream

        # A still sees (and can use) all of it, untouched by B
        assert a.get(f"/v1/responses/{rid}").json() == r
        assert a.get(f"/v1/conversations/{cid}").json() == conv
        listed = a.get(f"/v1/conversations/{cid}/items", params={"order": "asc"}).json()["data"]
        assert [i["role"] for i in listed] == ["user", "user", "assistant"]
        assert a.get(f"/v1/conversations/{cid}/items/{item_id}").status_code == 200
        assert a.post(f"/v1/responses/{rid}/cancel").status_code == 400  # A's: exists, not a background one
        follow = a.post("/v1/responses", json={"model": "tiny", "previous_response_id": rid, "tools": [PATCH],
                                               "input": [{"type": "item_reference", "id": call["id"]},
                                                         {"type": "custom_tool_call_output",
                                                          "call_id": call["call_id"], "output": "ok"}]})
        assert follow.status_code == 200
        assert a.post("/v1/responses", json={"model": "tiny", "conversation": cid,
                                             "input": [{"type": "item_reference", "id": item_id}]}).status_code == 200
        # B's own objects work for B, and are A's unknown ids in turn
        b_conv = b.post("/v1/conversations", json={}).json()["id"]
        assert a.get(f"/v1/conversations/{b_conv}").status_code == 404
        assert b.get(f"/v1/conversations/{b_conv}").status_code == 200
        assert a.delete(f"/v1/responses/{rid}").status_code == 200
        assert a.delete(f"/v1/conversations/{cid}").status_code == 200
        assert b.get("/v1/conversations/" + cid).status_code == 404


def test_owner_is_a_keyed_hash_never_the_key(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with running_gateway(transport=replay("text_completed_nonstream"), store=SqliteResponseStore(path),
                         api_keys=(KEY_A, KEY_B), owner_secret="deployment-secret") as url, client(url, KEY_A) as a:
        rid = a.post("/v1/responses", json={"model": "tiny", "input": "x"}).json()["id"]
        cid = a.post("/v1/conversations", json={}).json()["id"]
        assert httpx.get(f"{url}/v1/responses/{rid}").status_code == 401  # no key: refused before any lookup
    db = sqlite3.connect(path)
    owners = {row[0] for table in ("responses", "response_items", "conversations")
              for row in db.execute(f"SELECT owner FROM {table}")}
    db.close()
    expected = ApiKeyAuth([KEY_A, KEY_B], owner_secret="deployment-secret").owner(KEY_A.encode())
    assert owners == {expected} and len(expected) == 64
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r.db"))
    assert KEY_A.encode() not in raw and cid.encode() in raw
    # The owner depends on the secret (a different deployment cannot correlate), and on the key.
    assert ApiKeyAuth([KEY_A], owner_secret="other").owner(KEY_A.encode()) != expected
    assert ApiKeyAuth([KEY_A, KEY_B], owner_secret="deployment-secret").owner(KEY_B.encode()) != expected
    # Without an owner secret it is derived from the key set, whatever its order.
    assert ApiKeyAuth([KEY_A, KEY_B]).owner(b"k") == ApiKeyAuth([KEY_B, KEY_A, KEY_A]).owner(b"k")


def test_without_gateway_keys_everything_is_single_tenant(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.db")
    with running_gateway(transport=replay("text_completed_nonstream"), store=store) as url:
        headers: list[dict[str, Any]] = [{"authorization": "Bearer one"}, {"authorization": "Bearer two"}, {}]
        rid = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x"}, headers=headers[0]).json()["id"]
        cid = httpx.post(url + "/v1/conversations", json={}, headers=headers[0]).json()["id"]
        for h in headers:
            assert httpx.get(f"{url}/v1/responses/{rid}", headers=h).status_code == 200
            assert httpx.get(f"{url}/v1/conversations/{cid}", headers=h).status_code == 200
