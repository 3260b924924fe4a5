"""The newest openai SDK's models as strict judges of what the gateway returns: each listed item validated by the
SDK model of its ``type`` (pydantic strict mode, no coercion), and every ``response.completed`` event."""

from __future__ import annotations

import typing
from functools import cache
from typing import Any

import pydantic
from openai.types.conversations import ConversationItem
from openai.types.responses import ResponseCompletedEvent, ResponseItem

__all__ = ["forgive_echoed", "validate_completed", "validate_conversation_item", "validate_response_item"]


@cache
def _by_type(union: Any) -> dict[str, list[type[pydantic.BaseModel]]]:
    """The union's member models by their ``type`` literal (the SDK discriminates on it; pydantic does not see its
    discriminator annotation, so a plain union validation would report every member's errors)."""
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    table: dict[str, list[type[pydantic.BaseModel]]] = {}
    for model in typing.get_args(union):
        for literal in typing.get_args(model.model_fields["type"].annotation):
            table.setdefault(literal, []).append(model)
    return table


def _validate(union: Any, item: dict[str, Any]) -> pydantic.BaseModel:
    models = _by_type(union).get(item.get("type"))  # type: ignore[arg-type]
    assert models, f"no SDK item model has type {item.get('type')!r}: {item}"
    errors = []
    for model in models:  # "message": an input message item or an output message (by role)
        try:
            return model.model_validate(item, strict=True)
        except pydantic.ValidationError as exc:
            errors.append(f"{model.__name__}: {exc}")
    raise AssertionError(f"the openai SDK rejects {item}:\n" + "\n".join(errors))


def validate_response_item(item: dict[str, Any]) -> pydantic.BaseModel:
    """An ``input_items`` entry, as ``ResponseItem``."""
    return _validate(ResponseItem, item)


def validate_conversation_item(item: dict[str, Any]) -> pydantic.BaseModel:
    """A conversation item, as ``ConversationItem``."""
    return _validate(ConversationItem, item)


def validate_completed(event: dict[str, Any]) -> ResponseCompletedEvent:
    """A ``response.completed`` event, as ``ResponseCompletedEvent`` (strict)."""
    return ResponseCompletedEvent.model_validate(event, strict=True)


def forgive_echoed(rejected: list[tuple[Exception, bytes]], fields: frozenset[str] | set[str]) -> None:
    """Drop from the suite-wide check's findings (tests/conftest.py) the events the SDK rejects only in these
    Response ``fields`` — request fields the gateway echoes as the client sent them. For a test that sends, on
    purpose, a value the SDK's closed models do not know; the rest of each event is still held to the SDK."""
    rejected[:] = [(exc, data) for exc, data in rejected
                   if not (isinstance(exc, pydantic.ValidationError)
                           and all(len(e["loc"]) > 1 and e["loc"][0] == "response" and e["loc"][1] in fields
                                   for e in exc.errors()))]
