"""Grammar conversion (issue 18): the converted grammar accepts exactly what the gateway's own check accepts.

The judge is the gateway's validator (``check_input``: Lark's Earley verdict on the grammar as the gateway loads
it, ``re.fullmatch`` for a regex tool). Strings come from Hypothesis: positives from ``from_lark`` /
``from_regex``, negatives by mutating them and at random.

- The regex route (``to_regex``) is checked with Python's ``re.fullmatch``: always runs.
- The EBNF route (``to_ebnf``, raw and JSON-escaped) and the regex route as xgrammar reads it (the dialect of
  a JSON-schema ``pattern`` inside vLLM) are checked with xgrammar's ``GrammarMatcher``, in the tiny vLLM's
  environment (tests/xgrammar_oracle.py in a subprocess, many strings per call); without that interpreter these
  checks skip and say why. The escaped form is fed ``json.dumps(s, ensure_ascii=False)[1:-1]``: the canonical
  escapes only (see grammar_convert's docstring).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lark
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark

from gateway.enforce.validate import check_input
from gateway.translate.grammar_convert import GrammarConversionError, to_ebnf, to_json_pattern, to_regex
from gateway.translate.lark_rewrite import rewrite_zero_width
from gateway.translate.tool_context import ToolInfo
from tests.test_lark_lalr import BOUNDED_PATCH, CODEX_APPLY_PATCH

ORACLE_PYTHON = Path(os.environ.get("TINY_VLLM_PYTHON", Path.home() / ".cache/tiny-vllm/venv/bin/python"))
ORACLE = Path(__file__).with_name("xgrammar_oracle.py")

# key=value pairs: %import (common.*, an alias), a terminal priority, %ignore, a recursive rule (not regular).
IMPORTS_PRIORITIES = r"""start: pair ("," pair)*
pair: KEY "=" value
value: NUM | STRING | WORD | "[" [value ("," value)*] "]"
KEY.2: /[a-z_]+/
STRING: /"[^"\\\n]*"/
%import common.SIGNED_NUMBER -> NUM
%import common.WORD
%import common.WS
%ignore WS
"""

# Keywords over identifiers by priority (priorities choose parses; the language is the union), a
# case-insensitive literal, a regex with flags and a Unicode class.
KEYWORDS = r"""start: GREETING word (" " word)* "!"?
word: KW | ID
GREETING: "hello"i " "
KW.3: "if" | "else"
ID: /(?i:[a-zé]+)/ | /\d+/
"""

# A template, an inlined `?` rule with an alias, `[]`, an imported terminal and flags (`s`, `x`) on regexes.
TEMPLATES = r"""start: _sep{item, ","} [";"]
_sep{x, sep}: x (sep x)*
?item: "(" NAME ")" -> paren | NAME | NAME "=" INT | DOTS
NAME: /[a-z]+/
DOTS: /< . >/xs
%import common.INT
"""

LARK_GRAMMARS = {"codex": CODEX_APPLY_PATCH, "bounded": BOUNDED_PATCH, "imports": IMPORTS_PRIORITIES,
                 "keywords": KEYWORDS, "templates": TEMPLATES}
REGULAR = {"codex", "bounded", "keywords", "templates"}

REGEX_TOOLS = {"zip": r"[0-9]{5}", "phone": r"^\d{3}-\d{4}$", "yesno": r"(?i)(yes|no)( please)?",
               "email": r"[\w.+-]+@[\w-]+\.[a-z]{2,6}", "dotted": r"a.c|\S\s\W", "quoted": r'"[^"\\]*"\n?'}

_ALPHABET = "ab*@+- .\t\n\"\\\u00e9\U0001F600:/_=,;<>()[]0123456789hHeElLoOiIfFsxEnd\u0000\x1f"


def _judge(syntax: str, definition: str) -> Callable[[str], bool]:
    """The gateway's own verdict on a tool input."""
    info = ToolInfo(kind="custom", name="t", upstream_name="t", namespace=None,
                    definition={"format": {"type": "grammar", "syntax": syntax, "definition": definition}})

    def accepts(text: str) -> bool:
        verdict = check_input(info, text)
        assert verdict.unchecked is None, verdict.unchecked
        return verdict.ok

    return accepts


