"""Gateway API keys: accepted, rejected in OpenAI's shape, compared in constant time, never forwarded."""

from __future__ import annotations

import hmac
from pathlib import Path

import httpx
import pytest

from gateway.server import auth as auth_module
from gateway.server.auth import ApiKeyAuth
from tests.ops_support import FakeVllm, fake_vllm, gateway

BODY = {"model": "tiny", "input": "hi"}


def test_requests_without_or_with_a_wrong_key_get_401_in_openai_shape() -> None:
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _), gateway(up, api_keys=("key-one", "key-two")) as (url, _app, _server):
        missing = httpx.post(url + "/v1/responses", json=BODY)
        wrong = httpx.post(url + "/v1/responses", json=BODY, headers={"authorization": "Bearer key-three"})
        basic = httpx.post(url + "/v1/responses", json=BODY, headers={"authorization": "Basic key-one"})
        proxied = httpx.get(url + "/v1/models")  # pass-through routes are guarded too
        ok = httpx.post(url + "/v1/responses", json=BODY, headers={"authorization": "Bearer key-two"})
        ok_models = httpx.get(url + "/v1/models", headers={"authorization": "bearer key-one"})
    for r in (missing, wrong, basic, proxied):
        assert r.status_code == 401
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}}
        assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]
    assert "key-three" not in wrong.text  # the presented key is never echoed
    assert ok.status_code == 200 and ok.json()["object"] == "response"
    assert ok_models.status_code == 200
    assert len(fake.requests) == 2  # only the two authorized requests reached vLLM


def test_every_configured_key_is_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", recording)
    auth = ApiKeyAuth(["alpha", "beta", "gamma"])
    assert auth.verify(b"Bearer alpha") is True
    # no short-circuit on the first match: all three keys were compared
    assert [b for _a, b in calls] == [b"alpha", b"beta", b"gamma"] and all(a == b"alpha" for a, _b in calls)
    calls.clear()
    assert auth.verify(b"Bearer delta") is False and len(calls) == 3
    calls.clear()
    assert auth.verify(None) is False and auth.verify(b"Bearer ") is False and calls == []


def test_gateway_key_is_not_forwarded_upstream_and_the_upstream_key_replaces_it(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# gateway keys\nfile-key\n", encoding="utf-8")
    fake = FakeVllm()
    with fake_vllm(fake) as (up, _):
        with gateway(up, api_keys_file=str(keys)) as (url, _app, _server):
            r = httpx.post(url + "/v1/responses", json=BODY, headers={"authorization": "Bearer file-key"})
            assert r.status_code == 200
            r = httpx.get(url + "/v1/models", headers={"authorization": "Bearer file-key"})
            assert r.status_code == 200
        assert all("authorization" not in req["headers"] for req in fake.requests)
        fake.requests.clear()
        with gateway(up, api_keys=("gw-key",), upstream_api_key="up-key") as (url, _app, _server):
            r = httpx.post(url + "/v1/responses", json=BODY, headers={"authorization": "Bearer gw-key"})
            assert r.status_code == 200
        assert [req["headers"]["authorization"] for req in fake.requests] == ["Bearer up-key"]
        fake.requests.clear()
        with gateway(up) as (url, _app, _server):  # no gateway auth: the client's credential is vLLM's business
            httpx.post(url + "/v1/responses", json=BODY, headers={"authorization": "Bearer client-token"})
        assert [req["headers"]["authorization"] for req in fake.requests] == ["Bearer client-token"]


def test_rejections_are_counted() -> None:
    with fake_vllm() as (up, _), gateway(up, api_keys=("k",)) as (url, _app, _server):
        httpx.post(url + "/v1/responses", json=BODY)
        text = httpx.get(url + "/metrics").text
    assert 'responses_gateway_rejected_requests_total{reason="unauthorized"} 1.0' in text
    assert 'responses_gateway_requests_total{route="/v1/responses",status="401",stream="false"} 1.0' in text


def test_an_empty_key_file_refuses_to_start_instead_of_turning_auth_off(tmp_path: Path) -> None:
    from gateway.config import Settings
    from gateway.server import create_app

    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="contains no keys"):
        create_app(Settings(api_keys_file=str(empty), store="none"), store=None)
