"""Grammar checks parse with LALR when the grammar allows it, and their verdicts are Earley's.

Codex's apply_patch grammar (codex-rs, tools/handlers/apply_patch.lark) is the grammar that matters: the
property below generates patches, valid ones and broken ones, and checks that the LALR parser
``load_lark`` builds accepts exactly what an Earley parser of the same grammar accepts.
"""

from __future__ import annotations

import lark
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.enforce.validate import _rewrite_zero_width, load_lark
from tests.test_live_vllm_enforce import LARK_PATCH

CODEX_APPLY_PATCH = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""

# The bounded form the live enforcement tests use (loads in lark as written).
BOUNDED_PATCH = LARK_PATCH

GRAMMARS = {"codex": CODEX_APPLY_PATCH, "bounded": BOUNDED_PATCH}


def _accepts(parser: lark.Lark, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def _pair(name: str) -> tuple[lark.Lark, lark.Lark]:
    grammar = _rewrite_zero_width(GRAMMARS[name])
    return lark.Lark(grammar, parser="lalr"), lark.Lark(grammar, parser="earley")


PARSERS = {name: _pair(name) for name in GRAMMARS}

# Line text: the characters that matter to the grammar (markers, prefixes, spaces) and some that do not.
_text = st.text(alphabet="ab*@+- .\t\u00e9\U0001F600:/_", max_size=12)
_name = st.one_of(st.from_regex(r"[a-z][a-z0-9_]{0,6}\.txt", fullmatch=True), _text.filter(bool))


@st.composite
def _hunk(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["add", "delete", "update"]))
    name = draw(_name)
    if kind == "delete":
        return f"*** Delete File: {name}\n"
    if kind == "add":
        lines = draw(st.lists(_text, min_size=1, max_size=4))
        return f"*** Add File: {name}\n" + "".join(f"+{t}\n" for t in lines)
    out = f"*** Update File: {name}\n"
    if draw(st.booleans()):
        out += f"*** Move to: {draw(_name)}\n"
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 3)) == 0:
            header = draw(_text.filter(bool))
            out += "@@\n" if draw(st.booleans()) else f"@@ {header}\n"
        else:
            out += draw(st.sampled_from(["+", "-", " "])) + draw(_text) + "\n"
    if draw(st.booleans()):
        out += "*** End of File\n"
    return out


@st.composite
def patches(draw: st.DrawFn) -> str:
    text = "*** Begin Patch\n" + "".join(draw(st.lists(_hunk(), min_size=0, max_size=3)))
    text += "*** End Patch" + ("\n" if draw(st.booleans()) else "")
    # Broken ones too: characters dropped, inserted (a newline among them), lines doubled.
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["drop", "insert", "double"]))
        i = draw(st.integers(0, max(0, len(text) - 1)))
        if op == "drop" and text:
            text = text[:i] + text[i + 1:]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from(["\n", "+", "*", " ", "@"])) + text[i:]
        else:
            lines = text.split("\n")
            j = i % len(lines)
            text = "\n".join(lines[: j + 1] + lines[j:])
    return text


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_patch_grammars_load_as_lalr(name: str) -> None:
    checker = load_lark(GRAMMARS[name])
    assert checker.parser is not None and checker.parser.options.parser == "lalr"
    assert checker.rewritten is (name == "codex")  # /(.*)/ is zero-width for lark: rewritten to /.+/?


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=patches())
def test_lalr_accepts_what_earley_accepts(name: str, text: str) -> None:
    lalr_parser, earley_parser = PARSERS[name]
    expected = _accepts(earley_parser, text)
    assert _accepts(lalr_parser, text) is expected
    assert (load_lark(GRAMMARS[name]).check(text) is None) is expected


def test_codex_patches_of_every_kind() -> None:
    checker = load_lark(CODEX_APPLY_PATCH)
    ok = ("*** Begin Patch\n*** Add File: src/caf\u00e9.py\n+\n+x = 1\n*** Delete File: old.txt\n"
          "*** Update File: a.py\n*** Move to: b.py\n@@ def f():\n-    return 1\n+    return 2\n \n*** End of File\n"
          "*** End Patch\n")
    assert checker.check(ok) is None
    assert checker.check(ok.removesuffix("\n")) is None  # the last LF is optional
    assert checker.check("*** Begin Patch\n*** End Patch\n") is not None  # at least one hunk
    assert checker.check("*** Begin Patch\n*** Add File: a\n*** End Patch\n") is not None  # add needs a line


def test_a_grammar_that_is_not_lalr_falls_back_to_earley() -> None:
    ambiguous = 'start: a "x" | b "y"\na: "q"\nb: "q"\n'  # reduce/reduce without a lookahead to decide: fine
    not_lalr = 'start: a "x" "y" | b "x" "z"\na: "q"\nb: "q"\n'  # reduce/reduce on "x": not LALR(1)
    assert load_lark(ambiguous).parser.options.parser == "lalr"
    checker = load_lark(not_lalr)
    assert checker.parser is not None and checker.parser.options.parser == "earley"
    assert checker.check("qxz") is None and checker.check("qxy") is None and checker.check("qxx") is not None


def test_an_lalr_rejection_is_confirmed_with_earley() -> None:
    # lark resolves this shift/reduce conflict as a shift, so its LALR parser rejects "a b c", which the
    # grammar derives (c "b" "c"); the checker asks Earley before calling it a mismatch.
    grammar = 'start: "a" "b" | c "b" "c"\nc: "a"\n%ignore " "\n'
    checker = load_lark(grammar)
    assert checker.parser is not None and checker.parser.options.parser == "lalr"
    assert not _accepts(checker.parser, "a b c")
    assert checker.check("a b c") is None and checker.check("a b") is None
    assert checker.check("a c") is not None
