"""``responses-gateway codex-config``: the model catalog, the config.toml lines, the merge with --write, the errors.

The gateway is real (uvicorn on loopback); its upstream is a loopback Starlette app answering ``/v1/models`` in
vLLM 0.32's shape (HAND-WRITTEN, fields as vLLM's ``ModelCard``: ``max_model_len`` per entry), which the gateway
passes through. Codex itself reading what this writes is tests/test_codex_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import cli, codex_config
from gateway.codex_config import ServedModel, catalog_entry, merge_config, reasons
from gateway.config import Settings
from tests.support import free_port, running_gateway, serve_in_thread

KEY = "sk-codex-config-test"


def vllm_models(*models: tuple[str, int]) -> dict[str, Any]:
    """vLLM 0.32's /v1/models body (HAND-WRITTEN in its ModelCard shape)."""
    return {"object": "list", "data": [
        {"id": mid, "object": "model", "created": 1795973040, "owned_by": "vllm", "root": f"/models/{mid}",
         "parent": None, "max_model_len": window,
         "permission": [{"id": "modelperm-0", "object": "model_permission", "created": 1795973040,
                         "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                         "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                         "organization": "*", "group": None, "is_blocking": False}]}
        for mid, window in models]}


@contextlib.contextmanager
def gateway_over(body: Any, **settings: Any) -> Iterator[str]:
    """A gateway whose upstream answers /v1/models with ``body``; its URL."""
    async def models(request: Request) -> Response:
        return JSONResponse(body)

    with serve_in_thread(Starlette(routes=[Route("/v1/models", models)])) as (up_url, _), \
            running_gateway(Settings(upstream_url=up_url, store="none", **settings)) as url:
        yield url


