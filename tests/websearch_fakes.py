"""Local fakes of the search providers the gateway calls: one real loopback HTTP server (stdlib
``ThreadingHTTPServer`` on 127.0.0.1, a port of its own) answering in each provider's documented JSON shape.

The answer bodies are hand-written, copied from the providers' public documentation examples (trimmed to two
results, values kept):

- SearXNG: https://docs.searxng.org/dev/search_api.html (``GET /search?q=…&format=json``; the JSON answer's
  ``query``, ``number_of_results``, ``results[]`` with ``url``/``title``/``content``/``engine``/``parsed_url``/
  ``engines``/``positions``/``score``/``category``, ``answers``, ``corrections``, ``infoboxes``, ``suggestions``,
  ``unresponsive_engines``). An instance without the json format answers 403.
- Brave: https://api-dashboard.search.brave.com/app/documentation/web-search/responses (``WebSearchApiResponse``:
  ``type: "search"``, ``query.original``, ``web.type: "search"``, ``web.results[]`` with ``title``/``url``/
  ``description``/``extra_snippets``/``meta_url``/``age``/``language``/``family_friendly``).
- Tavily: https://docs.tavily.com/documentation/api-reference/endpoint/search (the example answer to "who is Leo
  Messi?": ``query``, ``answer``, ``images``, ``results[]`` with ``title``/``url``/``content``/``score``/
  ``raw_content``, ``response_time``, ``request_id``).

A test sets ``server.mode`` to choose the answer (``"ok"``, ``"empty"``, ``"status:429"``, ``"hang"``, ``"drip"``,
``"huge"``, ``"huge-chunked"``, ``"not-json"``, ``"redirect"``, ``"shape"``) and reads ``server.requests``
(method, path, query, headers, body) to see what the gateway sent.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

SEARXNG_OK: dict[str, Any] = {
    "query": "searxng",
    "number_of_results": 0,
    "results": [
        {"url": "https://github.com/searxng/searxng", "title": "SearXNG - GitHub",
         "content": "SearXNG is a free internet metasearch engine which aggregates results from various search "
                    "services and databases. Users are neither tracked nor profiled.",
         "engine": "duckduckgo", "parsed_url": ["https", "github.com", "/searxng/searxng", "", "", ""],
         "template": "default.html", "engines": ["duckduckgo", "google"], "positions": [1, 1], "score": 4.0,
         "category": "general"},
        {"url": "https://docs.searxng.org/", "title": "Welcome to SearXNG &mdash; SearXNG Documentation",
         "content": "Search without being <b>tracked</b>. SearXNG is a free internet metasearch engine.",
         "engine": "google", "parsed_url": ["https", "docs.searxng.org", "/", "", "", ""],
         "template": "default.html", "engines": ["google"], "positions": [2], "score": 0.5, "category": "general"},
    ],
    "answers": [], "corrections": [], "infoboxes": [], "suggestions": ["searxng docker"],
    "unresponsive_engines": [],
}
SEARXNG_EMPTY: dict[str, Any] = {"query": "zzzz", "number_of_results": 0, "results": [], "answers": [],
                                 "corrections": [], "infoboxes": [], "suggestions": [], "unresponsive_engines": []}

BRAVE_OK: dict[str, Any] = {
    "type": "search",
    "query": {"original": "brave search", "show_strict_warning": False, "is_navigational": True,
              "spellcheck_off": True, "country": "us", "more_results_available": True},
    "mixed": {"type": "mixed", "main": [{"type": "web", "index": 0, "all": False}], "top": [], "side": []},
    "web": {
        "type": "search",
        "results": [
            {"title": "Private Search Engine - Brave Search", "url": "https://search.brave.com/",
             "is_source_local": False, "is_source_both": False,
             "description": "Search the web privately with <strong>Brave Search</strong>, an independent index.",
             "page_age": "2023-04-11T00:00:00", "language": "en", "family_friendly": True, "type": "search_result",
             "subtype": "generic", "meta_url": {"scheme": "https", "netloc": "search.brave.com",
                                                "hostname": "search.brave.com", "favicon": "", "path": ""},
             "extra_snippets": ["Brave Search does not track you or your queries."]},
            {"title": "Brave Search API", "url": "https://brave.com/search/api/",
             "description": "Power your search and AI apps with the fastest growing independent search engine.",
             "age": "March 2, 2024", "language": "en", "family_friendly": True, "type": "search_result",
             "subtype": "generic", "meta_url": {"scheme": "https", "netloc": "brave.com", "hostname": "brave.com",
                                                "favicon": "", "path": "› search  › api"}},
        ],
        "family_friendly": True,
    },
}
BRAVE_EMPTY: dict[str, Any] = {"type": "search", "query": {"original": "zzzz", "more_results_available": False}}

TAVILY_OK: dict[str, Any] = {
    "query": "Who is Leo Messi?",
    "answer": None,
    "images": [],
    "results": [
        {"title": "Lionel Messi Facts | Britannica", "url": "https://www.britannica.com/facts/Lionel-Messi",
         "content": "Lionel Messi, an Argentine footballer, is widely regarded as one of the greatest football "
                    "players of his generation.", "score": 0.81025416, "raw_content": None},
        {"title": "Lionel Messi - Wikipedia", "url": "https://en.wikipedia.org/wiki/Lionel_Messi",
         "content": "Lionel Andrés Messi is an Argentine professional footballer who plays as a forward.",
         "score": 0.7, "raw_content": None},
    ],
    "response_time": "1.67",
    "request_id": "123e4567-e89b-12d3-a456-426614174111",
}
TAVILY_EMPTY: dict[str, Any] = {"query": "zzzz", "answer": None, "images": [], "results": [], "response_time": 0.4}

SHAPES = {"searxng": (SEARXNG_OK, SEARXNG_EMPTY), "brave": (BRAVE_OK, BRAVE_EMPTY), "tavily": (TAVILY_OK, TAVILY_EMPTY)}
ERROR_BODIES = {  # what each answers on errors: never shown to the model or the client
    "brave": {"type": "ErrorResponse", "error": {"id": "x", "status": 401, "code": "SUBSCRIPTION_TOKEN_INVALID",
                                                 "detail": "The provided subscription token is invalid."}},
    "tavily": {"detail": {"error": "Unauthorized: missing or invalid API key."}},
    "searxng": {"detail": "Forbidden"},
}


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeProvider:
    kind: str
    mode: str = "ok"
    requests: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    port: int = 0
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeProvider:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                return

            def _answer(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fake.requests.append(Seen(self.command, parts.path, parse_qs(parts.query),
                                          {k.lower(): v for k, v in self.headers.items()}, body))
                ok, empty = SHAPES[fake.kind]
                mode = fake.mode
                if mode.startswith("status:"):
                    self._json(int(mode.split(":")[1]), ERROR_BODIES[fake.kind])
                elif mode == "ok":
                    self._json(200, ok)
                elif mode == "empty":
                    self._json(200, empty)
                elif mode == "shape":
                    self._json(200, {"results": {"not": "a list"}, "web": {"results": "nope"}})
                elif mode == "not-json":
                    self._raw(200, b"<html>not json</html>", "text/html")
                elif mode == "redirect":
                    self.send_response(302)
                    self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif mode == "hang":
                    fake.release.wait(30)
                    self._json(200, ok)
                elif mode == "drip":  # headers at once, then a body that never finishes in time
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    for _ in range(300):
                        if fake.release.wait(0.1):
                            break
                        try:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        except OSError:
                            break
                elif mode == "huge":  # declared too large
                    self._raw(200, b"[" + b"0," * (3 * 1024 * 1024) + b"0]", "application/json")
                elif mode == "huge-chunked":  # too large, no Content-Length
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"0," * 32768
                    try:
                        for _ in range(200):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.write(b"0\r\n\r\n")
                    except OSError:
                        pass
                    self.close_connection = True
                else:
                    raise AssertionError(mode)

            def _json(self, status: int, payload: Any) -> None:
                self._raw(status, json.dumps(payload).encode(), "application/json")

            def _raw(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            do_GET = _answer
            do_POST = _answer

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        time.sleep(0)
