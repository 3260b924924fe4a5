"""Grammar conversion for one-request enforcement (issue 18): a custom tool's Lark or regex grammar -> the form
vLLM needs (xgrammar EBNF for a structural tag's content; a regular expression for a strict schema's ``pattern``).

INTERFACE STUB: the signatures below are a contract between the helpers building issue 18; the owner of this
module fills it in without changing them (adding functions is fine).
"""

from __future__ import annotations

__all__ = ["GrammarConversionError", "to_ebnf", "to_regex"]


class GrammarConversionError(ValueError):
    """The grammar cannot be converted to the requested form (the caller falls back to the takeover)."""


def to_ebnf(syntax: str, definition: str, *, json_escaped: bool) -> str:
    """xgrammar EBNF (root rule ``root``) accepting exactly the strings the grammar accepts; with ``json_escaped``
    it accepts their JSON-string-escaped forms instead (the text between the quotes of a JSON string).
    ``syntax`` is the custom tool format's ``syntax``: ``"lark"`` or ``"regex"``. Cached (bounded LRU)."""
    raise GrammarConversionError("not implemented yet")


def to_regex(syntax: str, definition: str) -> str:
    """A regular expression (JSON-schema ``pattern`` dialect, anchored by the caller's use as a full match) that
    accepts exactly the raw strings the grammar accepts; GrammarConversionError when the grammar is not regular.
    Cached (bounded LRU)."""
    raise GrammarConversionError("not implemented yet")