def run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None
            ) -> tuple[int, str, str]:
    """``responses-gateway codex-config ARGV`` through the CLI's parser, with only ``env`` in its environment;
    (exit status, stdout, stderr). Its own streams: the gateways these tests run log to the process's stdout."""
    for name in ("CODEX_HOME", "RESPONSES_GATEWAY_API_KEY", "GW_KEY"):
        monkeypatch.delenv(name, raising=False)
    args = cli._parser().parse_args(["codex-config", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = codex_config.run(args, environ=dict(env or {}), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def gateway() -> Iterator[str]:
    with gateway_over(vllm_models(("Qwen/Qwen3-Coder-30B-A3B-Instruct", 65536), ("openai/gpt-oss-20b", 131072)),
                      api_keys=(KEY,)) as url:
        yield url


def test_prints_the_lines_and_writes_the_catalog(gateway: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    code, out, err = run_cli(["--gateway-url", gateway, "--codex-home", str(home)], monkeypatch,
                             {"RESPONSES_GATEWAY_API_KEY": KEY})
    assert code == 0, err
    printed = tomllib.loads(out)
    catalog_path = home / "responses-gateway-models.json"
    assert printed == {
        "model": "Qwen/Qwen3-Coder-30B-A3B-Instruct", "model_provider": "responses-gateway",
        "model_catalog_json": str(catalog_path),
        "model_providers": {"responses-gateway": {
            "name": "responses-gateway", "base_url": gateway + "/v1", "wire_api": "responses",
            "supports_websockets": True, "env_key": "RESPONSES_GATEWAY_API_KEY"}}}
    assert not (home / "config.toml").exists()  # printed only, without --write
    models = json.loads(catalog_path.read_text())["models"]
    assert [m["slug"] for m in models] == ["Qwen/Qwen3-Coder-30B-A3B-Instruct", "openai/gpt-oss-20b"]
    coder, oss = models
    assert coder["context_window"] == 65536 and oss["context_window"] == 131072  # from max_model_len
    assert coder["auto_compact_token_limit"] == 65536 * 9 // 10
    assert coder["apply_patch_tool_type"] == oss["apply_patch_tool_type"] == "freeform"
    assert coder["shell_type"] == "shell_command"
    assert coder["truncation_policy"] == {"mode": "tokens", "limit": 10000}
    assert coder["input_modalities"] == ["text"] and coder["supports_parallel_tool_calls"] is False
    # reasoning levels for the model that reasons only
    assert coder["supported_reasoning_levels"] == [] and coder["default_reasoning_level"] is None
    assert [lv["effort"] for lv in oss["supported_reasoning_levels"]] == ["low", "medium", "high"]
    assert oss["default_reasoning_level"] == "medium"
    assert "apply_patch" in coder["base_instructions"]


def test_options_are_honoured(gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    code, _out, err = run_cli(["--gateway-url", gateway + "/v1/", "--model", "openai/gpt-oss-20b",
                               "--provider-name", "vllm-box", "--api-key-env", "GW_KEY", "--no-websockets",
                               "--shell-type", "local", "--write"], monkeypatch,
                              {"GW_KEY": KEY, "CODEX_HOME": str(home)})  # CODEX_HOME: the default home
    assert code == 0, err
    config = tomllib.loads((home / "config.toml").read_text())
    assert config["model"] == "openai/gpt-oss-20b" and config["model_provider"] == "vllm-box"
    block = config["model_providers"]["vllm-box"]
    assert block == {"name": "vllm-box", "base_url": gateway + "/v1", "wire_api": "responses",
                     "supports_websockets": False, "env_key": "GW_KEY"}
    catalog = json.loads(Path(config["model_catalog_json"]).read_text())
    assert Path(config["model_catalog_json"]).parent == home
    assert {m["shell_type"] for m in catalog["models"]} == {"local"}
    assert {m["prefer_websockets"] for m in catalog["models"]} == {False}
    assert list(home.glob("*.bak")) == []  # nothing to back up: there was no config.toml


def test_remote_compaction_names_the_block_openai_and_keeps_the_gateway(gateway: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--remote-compaction: the block's display name is the one codex-rs compacts remotely for (its key, address
    and key variable stay the gateway's; tests/test_codex_compaction.py runs Codex with such a block)."""
    home = tmp_path / "home"
    code, _out, err = run_cli(["--gateway-url", gateway, "--codex-home", str(home), "--api-key-env", "GW_KEY",
                               "--remote-compaction", "--write"], monkeypatch, {"GW_KEY": KEY})
    assert code == 0, err
    config = tomllib.loads((home / "config.toml").read_text())
    assert config["model_provider"] == "responses-gateway"
    block = config["model_providers"]["responses-gateway"]
    assert block["name"] == "OpenAI" and block["base_url"] == gateway + "/v1" and block["env_key"] == "GW_KEY"


def test_write_merges_keeping_the_users_settings_and_a_backup(gateway: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    original = """\
# my Codex settings
model = "gpt-5-codex"   # the one I use at work
approval_policy = "on-request"

[model_providers.responses-gateway]
name = "old"
base_url = "http://old:1/v1"
request_max_retries = 7  # mine

[model_providers.other]
name = "other"
base_url = "https://other.example/v1"

[profiles.fast]
model = "gpt-5-mini"
"""
    (home / "config.toml").write_text(original)
    code, out, err = run_cli(["--gateway-url", gateway, "--codex-home", str(home), "--write"], monkeypatch,
                             {"RESPONSES_GATEWAY_API_KEY": KEY})
    assert code == 0, err
    assert out == ""  # --write writes; the messages go to stderr
    text = (home / "config.toml").read_text()
    config = tomllib.loads(text)
    assert config["model"] == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    assert config["model_provider"] == "responses-gateway"
    assert config["approval_policy"] == "on-request"
    assert config["profiles"] == {"fast": {"model": "gpt-5-mini"}}
    assert config["model_providers"]["other"] == {"name": "other", "base_url": "https://other.example/v1"}
    assert config["model_providers"]["responses-gateway"] == {
        "name": "responses-gateway", "base_url": gateway + "/v1", "request_max_retries": 7, "wire_api": "responses",
        "supports_websockets": True, "env_key": "RESPONSES_GATEWAY_API_KEY"}
    assert "# my Codex settings" in text and "request_max_retries = 7  # mine" in text  # the user's text kept
    [backup] = list(home.glob("config.toml.*.bak"))
    assert backup.read_text() == original
    # a second run changes nothing but makes another backup of what it replaces
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", str(home), "--write"], monkeypatch,
                           {"RESPONSES_GATEWAY_API_KEY": KEY})
    assert code == 0, err
    assert (home / "config.toml").read_text() == text


def test_merge_puts_new_top_level_keys_above_the_tables() -> None:
    text = '[features]\nplugins = false\n'
    out = merge_config(text, {"model": "m", "model_provider": "p", "model_catalog_json": "/c.json"}, "p",
                       {"name": "p", "base_url": "http://g/v1"})
    parsed = tomllib.loads(out)
    assert parsed["model"] == "m" and parsed["features"] == {"plugins": False}
    assert "model" not in parsed["features"]


@pytest.mark.parametrize("text", ["model = \n", "[a]\nb = 1\n[a]\nb = 2\n", "model_providers = 3\n"])
def test_an_invalid_config_is_left_alone(gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         text: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(text)
    code, _out, err = run_cli(["--gateway-url", gateway, "--codex-home", str(home), "--write"], monkeypatch,
                              {"RESPONSES_GATEWAY_API_KEY": KEY})
    assert code == 1 and "Traceback" not in err and "config.toml" in err, err
    assert (home / "config.toml").read_text() == text
    assert list(home.glob("*.bak")) == []


def test_errors_are_one_clear_line(gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = str(tmp_path / "home")
    # the gateway down
    code, _, err = run_cli(["--gateway-url", f"http://127.0.0.1:{free_port()}", "--codex-home", home],
                           monkeypatch)
    assert code == 1 and "Cannot reach the gateway" in err and "Traceback" not in err, err
    # no key, a wrong key: 401
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", home], monkeypatch)
    assert code == 1 and "HTTP 401" in err and "GATEWAY_API_KEYS" in err, err
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", home], monkeypatch,
                           {"RESPONSES_GATEWAY_API_KEY": "sk-wrong"})
    assert code == 1 and "HTTP 401" in err and "not a key the gateway accepts" in err, err
    # a model the gateway does not serve
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", home, "--model", "nope"], monkeypatch,
                           {"RESPONSES_GATEWAY_API_KEY": KEY})
    assert code == 1 and "does not serve 'nope'" in err, err
    # bad option values
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", home, "--api-key-env", "A B"], monkeypatch)
    assert code == 1 and "--api-key-env" in err, err
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", home, "--provider-name", "a.b"],
                           monkeypatch)
    assert code == 1 and "--provider-name" in err, err
    with pytest.raises(SystemExit) as exc:
        run_cli(["--shell-type", "zsh"], monkeypatch)
    assert exc.value.code == 2
    assert not (tmp_path / "home").exists()  # nothing written on any failure


@pytest.mark.parametrize("body", [{"object": "list", "data": []}, {"object": "list"}, [1, 2],
                                  {"data": [{"object": "model"}, "x"]}])
def test_no_models_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: Any) -> None:
    with gateway_over(body) as url:
        code, _, err = run_cli(["--gateway-url", url, "--codex-home", str(tmp_path / "h")], monkeypatch)
    assert code == 1 and "Traceback" not in err, err
    assert "serves no models" in err or "did not return a model list" in err, err


def test_an_unwritable_home_is_an_error(gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(["--gateway-url", gateway, "--codex-home", str(blocker / "home")], monkeypatch,
                           {"RESPONSES_GATEWAY_API_KEY": KEY})
    assert code == 1 and "Traceback" not in err and str(blocker) in err, err


def test_a_window_vllm_did_not_report_and_a_small_one() -> None:
    assert catalog_entry(ServedModel("m", None))["context_window"] == 32768
    small = catalog_entry(ServedModel("tiny", 2048))
    assert small["context_window"] == 2048 and small["truncation_policy"]["limit"] == 512
    assert small["auto_compact_token_limit"] == 1843


@pytest.mark.parametrize(("model", "thinks"), [
    ("openai/gpt-oss-120b", True), ("Qwen/Qwen3-8B", True), ("Qwen/QwQ-32B", True),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", True), ("moonshotai/Kimi-K2-Thinking", True),
    ("Qwen/Qwen3-Coder-30B-A3B-Instruct", False), ("Qwen/Qwen3-30B-A3B-Instruct-2507", False),
    ("meta-llama/Llama-3.1-8B-Instruct", False), ("tiny", False)])
def test_reasoning_families(model: str, thinks: bool) -> None:
    assert reasons(model) is thinks


def test_abuse_a_hostile_model_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model id crafted to break out of its TOML string stays one string; a huge answer is refused."""
    evil = 'x"\n[model_providers.evil]\nbase_url = "http://evil/v1'
    with gateway_over(vllm_models((evil, 4096))) as url:
        code, _, err = run_cli(["--gateway-url", url, "--codex-home", str(tmp_path / "h"), "--write"], monkeypatch)
    assert code == 0, err
    config = tomllib.loads((tmp_path / "h" / "config.toml").read_text())
    assert config["model"] == evil and list(config["model_providers"]) == ["responses-gateway"]
    [entry] = json.loads(Path(config["model_catalog_json"]).read_text())["models"]
    assert entry["slug"] == evil
    huge = {"object": "list", "data": [{"id": "m" * 1000, "object": "model"}] * 10_000}  # ~10 MB
    with gateway_over(huge) as url:
        code, _, err = run_cli(["--gateway-url", url, "--codex-home", str(tmp_path / "h2")], monkeypatch)
    assert code == 1 and "more than" in err and "Traceback" not in err, err
    assert not (tmp_path / "h2").exists()
