"""Grammar conversion for one-request enforcement (issue 18): a custom tool's Lark or regex grammar -> the form
vLLM needs (xgrammar EBNF for a structural tag's content; a regular expression for a strict schema's ``pattern``).

How it works:

- A Lark grammar is loaded by ``lark`` itself (``lark.Lark(..., parser="earley")``, the parser the gateway's
  validator settles its verdicts with), which resolves ``%import common.X``, templates, aliases, ``?``/``*``/
  ``+``/``[]`` and string literals into plain rules over terminals; every terminal is then one Python regex
  (``pattern.to_regexp()``, flags included). Nothing here parses Lark text.
- Every regex (a Lark terminal, or a ``syntax: regex`` tool) is parsed by the stdlib's own regex parser
  (``re._parser``) into a small tree of character sets, sequences, alternatives and repeats. Character sets
  are computed exactly as Python's ``re`` sees them (Unicode ``\\w``/``\\d``/``\\s``, ``.`` without ``\\n``
  unless DOTALL, IGNORECASE folds), by letting ``re`` itself scan the code points. Lookarounds, backreferences,
  conditionals, possessive repeats, atomic groups and anchors other than a leading ``^``/trailing ``$`` change
  what a pattern accepts in ways EBNF cannot say: GrammarConversionError.
- The tree is written out as xgrammar EBNF (rules may recurse) or as a regex (Lark rules inlined; the left or
  right recursion Lark builds for ``+``/``*`` becomes a repeat, any other recursion is GrammarConversionError).
  Emitted regexes use only explicit classes and literal characters, so Python, JSON-schema validators and
  xgrammar's regex converter (whose ``.`` and ``\\w`` differ from Python's) read them alike.
- Three outputs: ``to_ebnf`` (a structural tag's grammar content, raw or JSON-escaped), ``to_regex`` (the raw
  strings, for anything that applies a regex to the decoded input), ``to_json_pattern`` (a JSON-schema
  ``pattern`` as xgrammar applies it: to the escaped text between the quotes; xgrammar 0.2.8 does not escape a
  pattern's characters itself).
- ``%ignore``: ignored terminals may appear before every token and at the end, as Lark's lexers skip them.
- ``json_escaped``: done on the tree, each character set split into the characters a JSON string carries as
  they are and the ones it must escape, each of those replaced by its escape. Only the canonical escapes
  are accepted, the ones ``json.dumps(s, ensure_ascii=False)`` writes (``\\"``, ``\\\\``, ``\\b``, ``\\f``,
  ``\\n``, ``\\r``, ``\\t``, ``\\u00XX`` for other control characters; other characters raw). The upstream's
  parser json-decodes the arguments, so a narrower set of spellings is safe: it only removes ways for the
  model to write the same string.

What "accepts" means: the language of the grammar read as a context-free grammar over its terminals' regular
languages. Lark's Earley (the validator's final word) matches each regex terminal greedily at a position
(its dynamic lexer), so where a terminal's longest match would swallow what the next token needs (``/\\w+/ "s"``
against ``"cats"``) Lark rejects a string this conversion accepts. Codex's apply_patch grammar and the
grammars the tests use have no such overlap; ``terminal priorities`` only choose between parses and do not
change Earley's language, so they are read and dropped.
"""

from __future__ import annotations

import array
import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from re import _constants as sre_c
from re import _parser as sre_parse
from typing import TYPE_CHECKING, Any

from gateway.translate.lark_rewrite import foreign_import, rewrite_zero_width

if TYPE_CHECKING:
    import lark

__all__ = ["GrammarConversionError", "to_ebnf", "to_json_pattern", "to_regex"]

_CACHE_SIZE = 64
_MAX_CODE = 0x10FFFF


class GrammarConversionError(ValueError):
    """The grammar cannot be converted to the requested form (the caller falls back to the takeover)."""


# --- the tree -------------------------------------------------------------------------------------------

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive code point ranges


@dataclass(frozen=True, slots=True)
class Chars:
    ranges: Ranges


