"""Suite-wide checks.

Every ``response.completed`` event the gateway makes in any test — SSE, WebSocket frames, background-run rows,
replays — is validated strictly by the newest openai SDK's ``ResponseCompletedEvent`` model (not only its stream
accumulator): ``ClientEvent`` is the one type all of them are built as (gateway/protocol/events.py), so its
constructor is wrapped for the test. So is every completed Response object the gateway answers as a JSON body
(non-streamed ``POST /v1/responses``, ``GET /v1/responses/{id}``: gateway.server.http.OrjsonResponse), checked as
the completed event that would carry it. A rejected one fails the test that produced it, at its teardown, with the
SDK's error; the gateway itself is not changed (the check must not alter what the client gets)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pydantic
import pytest
import structlog

from gateway.protocol.events import ClientEvent
from gateway.server.http import OrjsonResponse
from tests.sdk_shapes import validate_completed

_init = ClientEvent.__init__
_render = OrjsonResponse.render
Rejected = tuple[Exception, bytes]  # the SDK's error, the event as sent


@pytest.fixture(autouse=True)
def sdk_validates_every_completed_event(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Rejected]]:
    """The SDK's errors for the ``response.completed`` events this test made (the list is the fixture's value:
    a test that makes a bad one on purpose clears it)."""
    rejected: list[Rejected] = []

    def checked_init(self: ClientEvent, etype: str, sequence_number: int, output_index: int | None,
                     payload: dict[str, Any], data: bytes) -> None:
        _init(self, etype, sequence_number, output_index, payload, data)
        if etype == "response.completed":
            try:
                validate_completed(orjson.loads(data))
            except (pydantic.ValidationError, orjson.JSONDecodeError) as exc:
                rejected.append((exc, data))

    def checked_render(self: OrjsonResponse, content: Any) -> bytes:
        data = _render(self, content)
        if isinstance(content, dict) and content.get("object") == "response" and content.get("status") == "completed":
            checked_init(ClientEvent.__new__(ClientEvent), "response.completed", 0, None, {}, orjson.dumps(
                {"type": "response.completed", "sequence_number": 0, "response": content}))
        return data

    monkeypatch.setattr(ClientEvent, "__init__", checked_init)
    monkeypatch.setattr(OrjsonResponse, "render", checked_render)
    yield rejected
    if rejected:
        pytest.fail(f"the openai SDK rejects {len(rejected)} response.completed event(s) this test produced; "
                    f"the first:\n{rejected[0][0]}\n{rejected[0][1][:2000]!r}", pytrace=False)


def _logging_state() -> tuple[Any, ...]:
    from gateway.server import observe

    root = logging.getLogger()
    config = {**structlog.get_config()}
    config["processors"] = list(config["processors"])
    return root.level, list(root.handlers), structlog.is_configured(), config, observe._configured_by_us


_BASELINE = _logging_state()  # before any gateway of this process configured anything


@pytest.fixture(autouse=True)
def logging_as_it_was() -> Iterator[None]:
    """Each test ends with logging as the process started with it. A gateway built in this process configures
    structlog and the root logger (gateway.server.observe.ensure_logging), e.g. at ``log_level="error"`` for the
    fuzz tests' module-wide gateway or on a captured stderr that closes with its test; left in place, a later
    test's ``capture_logs`` would miss warnings and its server would write into a closed file — failures that
    depend on the order the tests ran in."""
    from gateway.server import observe

    yield
    level, handlers, configured, config, ours = _BASELINE
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()
    observe._configured_by_us = ours