def _positives(syntax: str, definition: str) -> st.SearchStrategy[str]:
    if syntax == "regex":
        return st.from_regex(definition, fullmatch=True)
    parser = lark.Lark(rewrite_zero_width(definition), parser="earley")
    return from_lark(parser, alphabet=st.characters(codec="utf-8", exclude_characters="\r"))


@st.composite
def _mutated(draw: st.DrawFn, base: st.SearchStrategy[str]) -> str:
    text = draw(base)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        ch = draw(st.sampled_from(_ALPHABET))
        if op == "insert":
            text = text[:i] + ch + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + 1:]
        else:
            text = text[:i] + ch + text[i + 1:]
    return text


def _strings(syntax: str, definition: str) -> st.SearchStrategy[str]:
    positives = _positives(syntax, definition)
    return st.one_of(positives, _mutated(positives), st.text(alphabet=_ALPHABET, max_size=30))


_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _collect(syntax: str, definition: str, n: int = 120) -> list[str]:
    """Hypothesis-drawn strings (positives, mutations, noise) for one batched oracle call."""
    found: list[str] = []

    @settings(_SETTINGS, max_examples=n)
    @given(_strings(syntax, definition))
    def draw(text: str) -> None:
        found.append(text)

    draw()
    return list(dict.fromkeys(found))


ALL_TOOLS = [("lark", name) for name in LARK_GRAMMARS] + [("regex", name) for name in REGEX_TOOLS]


def _definition(syntax: str, name: str) -> str:
    return LARK_GRAMMARS[name] if syntax == "lark" else REGEX_TOOLS[name]


# --- the regex route, checked with Python's re (always runs) --------------------------------------------------

@pytest.mark.parametrize(("syntax", "name"), [t for t in ALL_TOOLS if t[0] == "regex" or t[1] in REGULAR])
def test_regex_route_accepts_what_the_gateway_accepts(syntax: str, name: str) -> None:
    definition = _definition(syntax, name)
    rx = re.compile(to_regex(syntax, definition))
    escaped = re.compile(to_json_pattern(syntax, definition))
    judge = _judge(syntax, definition)
    seen: set[bool] = set()

    @_SETTINGS
    @given(_strings(syntax, definition))
    def check(text: str) -> None:
        verdict = judge(text)
        seen.add(verdict)
        assert (rx.fullmatch(text) is not None) == verdict, text
        assert (escaped.fullmatch(json.dumps(text, ensure_ascii=False)[1:-1]) is not None) == verdict, text

    check()
    assert seen == {True, False}  # both kinds of string were drawn


def test_codex_regex_is_portable() -> None:
    """No shorthand classes, no `.`: xgrammar's `.` and `\\w` differ from Python's."""
    pattern = to_regex("lark", CODEX_APPLY_PATCH)
    assert not re.search(r"(?<!\\)\\[wWdDsS]", pattern)
    assert re.search(r"(?<!\\)\.", pattern.replace("\\\\", "")) is None
    assert re.fullmatch(pattern, "*** Begin Patch\n*** Delete File: a b\n*** End Patch")
    assert not re.fullmatch(pattern, "*** Begin Patch\n*** End Patch\n")


# --- unconvertible -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [r"a(?=b)b", r"(?<!x)a", r"(a)\1", r"(a)?(?(1)b|c)", r"a++", r"(?>ab)",
                                     r"a\bb", r"a^b"])
def test_unconvertible_regexes_raise(pattern: str) -> None:
    with pytest.raises(GrammarConversionError):
        to_regex("regex", pattern)
    with pytest.raises(GrammarConversionError):
        to_ebnf("regex", pattern, json_escaped=False)


@pytest.mark.parametrize("definition", ['start: A\nA: /a(?!b)/\n', 'start: A A\nA: /(x)\\1/\n',
                                        '%import foreign.grammar\nstart: "a"\n', "start: (\n",
                                        'start: a\nA: "x"\n',
                                        # common.ESCAPED_STRING ends on a lookbehind: a known gap
                                        'start: ESCAPED_STRING\n%import common.ESCAPED_STRING\n'])
def test_unconvertible_lark_raises(definition: str) -> None:
    with pytest.raises(GrammarConversionError):
        to_ebnf("lark", definition, json_escaped=True)


def test_recursive_lark_has_ebnf_but_no_regex() -> None:
    with pytest.raises(GrammarConversionError, match="recursive"):
        to_regex("lark", IMPORTS_PRIORITIES)
    assert "root ::=" in to_ebnf("lark", IMPORTS_PRIORITIES, json_escaped=False)


