"""Gateway-run web search: the search function the model is offered, ``web_search_call`` items, the results text
the model reads, ``url_citation`` annotations, and the history form. Pure; no I/O (the search itself runs in
gateway.engine.web_search, against a gateway.websearch provider).

When a provider is configured, a request's ``web_search``/``web_search_preview`` tool never reaches vLLM as such:
the model is offered a function (``search_function``: one ``query`` argument; named ``web_search`` unless a client
tool has that name). A model call of it is *gateway-owned*: the client sees a ``web_search_call`` item
(``ws_…``, ``action: {"type": "search", "query", "queries"}``, ``sources`` with the include
``web_search_call.action.sources``), the gateway runs the search and hands the model the numbered results
(``results_text``) as the call's output. The model is asked to cite a result as ``[n]``; those markers in the
final message's text become ``url_citation`` annotations (``citations``) — only markers that number a result of
this response, and only the ones the gateway asked for.

State: the results the model read are sealed into the item (``encrypted_content``, AES-GCM, bound to the owner,
as reasoning is: gateway.translate.sealing) so a later turn — chained from the store or resent by a
``store: false`` client — gives the model the call *and* what it found (``search_history``). A client that drops
unknown fields (Codex) resends the item without the blob: the model then gets the query alone.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "RESULTS_KEY",
    "SOURCES_INCLUDE",
    "citations",
    "open_sealed_searches",
    "results_text",
    "search_function",
    "search_function_name",
    "search_history",
    "search_item",
    "search_query_of",
]

SOURCES_INCLUDE = "web_search_call.action.sources"
# The results text of an item, opened from its blob: internal (the history the upstream gets), never shown.
RESULTS_KEY = "_search_results"
_MARKER = re.compile(r"\[(\d{1,4})\]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_QUERY_LIMIT = 1000  # characters of the model's query kept (a search engine's own limits are lower)


def search_function_name(taken: Collection[str]) -> str:
    """``web_search``, or ``web_search_2``, ``_3``… when a client tool already has that upstream name."""
    if "web_search" not in taken:
        return "web_search"
    n = 2
    while f"web_search_{n}" in taken:
        n += 1
    return f"web_search_{n}"


def search_function(name: str) -> dict[str, Any]:
    """The function vLLM is offered for the request's web search tool."""
    return {"type": "function", "name": name,
            "description": ("Search the web. Returns numbered results ([1], [2], …) with title, URL and an "
                            "excerpt. When your answer uses a result, cite it with its number in square brackets, "
                            "e.g. [1]."),
            "parameters": {"type": "object",
                           "properties": {"query": {"type": "string", "maxLength": 200,
                                                    "description": "What to search the web for."}},
                           "required": ["query"]}}


def search_query_of(arguments: str) -> str | None:
    """The model's query from its call's arguments (``{"query": …}``; a bare JSON string too); None: none given."""
    try:
        value = orjson.loads(arguments.strip() or "{}")
    except orjson.JSONDecodeError:
        try:  # raw control characters inside the string (what a small model writes under a JSON grammar)
            value = json.loads(arguments, strict=False)
        except ValueError:
            return None
    if isinstance(value, dict):
        value = value.get("query") if value.get("query") is not None else value.get("q")
    if not isinstance(value, str):
        return None
    value = " ".join(_CONTROL.sub(" ", value).split())  # one line: control characters and runs of space as one
    return value[:_QUERY_LIMIT] or None


def search_item(item_id: str, query: str | None, status: str, sources: Sequence[str] | None = None
                ) -> dict[str, Any]:
    """A ``web_search_call`` item (openai ``ResponseFunctionWebSearch``); ``sources``: URLs, given only when the
    include asks for them."""
    action: dict[str, Any] = {"type": "search", "query": query or "", "queries": [query] if query else []}
    if sources is not None:
        action["sources"] = [{"type": "url", "url": url} for url in sources]
    return {"id": item_id, "type": "web_search_call", "status": status, "action": action}


