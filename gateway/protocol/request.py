"""The envelope of a Responses request: the top-level fields the gateway relies on, type-checked once.

Unknown fields are allowed and passed through; only fields whose type the gateway depends on are checked,
so a wrong type is a clear 400 here rather than a confusing error further down.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.errors import InvalidRequest

__all__ = ["parse_request_body"]


class ResponsesEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


def parse_request_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc.args[0] if exc.args else exc}.",
                             code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    try:
        ResponsesEnvelope.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
        raise InvalidRequest(f"Invalid type for '{param}': {first['msg']}.", param=param or None,
                             code="invalid_type") from None
    return body


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[any]", "dict[str,any]", "function-after", "union"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out
