"""parse_request_body: the nesting limit (everywhere in the body) and the envelope's type checks."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.protocol.request import MAX_DEPTH, check_depth, parse_request_body


def nested(containers: int) -> bytes:
    """``containers`` nested containers (objects ``{"a": ...}`` and arrays alternating) around a 1."""
    opens = b"".join(b'{"a":' if i % 2 == 0 else b"[" for i in range(containers))
    closes = b"".join(b"}" if i % 2 == 0 else b"]" for i in reversed(range(containers)))
    return opens + b"1" + closes


# (name, body before the deep value, after it, containers already open there, the param's start)
PLACES = [
    ("top level", b'{"model":"m","extra":', b"}", 1, "extra"),
    ("tools[].parameters", b'{"model":"m","tools":[{"type":"function","name":"f","parameters":', b"}]}", 3,
     "tools[0].parameters"),
    ("tool_choice", b'{"model":"m","tool_choice":{"type":"allowed_tools","mode":"auto","tools":[', b"]}}", 3,
     "tool_choice.tools[0]"),
    ("input", b'{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"x","y":', b"}]}]}", 5,
     "input[0].content[0].y"),
    ("metadata", b'{"model":"m","metadata":{"k":', b"}}", 2, "metadata.k"),
]


def body_of_depth(place: tuple[str, bytes, bytes, int, str], depth: int) -> bytes:
    _, before, after, opened, _ = place
    return before + nested(depth - opened) + after


def nesting_error(raw: bytes) -> InvalidRequest | None:
    """The nesting_too_deep error parsing ``raw`` raises; None if it raises another error or none."""
    try:
        parse_request_body(raw)
    except InvalidRequest as exc:
        return exc if exc.code == "nesting_too_deep" else None
    return None


@pytest.mark.parametrize("place", PLACES, ids=[p[0] for p in PLACES])
@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH])
def test_nesting_up_to_the_limit_is_accepted(place: tuple[str, bytes, bytes, int, str], depth: int) -> None:
    raw = body_of_depth(place, depth)
    assert orjson.loads(raw)  # the test builds valid JSON
    assert nesting_error(raw) is None  # metadata values must be strings: that is a different 400


@pytest.mark.parametrize("place", PLACES, ids=[p[0] for p in PLACES])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 300, 2000])  # 2000: beyond orjson's own limit (1024)
def test_nesting_beyond_the_limit_is_a_400_naming_the_place(place: tuple[str, bytes, bytes, int, str],
                                                            depth: int) -> None:
    exc = nesting_error(body_of_depth(place, depth))
    assert exc is not None
    assert exc.status == 400
    body = exc.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    assert body["code"] == "nesting_too_deep"
    param = body["param"]
    assert param.startswith(place[4]) and param.endswith("...")
    assert len(param) < 200
    assert f"deeper than {MAX_DEPTH} levels" in body["message"] and param in body["message"]


def test_the_param_is_the_same_whoever_finds_the_depth() -> None:
    """Within orjson's limit the walk over the parsed body names the place; beyond it a scan of the raw
    body does: both name the same path (keys, indexes, strings with brackets in them skipped)."""
    before = b'{"input":[{"a":"s[{,\\"}"},{"content":[1,"]",{"text":"x"},'
    params = {nesting_error(before + nested(n) + b"]}]}").param for n in (80, 3000)}  # type: ignore[union-attr]
    assert params == {"input[1].content[3].a[0].a[0].a[0]..."}


def test_the_param_is_bounded_with_long_keys() -> None:
    key = b"k" * 10_000
    raw = (b'{"' + key + b'":') * 71 + b"1" + b"}" * 71
    exc = nesting_error(raw)
    assert exc is not None and exc.param is not None and len(exc.param) < 600


def test_empty_containers_count_at_the_limit() -> None:
    check_depth(orjson.loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH))
    with pytest.raises(InvalidRequest) as info:
        check_depth(orjson.loads(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)))
    assert info.value.code == "nesting_too_deep" and info.value.param == "[0][0][0][0][0][0][0][0][0][0]..."
    check_depth(orjson.loads(b'{"a":' * (MAX_DEPTH - 1) + b"{}" + b"}" * (MAX_DEPTH - 1)))
    with pytest.raises(InvalidRequest):
        check_depth(orjson.loads(b'{"a":' * MAX_DEPTH + b"{}" + b"}" * MAX_DEPTH))


def test_the_first_too_deep_place_in_document_order_is_named() -> None:
    body = {"a": [1, {"b": 2}], "z": orjson.loads(nested(70)), "y": orjson.loads(nested(70))}
    with pytest.raises(InvalidRequest) as info:
        check_depth(body)
    assert info.value.param is not None and info.value.param.startswith("z.a[0]")


def test_wide_shallow_bodies_pass() -> None:
    tool = {"type": "function", "name": "f", "description": "d" * 200, "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 50} for i in range(10)}}}
    msg = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello " * 80}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
    body = {"model": "m", "tools": [tool] * 20, "input": [msg, call] * 1500, "x": [[0] * 10] * 5000}
    raw = orjson.dumps(body)
    assert len(raw) > 1_000_000
    check_depth(orjson.loads(raw))  # wide but only 5 deep: no error (its cost is a benchmark's business, not a test's)
    assert parse_request_body(raw)["model"] == "m"


@pytest.mark.parametrize(("include", "param"), [
    ([1], "include[0]"), (["reasoning.encrypted_content", None], "include[1]"), ([["x"]], "include[0]"),
    ([{}], "include[0]"), ("reasoning.encrypted_content", "include"), ({"a": "b"}, "include"), (5, "include"),
])
def test_include_must_be_a_list_of_strings(include: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request_body(orjson.dumps({"model": "m", "input": "x", "include": include}))
    assert info.value.code == "invalid_type"
    assert info.value.param == param
    assert info.value.status == 400


@pytest.mark.parametrize("include", [None, [], ["reasoning.encrypted_content", "anything.else"]])
def test_valid_include_passes(include: object) -> None:
    body = parse_request_body(orjson.dumps({"model": "m", "input": "x", "include": include}))
    assert body["include"] == include


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 2000 + b"1" + b"}" * 2000])
def test_bodies_beyond_orjsons_limit_are_the_same_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request_body(raw)
    assert info.value.code == "nesting_too_deep" and info.value.status == 400
    assert info.value.param is not None and info.value.param.endswith("...")


def test_other_invalid_json_is_still_invalid_json() -> None:
    for raw in (b"{", b'{"a": "\\ud800"}', b'{"a": 1e400}', b"\xff", b'{"a": NaN}'):
        with pytest.raises(InvalidRequest) as info:
            parse_request_body(raw)
        assert info.value.code == "invalid_json", raw