def _clip(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:max(limit - 3, 0)].decode(errors="ignore").rstrip() + "…"  # "…" is 3 bytes


def results_text(query: str, results: Sequence[tuple[str, str, str]], first: int, max_bytes: int) -> str:
    """What the model reads as the call's output: ``results`` (title, url, snippet) numbered from ``first``, at
    most ``max_bytes`` (UTF-8) in all; a result that does not fit whole is cut, the ones after it left out."""
    head = (f"Web search results for {query!r}. Cite a result you use with its number in square brackets, "
            f"e.g. [{first}].") if results else f"The web search for {query!r} found no results."
    parts = [head]
    used = len(head.encode())
    for n, (title, url, snippet) in enumerate(results, first):
        entry = f"\n\n[{n}] {title}\nURL: {url}\n{snippet}".rstrip()
        room = max_bytes - used
        if room <= len(f"\n\n[{n}] ") + len(url) + 16:
            break
        entry = _clip(entry, room)
        parts.append(entry)
        used += len(entry.encode())
    return "".join(parts)


def citations(text: str, sources: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """``url_citation`` annotations for the ``[n]`` markers in ``text`` that number one of ``sources`` (url,
    title; ``[1]`` is the first); indexes are the marker's character span in ``text``."""
    out = []
    for match in _MARKER.finditer(text):
        n = int(match.group(1))
        if 1 <= n <= len(sources):
            url, title = sources[n - 1]
            out.append({"type": "url_citation", "start_index": match.start(), "end_index": match.end(),
                        "url": url, "title": title})
    return out


def _query(item: Mapping[str, Any]) -> str:
    action = item.get("action")
    if not isinstance(action, dict):
        return ""
    query = action.get("query")
    if isinstance(query, str) and query:
        return query
    queries = action.get("queries")
    if isinstance(queries, list) and queries and isinstance(queries[0], str):
        return queries[0]
    return str(action.get("url") or action.get("pattern") or "")


def search_history(item: Mapping[str, Any], upstream_name: str) -> list[dict[str, Any]]:
    """A ``web_search_call`` as what the model sees on a later turn (or round): its function call and the results
    it read (``RESULTS_KEY``, opened from the item's blob); without them, the query alone."""
    call_id = str(item.get("id") or "ws_" + hashlib.blake2b(
        orjson.dumps(item, option=orjson.OPT_SORT_KEYS), digest_size=12).hexdigest())
    query = _query(item)
    results = item.get(RESULTS_KEY)
    if isinstance(results, str):
        output = results
    elif item.get("status") == "failed":
        output = f"The web search for {query!r} failed."
    else:
        output = f"The web was searched for {query!r}; the results of that search are no longer available."
    return [{"type": "function_call", "call_id": call_id, "name": upstream_name,
             "arguments": orjson.dumps({"query": query}).decode(), "status": "completed"},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


def open_sealed_searches(items: Sequence[Any], opener: Callable[[Any], Mapping[str, Any] | None] | None
                         ) -> list[Any]:
    """Items with each ``web_search_call``'s sealed results opened (``RESULTS_KEY``; the blob dropped).
    ``opener(blob)``: the sealed ``{"id", "text"}`` for this caller, or None (another owner's, another key's,
    tampered). A blob opens only on the item it was sealed for; an item whose blob does not open goes upstream as
    its query alone. A client's own ``RESULTS_KEY`` is never taken."""
    out: list[Any] = []
    for item in items:
        if not (isinstance(item, dict) and item.get("type") == "web_search_call"):
            out.append(item)
            continue
        rest = {k: v for k, v in item.items() if k not in ("encrypted_content", RESULTS_KEY)}
        blob = item.get("encrypted_content")
        opened = opener(blob) if blob and opener is not None else None
        if opened is not None and opened.get("id") == item.get("id") and isinstance(opened.get("text"), str):
            rest[RESULTS_KEY] = opened["text"]
        out.append(rest)
    return out