def test_conversions_are_cached() -> None:
    assert to_ebnf("lark", BOUNDED_PATCH, json_escaped=True) is to_ebnf("lark", BOUNDED_PATCH, json_escaped=True)
    assert to_regex("lark", BOUNDED_PATCH) is to_regex("lark", BOUNDED_PATCH)


def test_unknown_syntax_raises() -> None:
    with pytest.raises(GrammarConversionError):
        to_ebnf("ebnf", "root ::= \"a\"", json_escaped=False)


# --- the EBNF route (and the regex as xgrammar reads it), checked with xgrammar -------------------------------------

def _oracle(jobs: list[dict[str, Any]]) -> list[Any]:
    if not ORACLE_PYTHON.exists():
        pytest.skip(f"no tiny vLLM environment at {ORACLE_PYTHON} (xgrammar lives there; set TINY_VLLM_PYTHON)")
    probe = subprocess.run([str(ORACLE_PYTHON), "-c", "import xgrammar"], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        pytest.skip(f"{ORACLE_PYTHON} cannot import xgrammar: {probe.stderr.strip()[-200:]}")
    done = subprocess.run([str(ORACLE_PYTHON), str(ORACLE)], input=json.dumps({"jobs": jobs}), capture_output=True,
                          text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results: list[Any] = json.loads(done.stdout)["results"]
    return results


@pytest.fixture(scope="module")
def xgrammar_verdicts() -> dict[tuple[str, str, str], tuple[list[str], list[bool], list[bool]]]:
    """One oracle call for every tool: (syntax, name, form) -> (strings, gateway's verdicts, xgrammar's)."""
    plan: list[tuple[tuple[str, str, str], dict[str, Any], list[str], list[bool]]] = []
    for syntax, name in ALL_TOOLS:
        definition = _definition(syntax, name)
        judge = _judge(syntax, definition)
        strings = _collect(syntax, definition)
        expected = [judge(s) for s in strings]
        escaped = [json.dumps(s, ensure_ascii=False)[1:-1] for s in strings]
        plan.append(((syntax, name, "raw"), {"ebnf": to_ebnf(syntax, definition, json_escaped=False),
                                              "strings": strings}, strings, expected))
        plan.append(((syntax, name, "escaped"), {"ebnf": to_ebnf(syntax, definition, json_escaped=True),
                                                  "strings": escaped}, strings, expected))
        if syntax == "regex" or name in REGULAR:
            plan.append(((syntax, name, "regex"), {"regex": to_regex(syntax, definition), "strings": strings},
                         strings, expected))
            # the strict-tool route: the pattern inside a JSON schema, judged on whole JSON arguments
            schema = {"type": "object", "properties": {"input": {
                "type": "string", "pattern": to_json_pattern(syntax, definition)}}, "required": ["input"]}
            documents = [json.dumps({"input": s}, ensure_ascii=False) for s in strings]
            plan.append(((syntax, name, "json_pattern"), {"json_schema": schema, "strings": documents},
                         strings, expected))
    results = _oracle([job for _, job, _, _ in plan])
    return {key: (strings, expected, got) for (key, _, strings, expected), got in zip(plan, results, strict=True)}


@pytest.mark.parametrize("form", ["raw", "escaped", "regex", "json_pattern"])
@pytest.mark.parametrize(("syntax", "name"), ALL_TOOLS)
def test_xgrammar_accepts_what_the_gateway_accepts(
        xgrammar_verdicts: dict[tuple[str, str, str], tuple[list[str], list[bool], list[bool]]],
        syntax: str, name: str, form: str) -> None:
    if (syntax, name, form) not in xgrammar_verdicts:
        assert form in ("regex", "json_pattern") and name not in REGULAR
        return
    strings, expected, got = xgrammar_verdicts[(syntax, name, form)]
    assert isinstance(got, list), f"xgrammar refused the converted grammar: {got}"
    wrong = [(s, e) for s, e, g in zip(strings, expected, got, strict=True) if e != g]
    assert not wrong, f"{len(wrong)} of {len(strings)} disagree, e.g. {wrong[:3]!r}"
    # the property is worth something only if both verdicts occur
    assert any(expected) and not all(expected), (sum(expected), len(expected))


def test_escaped_grammar_takes_only_canonical_escapes() -> None:
    """`\\u0041` and `\\/` decode to the same text, but only json.dumps' own spelling is accepted."""
    ebnf = to_ebnf("regex", r"[A/]\n", json_escaped=True)
    jobs = [{"ebnf": ebnf, "strings": ["A\\n", "/\\n", "\\u0041\\n", "\\/\\n", "A\n", "A\\u000a"]}]
    assert _oracle(jobs) == [[True, True, False, False, False, False]]


def test_doubling_grammar_is_refused_not_rendered() -> None:
    """Each rule uses the previous one twice: inlined, 2**40 copies. Refused by size, quickly."""
    rules = ['r0: "ab"'] + [f"r{i}: r{i - 1} r{i - 1}" for i in range(1, 41)]
    definition = "start: r40\n" + "\n".join(rules) + "\n"
    with pytest.raises(GrammarConversionError, match="too large"):
        to_regex("lark", definition)
    assert "root ::=" in to_ebnf("lark", definition, json_escaped=False)


def test_case_insensitive_literal_is_cheap_and_exact() -> None:
    """(?i) on a long literal: folded per distinct character (cached), exact for the Kelvin sign and long s."""
    pattern = to_regex("regex", "(?i)" + "ks" * 2000)
    assert re.fullmatch(pattern, "K\u017f" * 2000)
    assert re.fullmatch(pattern, "kS" * 2000)
    assert not re.fullmatch(pattern, "kx" * 2000)


def test_earley_greedy_gap_is_what_the_docstring_says() -> None:
    """The documented gap: Lark's dynamic lexer matches /\\w+/ greedily and so rejects "cats" here; the
    conversion (the grammar's context-free language) accepts it. Kept visible so a change either way is seen."""
    definition = 'start: WORD "s"\nWORD: /[a-z]+/\n'
    assert re.fullmatch(to_regex("lark", definition), "cats")
    assert not _judge("lark", definition)("cats")


def test_no_case_mappings_above_the_scanned_range() -> None:
    """(?i) folding scans code points below CASED_LIMIT only; true on this Python's Unicode tables."""
    from gateway.translate.grammar_convert import CASED_LIMIT

    above = [c for c in map(chr, range(CASED_LIMIT, 0x110000)) if c.lower() != c or c.upper() != c
             or c.casefold() != c]
    assert above == []


def test_xgrammar_json_schema_pattern_is_not_escaped() -> None:
    """Why to_json_pattern exists: xgrammar puts a pattern's characters into the JSON string as they are, so
    the raw regex of a grammar with newlines admits only invalid JSON (a raw newline) and refuses `\\n`."""
    raw = {"type": "object", "properties": {"input": {"type": "string", "pattern": to_regex("regex", "a\nb")}},
           "required": ["input"]}
    escaped = {"type": "object", "properties": {"input": {
        "type": "string", "pattern": to_json_pattern("regex", "a\nb")}}, "required": ["input"]}
    good, bad = json.dumps({"input": "a\nb"}), '{"input": "a\nb"}'
    assert _oracle([{"json_schema": raw, "strings": [good, bad]},
                    {"json_schema": escaped, "strings": [good, bad]}]) == [[False, True], [True, False]]


def test_xml_argument_formats_take_the_raw_regex() -> None:
    """The other side of the same coin: in an XML-parameter format (qwen3_coder's `qwen_xml` style) xgrammar
    applies the pattern to the raw value, so there the raw regex (to_regex) is the right one and the escaped
    pattern is not. Which one a strict tool's schema needs therefore depends on the upstream's call format."""
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    escaped = json.dumps(patch)[1:-1]

    def tag(pattern: str) -> dict[str, Any]:
        schema = {"type": "object", "properties": {"input": {"type": "string", "pattern": pattern}},
                  "required": ["input"]}
        return {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema,
                                                     "style": "qwen_xml"}}

    strings = [f"<parameter=input>{patch}</parameter>", f"<parameter=input>{escaped}</parameter>",
               "<parameter=input>*** Begin Patch\n*** End Patch</parameter>"]
    assert _oracle([{"structural_tag": tag(to_regex("lark", BOUNDED_PATCH)), "strings": strings},
                    {"structural_tag": tag(to_json_pattern("lark", BOUNDED_PATCH)), "strings": strings}]) == [
        [True, False, False], [False, True, False]]