@dataclass(frozen=True, slots=True)
class Lit:
    text: str


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    item: Node
    min: int
    max: int | None  # None: unbounded


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to a named rule (Lark rules and terminals)."""
    name: str


Node = Chars | Lit | Seq | Alt | Repeat | Ref
EMPTY = Lit("")


def _seq(items: Iterable[Node]) -> Node:
    flat: list[Node] = []
    for item in items:
        if isinstance(item, Seq):
            flat.extend(item.items)
        elif item != EMPTY:
            flat.append(item)
    # merge adjacent literals: shorter output, same language
    merged: list[Node] = []
    for item in flat:
        if merged and isinstance(item, Lit) and isinstance(merged[-1], Lit):
            merged[-1] = Lit(merged[-1].text + item.text)
        else:
            merged.append(item)
    if not merged:
        return EMPTY
    return merged[0] if len(merged) == 1 else Seq(tuple(merged))


def _alt(items: Iterable[Node]) -> Node:
    out: list[Node] = []
    for item in items:
        for sub in item.items if isinstance(item, Alt) else (item,):
            if sub not in out:
                out.append(sub)
    if not out:
        raise GrammarConversionError("an alternative with no branches")
    if len(out) == 1:
        return out[0]
    if EMPTY in out:  # a | "" -> a?
        return _repeat(_alt(b for b in out if b != EMPTY), 0, 1)
    factored = _factor(out, 0)
    if len(factored) == len(out):
        factored = _factor(out, -1)
    if len(factored) < len(out):
        return _alt(factored)
    return Alt(tuple(out))


def _items(node: Node) -> tuple[Node, ...]:
    return node.items if isinstance(node, Seq) else (node,)


def _factor(branches: list[Node], edge: int) -> list[Node]:
    """Branches sharing their first (edge 0) or last (edge -1) item merged: ``a b | a c`` -> ``a (b | c)``.
    The language is the same (concatenation distributes over alternation); Lark's expansion of ``[x]`` and
    ``x?`` into every combination otherwise repeats long prefixes in the regex."""
    groups: dict[Node, list[Node]] = {}
    for branch in branches:
        groups.setdefault(_items(branch)[edge], []).append(branch)
    out: list[Node] = []
    for key, members in groups.items():
        if len(members) == 1:
            out.append(members[0])
            continue
        rests = [_seq(_items(m)[1:] if edge == 0 else _items(m)[:-1]) for m in members]
        rest = _alt(rests)
        out.append(_seq([key, rest] if edge == 0 else [rest, key]))
    return out


# --- character sets -------------------------------------------------------------------------------------

def _normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(ranges: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CODE:
        out.append((nxt, _MAX_CODE))
    return tuple(out)


def _subtract(ranges: Ranges, remove: Ranges) -> Ranges:
    return _complement(_normalize(_complement(ranges) + remove))


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_normalize(_complement(a) + _complement(b)))


def _all_chars() -> str:
    """Every code point (surrogates included, as ``re`` sees them), built per use and not kept (4 MB): only the
    small results of the scans are cached. ~0.1 s."""
    return array.array("I", range(_MAX_CODE + 1)).tobytes().decode("utf-32-le", "surrogatepass")


@functools.cache
def _scan(pattern: str, flags: int) -> Ranges:
    """The code points a one-character pattern matches, found by ``re`` itself (exact, Unicode tables
    included). ~0.2 s, once per pattern per process."""
    runs = re.finditer(f"(?:{pattern})+", _all_chars(), flags)
    return tuple((m.start(), m.end() - 1) for m in runs)


# No code point at or above this has a case mapping (tests/test_grammar_convert.py checks it on this Python).
CASED_LIMIT = 0x20000


@functools.cache
def _cased() -> str:
    """Characters that IGNORECASE can relate to another character: only these need checking under (?i)."""
    chars = set()
    for c in map(chr, range(CASED_LIMIT)):
        low, up = c.lower(), c.upper()
        if low != c or up != c or c.casefold() != c:
            chars.add(c)
            chars.update(x for x in (low, up) if len(x) == 1)
    return "".join(sorted(chars))


def _class_regex(ranges: Ranges) -> str:
    return "[" + "".join(_esc_class(lo) + ("" if lo == hi else "-" + _esc_class(hi)) for lo, hi in ranges) + "]"


@functools.lru_cache(maxsize=1024)
def _fold(ranges: Ranges, flags: int) -> Ranges:
    """The set under IGNORECASE: the set itself plus the cased characters ``re`` matches against it."""
    if not ranges:
        return ranges
    rx = re.compile(_class_regex(ranges), flags | re.IGNORECASE)
    cased = _cased()
    if flags & re.ASCII:
        cased = "".join(c for c in cased if ord(c) < 128)
    extra = [(ord(c), ord(c)) for c in cased if rx.match(c)]
    return _normalize(ranges + tuple(extra))


_CATEGORY_PATTERNS = {
    sre_c.CATEGORY_DIGIT: r"\d", sre_c.CATEGORY_NOT_DIGIT: r"\D", sre_c.CATEGORY_SPACE: r"\s",
    sre_c.CATEGORY_NOT_SPACE: r"\S", sre_c.CATEGORY_WORD: r"\w", sre_c.CATEGORY_NOT_WORD: r"\W",
}


def _set_of_in(items: Sequence[tuple[Any, Any]], flags: int) -> Ranges:
    negate = False
    ranges: list[tuple[int, int]] = []
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            ranges.append((av, av))
        elif op is sre_c.RANGE:
            ranges.append((av[0], av[1]))
        elif op is sre_c.CATEGORY:
            pattern = _CATEGORY_PATTERNS.get(av)
            if pattern is None:
                raise GrammarConversionError(f"unsupported regex category {av}")
            ranges.extend(_scan(pattern, flags & re.ASCII))
        else:
            raise GrammarConversionError(f"unsupported item in a regex character class ({op})")
    result = _normalize(ranges)
    if flags & re.IGNORECASE:
        result = _fold(result, flags & re.ASCII)
    return _complement(result) if negate else result


# --- regex -> tree ---------------------------------------------------------------------------------------

_UNCONVERTIBLE = {
    "ASSERT": "a lookahead or lookbehind", "ASSERT_NOT": "a negative lookahead or lookbehind",
    "GROUPREF": "a backreference", "GROUPREF_EXISTS": "a conditional group", "GROUPREF_IGNORE": "a backreference",
    "POSSESSIVE_REPEAT": "a possessive repeat", "ATOMIC_GROUP": "an atomic group",
}
_BEGIN = (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING)
_END = (sre_c.AT_END, sre_c.AT_END_STRING)


def regex_tree(pattern: str, *, full_match: bool) -> Node:
    """A Python regex -> the tree. ``full_match``: the regex is used whole (a tool's regex, ``fullmatch``), so
    a leading ``^``/``\\A`` and a trailing ``$``/``\\Z`` are no-ops and dropped."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise GrammarConversionError(f"the regex does not compile in Python ({exc})") from exc
    flags = parsed.state.flags
    if flags & re.VERBOSE:
        flags &= ~re.VERBOSE  # already applied by the parser
    items = list(parsed.data)
    if full_match:
        items = _strip_anchors(items)
    return _tree(items, flags)


def _strip_anchors(items: list[Any]) -> list[Any]:
    if len(items) == 1 and items[0][0] is sre_c.BRANCH:
        _, branches = items[0][1]
        return [(sre_c.BRANCH, (None, [_SubList(_strip_anchors(list(b.data))) for b in branches]))]
    while items and items[0][0] is sre_c.AT and items[0][1] in _BEGIN:
        items = items[1:]
    while items and items[-1][0] is sre_c.AT and items[-1][1] in _END:
        items = items[:-1]
    return items


@dataclass(slots=True)
class _SubList:
    data: list[Any]


def _tree(items: Iterable[Any], flags: int) -> Node:
    return _seq(_node(op, av, flags) for op, av in items)


def _literal(code: int, flags: int) -> Node:
    if flags & re.IGNORECASE:
        ranges = _fold(((code, code),), flags & re.ASCII)
        if len(ranges) != 1 or ranges[0][0] != ranges[0][1]:
            return Chars(ranges)
    return Lit(chr(code))


def _node(op: Any, av: Any, flags: int) -> Node:
    name = str(op)
    if name in _UNCONVERTIBLE:
        raise GrammarConversionError(f"the regex uses {_UNCONVERTIBLE[name]}, which a grammar cannot express")
    if op is sre_c.LITERAL:
        return _literal(av, flags)
    if op is sre_c.NOT_LITERAL:
        return Chars(_complement(_set_of_in([(sre_c.LITERAL, av)], flags)))
    if op is sre_c.ANY:
        return Chars(((0, _MAX_CODE),) if flags & re.DOTALL else _complement(((10, 10),)))
    if op is sre_c.IN:
        return Chars(_set_of_in(av, flags))
    if op is sre_c.BRANCH:
        return _alt(_tree(branch.data, flags) for branch in av[1])
    if op is sre_c.SUBPATTERN:
        _, add_flags, del_flags, sub = av
        return _tree(sub.data, (flags | add_flags) & ~del_flags)
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
        lo, hi, sub = av
        # lazy and greedy repeats accept the same whole strings
        return _repeat(_tree(sub.data, flags), lo, None if hi is sre_c.MAXREPEAT else hi)
    if op is sre_c.AT:
        raise GrammarConversionError("the regex uses an anchor or word boundary inside the pattern")
    raise GrammarConversionError(f"unsupported regex construct ({name})")


def _repeat(item: Node, lo: int, hi: int | None) -> Node:
    if hi == 0 or item == EMPTY:
        return EMPTY
    if lo == hi == 1:
        return item
    return Repeat(item, lo, hi)


# --- JSON escaping on the tree ----------------------------------------------------------------------------

_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_ESCAPED: Ranges = _normalize([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])


def _json_escape(code: int) -> str:
    return _SHORT_ESCAPES.get(code) or f"\\u{code:04x}"


def json_escaped_tree(node: Node) -> Node:
    """The tree accepting the JSON-string-escaped spelling (json.dumps(s, ensure_ascii=False)[1:-1]) of each
    string ``node`` accepts."""
    if isinstance(node, Lit):
        return Lit("".join(_json_escape(ord(c)) if _in(ord(c), _ESCAPED) else c for c in node.text))
    if isinstance(node, Chars):
        plain = _subtract(node.ranges, _ESCAPED)
        escaped = _intersect(node.ranges, _ESCAPED)
        branches: list[Node] = [Chars(plain)] if plain else []
        for lo, hi in escaped:
            branches.extend(Lit(_json_escape(c)) for c in range(lo, hi + 1))
        return _alt(branches) if branches else Chars(())
    if isinstance(node, Seq):
        return _seq(json_escaped_tree(i) for i in node.items)
    if isinstance(node, Alt):
        return _alt(json_escaped_tree(i) for i in node.items)
    if isinstance(node, Repeat):
        return Repeat(json_escaped_tree(node.item), node.min, node.max)
    return node  # Ref: the referenced rule is escaped itself


def _in(code: int, ranges: Ranges) -> bool:
    return any(lo <= code <= hi for lo, hi in ranges)


# --- Lark -> rules ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Grammar:
    rules: dict[str, Node]  # rule name -> body (over Refs to rules and terminals)
    start: str


def _load_lark(definition: str) -> lark.Lark:
    import lark

    foreign = foreign_import(definition)
    if foreign is not None:
        raise GrammarConversionError(f"the grammar imports {foreign!r}, which the gateway does not load")
    try:
        return lark.Lark(definition, parser="earley")
    except lark.exceptions.LarkError as exc:
        first = exc
    except Exception as exc:  # lark raising something else on odd input
        raise GrammarConversionError(f"lark cannot load the grammar ({type(exc).__name__})") from exc
    rewritten = rewrite_zero_width(definition)
    if rewritten != definition:
        try:
            return lark.Lark(rewritten, parser="earley")
        except Exception:
            pass
    raise GrammarConversionError(f"lark cannot load the grammar ({type(first).__name__})") from first


def _lark_grammar(definition: str) -> _Grammar:
    parser = _load_lark(definition)
    terminals = {t.name: t for t in parser.terminals}
    ignore = [name for name in parser.ignore_tokens]
    names: dict[str, str] = {}

    def rule_name(lark_name: str, terminal: bool) -> str:
        key = ("T" if terminal else "R") + lark_name
        if key not in names:
            safe = re.sub(r"[^A-Za-z0-9_]", "_", lark_name).strip("_") or "x"
            names[key] = f"{'t' if terminal else 'r'}{len(names)}_{safe}"
        return names[key]

    rules: dict[str, Node] = {}
    ign = "ign__"

    def terminal(name: str) -> Ref:
        target = rule_name(name, True)
        if target not in rules:
            term = terminals.get(name)
            if term is None:
                raise GrammarConversionError(f"terminal {name} has no pattern (%declare)")
            rules[target] = regex_tree(term.pattern.to_regexp(), full_match=False)
        return Ref(target)

    bodies: dict[str, list[Node]] = {}
    for rule in parser.rules:
        parts: list[Node] = []
        for sym in rule.expansion:
            if sym.is_term:
                if ignore:
                    parts.append(Ref(ign))
                parts.append(terminal(sym.name))
            else:
                parts.append(Ref(rule_name(sym.name, False)))
        bodies.setdefault(rule_name(rule.origin.name, False), []).append(_seq(parts))
    for name, alts in bodies.items():
        # as Lark wrote them (not factored): _linear reads the recursion of `+`/`*` from the branches' edges
        unique = tuple(dict.fromkeys(alts))
        rules[name] = unique[0] if len(unique) == 1 else Alt(unique)
    starts = parser.options.start
    start = starts[0] if isinstance(starts, list) else starts
    start_name = rule_name(start, False)
    if start_name not in rules:
        raise GrammarConversionError(f"the grammar has no rule {start!r}")
    root: list[Node] = [Ref(start_name)]
    if ignore:
        rules[ign] = Repeat(_alt(terminal(name) for name in ignore), 0, None)
        root.append(Ref(ign))
    rules["root"] = _seq(root)
    return _Grammar(rules, "root")


def _regex_grammar(definition: str) -> _Grammar:
    return _Grammar({"root": regex_tree(definition, full_match=True)}, "root")


def _grammar(syntax: str, definition: str) -> _Grammar:
    if syntax == "lark":
        return _lark_grammar(definition)
    if syntax == "regex":
        return _regex_grammar(definition)
    raise GrammarConversionError(f"unknown grammar syntax {syntax!r}")


def _reachable(grammar: _Grammar) -> list[str]:
    seen: list[str] = []
    stack = [grammar.start]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.append(name)
        stack.extend(reversed(_refs(grammar.rules[name])))
    return seen


def _refs(node: Node) -> list[str]:
    if isinstance(node, Ref):
        return [node.name]
    if isinstance(node, (Seq, Alt)):
        return [r for i in node.items for r in _refs(i)]
    if isinstance(node, Repeat):
        return _refs(node.item)
    return []


# --- tree -> EBNF -------------------------------------------------------------------------------------------

_EBNF_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _.,:;!?#$%&'()*+/<=>@{}|~`")


def _esc_ebnf(code: int) -> str:
    """A character inside an EBNF string or class: plain when harmless in both, else a \\u escape."""
    c = chr(code)
    if c in _EBNF_PLAIN:
        return c
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _ebnf(node: Node) -> str:
    if isinstance(node, Lit):
        return '"' + "".join(_esc_ebnf(ord(c)) for c in node.text) + '"'
    if isinstance(node, Chars):
        if not node.ranges:
            raise GrammarConversionError("a character set that matches nothing")
        return "[" + "".join(_esc_ebnf(lo) + ("" if lo == hi else "-" + _esc_ebnf(hi))
                             for lo, hi in node.ranges) + "]"
    if isinstance(node, Ref):
        return node.name
    if isinstance(node, Seq):
        return " ".join(_ebnf_atom(i) if isinstance(i, Alt) else _ebnf(i) for i in node.items)
    if isinstance(node, Alt):
        return " | ".join(_ebnf(i) for i in node.items)
    return _ebnf_atom(node.item) + _quantifier(node.min, node.max)


def _ebnf_atom(node: Node) -> str:
    text = _ebnf(node)
    return f"({text})" if isinstance(node, (Seq, Alt, Repeat)) else text


def _quantifier(lo: int, hi: int | None) -> str:
    if (lo, hi) == (0, None):
        return "*"
    if (lo, hi) == (1, None):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    if hi is None:
        return f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _to_ebnf(syntax: str, definition: str, json_escaped: bool) -> str:
    try:
        return _render_ebnf(_grammar(syntax, definition), json_escaped)
    except RecursionError as exc:
        raise GrammarConversionError("the grammar nests too deeply") from exc


def _render_ebnf(grammar: _Grammar, json_escaped: bool) -> str:
    lines = []
    for name in _reachable(grammar):
        body = grammar.rules[name]
        if json_escaped:
            body = json_escaped_tree(body)
        lines.append(f"{name} ::= {_ebnf(body)}")
    return "\n".join(lines) + "\n"


def to_ebnf(syntax: str, definition: str, *, json_escaped: bool) -> str:
    """xgrammar EBNF (root rule ``root``) accepting exactly the strings the grammar accepts; with ``json_escaped``
    it accepts their JSON-string-escaped forms instead (the text between the quotes of a JSON string).
    ``syntax`` is the custom tool format's ``syntax``: ``"lark"`` or ``"regex"``. Cached (bounded LRU)."""
    return _to_ebnf(syntax, definition, json_escaped)


# --- tree -> regex -------------------------------------------------------------------------------------------

def _inline(grammar: _Grammar) -> Node:
    """The start rule with every rule inlined; a rule that recurses only at its left or right edge (what Lark
    builds for ``+`` and ``*``) becomes a repeat; any other recursion is not regular here."""
    done: dict[str, Node] = {}

    def expand(name: str, active: tuple[str, ...]) -> Node:
        if name in done:
            return done[name]
        if name in active:
            raise GrammarConversionError(f"the grammar is recursive (through {name}), not a regular expression")
        body = grammar.rules[name]
        result = _linear(name, body, (*active, name), expand)
        if _size(result, {}) > _MAX_REGEX_SIZE:  # checked per rule, before a parent copies it again
            raise GrammarConversionError("the grammar's regular expression would be too large")
        done[name] = result
        return result

    return expand(grammar.start, ())


def _linear(name: str, body: Node, active: tuple[str, ...], expand: Callable[[str, tuple[str, ...]], Node]) -> Node:
    branches = body.items if isinstance(body, Alt) else (body,)
    base: list[Node] = []
    left: list[Node] = []  # name X: R = base X*
    right: list[Node] = []  # X name: R = X* base
    for branch in branches:
        items = branch.items if isinstance(branch, Seq) else (branch,)
        if items and items[0] == Ref(name) and Ref(name) not in _refs_shallow(items[1:]):
            left.append(_seq(items[1:]))
        elif items and items[-1] == Ref(name) and Ref(name) not in _refs_shallow(items[:-1]):
            right.append(_seq(items[:-1]))
        else:
            base.append(branch)
    if left and right:
        raise GrammarConversionError(f"the grammar is recursive on both sides of {name}")
    if not base:
        raise GrammarConversionError(f"rule {name} never ends")

    def sub(node: Node) -> Node:
        if isinstance(node, Ref):
            return expand(node.name, active)
        if isinstance(node, Seq):
            return _seq(sub(i) for i in node.items)
        if isinstance(node, Alt):
            return _alt(sub(i) for i in node.items)
        if isinstance(node, Repeat):
            return _repeat(sub(node.item), node.min, node.max)
        return node

    core = _alt(sub(b) for b in base)
    if _alt(left or right or [EMPTY]) == _alt(base):  # R: X | R X -> X+ (Lark's `+`)
        return _repeat(core, 1, None)
    if left:
        return _seq([core, _repeat(_alt(sub(x) for x in left), 0, None)])
    if right:
        return _seq([_repeat(_alt(sub(x) for x in right), 0, None), core])
    return core


def _refs_shallow(items: Sequence[Node]) -> list[Ref]:
    return [Ref(r) for i in items for r in _refs(i)]


_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


def _esc_char(code: int) -> str:
    c = chr(code)
    if c in _REGEX_SPECIAL:
        return "\\" + c
    if code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF or code in (0x2028, 0x2029) or (
            0x80 <= code <= 0x9F):
        return f"\\u{code:04x}"
    return c


def _esc_class(code: int) -> str:
    c = chr(code)
    if c in "\\]^-[":
        return "\\" + c
    return c if c in _REGEX_SPECIAL else _esc_char(code)


# Inlining Lark rules copies a rule once per use: a grammar built to double at every level must not become a
# gigabyte string (the tree itself is shared, so measuring it is cheap).
_MAX_REGEX_SIZE = 100_000


def _size(node: Node, memo: dict[int, int]) -> int:
    """Roughly the rendered length of ``node`` (one per character set, literal character or operator)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if isinstance(node, Lit):
        size = len(node.text) + 1
    elif isinstance(node, Chars):
        size = 2 * len(node.ranges) + 2
    elif isinstance(node, (Seq, Alt)):
        size = sum(_size(i, memo) for i in node.items) + len(node.items)
    elif isinstance(node, Repeat):
        size = _size(node.item, memo) + 4
    else:
        size = 1
    memo[key] = min(size, _MAX_REGEX_SIZE + 1)
    return memo[key]


def _regex(node: Node) -> str:
    if isinstance(node, Lit):
        return "".join(_esc_char(ord(c)) for c in node.text)
    if isinstance(node, Chars):
        if not node.ranges:
            return "[^\\u0000-\\U0010ffff]"
        if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
            return _esc_char(node.ranges[0][0])
        return _class_regex_out(node.ranges)
    if isinstance(node, Seq):
        return "".join(_regex_atom(i) if isinstance(i, Alt) else _regex(i) for i in node.items)
    if isinstance(node, Alt):
        return "|".join(_regex(i) for i in node.items)
    if isinstance(node, Repeat):
        return _regex_atom(node.item) + _quantifier(node.min, node.max)
    raise GrammarConversionError("internal: an unresolved rule reference")


def _class_regex_out(ranges: Ranges) -> str:
    return "[" + "".join(_esc_class(lo) + ("" if lo == hi else "-" + _esc_class(hi)) for lo, hi in ranges) + "]"


def _regex_atom(node: Node) -> str:
    text = _regex(node)
    if isinstance(node, (Seq, Alt, Repeat)) or (isinstance(node, Lit) and len(node.text) != 1):
        return f"(?:{text})" if text else "(?:)"
    return text


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _regular_tree(syntax: str, definition: str) -> Node:
    try:
        tree = _inline(_grammar(syntax, definition))
        if _size(tree, {}) > _MAX_REGEX_SIZE:
            raise GrammarConversionError("the grammar's regular expression would be too large")
    except RecursionError as exc:
        raise GrammarConversionError("the grammar nests too deeply") from exc
    return tree


def _render_regex(tree: Node) -> str:
    # a top-level alternation is grouped, so a caller adding ^...$ anchors all of it
    return _regex_atom(tree) if isinstance(tree, Alt) else _regex(tree)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def to_regex(syntax: str, definition: str) -> str:
    """A regular expression (JSON-schema ``pattern`` dialect, anchored by the caller's use as a full match) that
    accepts exactly the raw strings the grammar accepts; GrammarConversionError when the grammar is not regular.
    Cached (bounded LRU).

    Not for xgrammar's JSON-schema ``pattern`` as it stands: xgrammar (0.2.8, in vLLM 0.32) writes a pattern's
    characters into the JSON string unescaped (a ``\\n`` in the pattern becomes a raw newline inside the
    string, a ``"`` ends it early); use ``to_json_pattern`` there."""
    return _render_regex(_regular_tree(syntax, definition))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def to_json_pattern(syntax: str, definition: str) -> str:
    """The ``pattern`` for a JSON-schema string property (the custom tool's ``input``) as xgrammar applies it:
    to the text between the quotes, so it accepts exactly the JSON-escaped spellings
    (``json.dumps(s, ensure_ascii=False)[1:-1]``) of the raw strings the grammar accepts. Checked against
    ``xgrammar.Grammar.from_json_schema`` in tests/test_grammar_convert.py. GrammarConversionError when the
    grammar is not regular. Cached (bounded LRU)."""
    return _render_regex(json_escaped_tree(_regular_tree(syntax, definition)))
