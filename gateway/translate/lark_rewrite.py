"""How the gateway reads a client's Lark grammar before loading it with ``lark`` (shared by the validator in
``gateway/enforce`` and the grammar converter, so both see the same grammar). Pure.

- ``foreign_import``: only Lark's own grammar library may be ``%import``-ed; any other import would make lark
  open files on the gateway's disk.
- ``rewrite_zero_width``: Python's ``lark`` refuses terminals that can match the empty string (``/[^\\n]*/``),
  which vLLM's grammar backends accept; such a rule-level terminal ``/X*/`` is rewritten into the equivalent
  ``/X+/?``.
"""

from __future__ import annotations

import re

__all__ = ["foreign_import", "rewrite_zero_width"]

# A Lark regex literal: /.../flags, with escaped slashes inside.
_LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/([imslux]*)")
# One atom followed by `*`: a class, an escape, `.`, or a group without nested groups.
_STAR_ATOM = re.compile(r"^(\[(?:\\.|[^\]\\])+\]|\\.|\.|\((?:\\.|[^()\\])*\)|[^\\()\[\]*+?{}|])\*$")
_LARK_IMPORTS = re.compile(r"^\s*%import\s+([A-Za-z_][\w.]*)", re.MULTILINE)
_STDLIB_GRAMMARS = frozenset({"common", "lark", "python", "unicode"})


def foreign_import(definition: str) -> str | None:
    """The first imported grammar that is not Lark's own library, or None."""
    for name in _LARK_IMPORTS.findall(definition):
        if name.split(".", 1)[0] not in _STDLIB_GRAMMARS:
            return str(name.split(".", 1)[0])
    return None


def _non_empty(pattern: str) -> str | None:
    """``X*`` (or ``(X*)``) -> ``X+``: the same language less the empty string; None if not of that shape."""
    inner = pattern
    while inner.startswith("(") and inner.endswith(")") and _balanced(inner[1:-1]):
        inner = inner[1:-1]
        if inner.startswith("?:"):
            inner = inner[2:]
    m = _STAR_ATOM.match(inner)
    return m.group(1) + "+" if m else None


def _balanced(s: str) -> bool:
    depth = 0
    escaped = False
    for ch in s:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def rewrite_zero_width(grammar: str) -> str:
    out_lines = []
    for line in grammar.splitlines(keepends=True):
        head = line.split(":", 1)[0].strip().lstrip("?!")
        is_terminal_def = ":" in line and head.isupper()

        def fix(m: re.Match[str], is_terminal_def: bool = is_terminal_def) -> str:
            pattern, flags = m.group(1), m.group(2)
            try:
                empty = re.fullmatch(pattern.replace("\\/", "/"), "") is not None
            except re.error:
                return m.group(0)
            if not empty or is_terminal_def:
                return m.group(0)
            plus = _non_empty(pattern)
            return f"/{plus}/{flags}?" if plus else m.group(0)

        out_lines.append(_LARK_REGEX.sub(fix, line))
    return "".join(out_lines)
