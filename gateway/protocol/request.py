"""The envelope of a Responses request: the top-level fields the gateway relies on, type-checked once.

Unknown fields are allowed and passed through; only fields whose type the gateway depends on are checked,
so a wrong type is a clear 400 here rather than a confusing error further down.

Nesting is bounded too (``MAX_DEPTH``): JSON nested deeper than that anywhere in the body is a 400
``nesting_too_deep`` naming the place, before any other code walks it (orjson refuses to serialize beyond
254 levels, and the gateway wraps the client's values a few levels deeper on their way upstream).
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.errors import InvalidRequest

__all__ = ["MAX_DEPTH", "check_depth", "parse_request_body"]

# Containers (objects and arrays) on the way to any value, the body itself counting as 1.
MAX_DEPTH = 64
NESTING_CODE = "nesting_too_deep"


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
    include: list[str] | None = None


def parse_request_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        detail = str(exc.args[0] if exc.args else exc)
        if _DEPTH_ERROR.search(detail):  # orjson's own limit (1024 levels in 3.11+; "recursion" in older ones)
            raise _too_deep(_raw_path(raw, MAX_DEPTH), MAX_DEPTH) from None
        raise InvalidRequest(f"The request body is not valid JSON: {detail}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH:  # fewer brackets than that cannot nest deeper
        check_depth(body)
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


# ---------------------------------------------------------------------------------------------- nesting

_DEPTH_ERROR = re.compile(r"recursion|depth limit", re.IGNORECASE)  # orjson: "depth limit exceeded"
_PARAM_SEGMENTS = 10  # a too-deep path is named by its first segments: where it starts is what helps
_KEY_CHARS = 40


def check_depth(body: Any, limit: int = MAX_DEPTH) -> None:
    """``InvalidRequest`` (``nesting_too_deep``) when ``body`` has a container deeper than ``limit``.

    Runs on every request: one iterative pass, level by level, over the values of non-empty containers
    (strings are never entered), so it is O(size) with no recursion; the path is only worked out on failure.
    """
    if type(body) is not dict and type(body) is not list:
        return
    level: list[Any] = [body]
    for _ in range(limit - 1):
        # Empty containers are left out: they end their branch, and up to the limit they are allowed.
        level = [v for v in chain.from_iterable([n.values() if type(n) is dict else n for n in level])
                 if (type(v) is dict or type(v) is list) and v]
        if not level:
            return
    # ``level`` holds the non-empty containers at depth ``limit``: any container inside one is too deep.
    for v in chain.from_iterable([n.values() if type(n) is dict else n for n in level]):
        if type(v) is dict or type(v) is list:
            raise _too_deep(_object_path(body, limit), limit)


def _too_deep(path: list[str | int] | None, limit: int) -> InvalidRequest:
    param = _format_path(path) if path else None
    where = f" at '{param}'" if param else ""
    return InvalidRequest(f"The request body nests JSON deeper than {limit} levels{where}; objects and arrays "
                          f"may be nested at most {limit} deep.", param=param, code=NESTING_CODE)


def _object_path(body: Any, limit: int) -> list[str | int] | None:
    """The keys and indexes to the first container (in document order) deeper than ``limit``."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(body, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        items = list(node.items()) if type(node) is dict else list(enumerate(node))
        for key, value in reversed(items):
            if type(value) is dict or type(value) is list:
                if depth == limit:
                    first = next(k for k, v in items if type(v) is dict or type(v) is list)
                    return [*_flatten(path), first]
                stack.append((value, depth + 1, (path, key)))
    return None


def _flatten(path: tuple[Any, ...]) -> list[str | int]:
    out: list[str | int] = []
    while path:
        path, key = path
        out.append(key)
    return out[::-1]


# A JSON string, or one structural character: enough to follow keys and indexes without parsing values.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]')
_SCAN_LIMIT = 1 << 20


def _raw_path(raw: bytes, limit: int) -> list[str | int] | None:
    """The path to the first container deeper than ``limit`` in a body orjson refused as too deep.

    Best effort (None if it cannot tell): the tokens up to that point, if it is within the first MiB.
    """
    stack: list[list[Any]] = []  # [kind, key or index, expecting a key]
    for m in _TOKEN.finditer(raw):
        if m.start() > _SCAN_LIMIT:
            return None
        tok = m.group()
        top = stack[-1] if stack else None
        if tok in (b"{", b"["):
            if len(stack) == limit:
                path = [entry[1] for entry in stack]
                return path if None not in path else None
            stack.append([tok, None if tok == b"{" else 0, tok == b"{"])
        elif tok in (b"}", b"]"):
            if not stack:
                return None
            stack.pop()
        elif tok == b",":
            if top is None:
                return None
            if top[0] == b"[":
                top[1] += 1
            else:
                top[2] = True
        elif tok == b":":
            continue
        elif top is not None and top[0] == b"{" and top[2]:
            try:
                top[1] = orjson.loads(tok)
            except orjson.JSONDecodeError:
                return None
            top[2] = False
    return None


def _format_path(path: list[str | int]) -> str:
    out = ""
    for n, part in enumerate(path):
        if n == _PARAM_SEGMENTS:
            return out + "..."
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if len(part) <= _KEY_CHARS else part[:_KEY_CHARS] + "..."
            out += ("." if out else "") + key
    return out
