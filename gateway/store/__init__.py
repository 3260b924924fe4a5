"""Stored Responses and Conversations: the ResponseStore interface, its SQLite and PostgreSQL backends,
and open_store()."""

from __future__ import annotations

from gateway.store.base import (
    DEFAULT_MAX_CHAIN_DEPTH,
    BrokenChainError,
    ChainTooDeepError,
    ConversationTurn,
    CursorNotFoundError,
    HistoryTooLargeError,
    ResponseStore,
    StoredConversation,
    StoredResponse,
    StoreError,
)
from gateway.store.retention import run_sweeper
from gateway.store.sqlite import SqliteResponseStore

__all__ = [
    "DEFAULT_MAX_CHAIN_DEPTH",
    "BrokenChainError",
    "ChainTooDeepError",
    "ConversationTurn",
    "CursorNotFoundError",
    "HistoryTooLargeError",
    "PostgresResponseStore",
    "ResponseStore",
    "SqliteResponseStore",
    "StoreError",
    "StoredConversation",
    "StoredResponse",
    "open_store",
    "run_sweeper",
]

_SQLITE_PREFIX = "sqlite:///"


def open_store(url: str, sqlite_synchronous: str = "full") -> ResponseStore | None:
    """Build (not start) the store a URL names; the caller awaits start() and, at shutdown, close().

    - ``none``: storage disabled, returns None.
    - ``sqlite:///relative/path.db`` (three slashes: relative to the working directory) or
      ``sqlite:////abs/path.db`` (four: absolute), SQLAlchemy-style.
    - ``postgresql://...`` or ``postgres://...``: a libpq-style DSN handed to asyncpg.

    ``sqlite_synchronous`` (``--sqlite-synchronous``): SQLite's synchronous pragma, ``full`` or ``normal``.
    """
    stripped = url.strip()
    if stripped.lower() == "none":
        return None
    if stripped.startswith(_SQLITE_PREFIX):
        path = stripped[len(_SQLITE_PREFIX) :]
        if not path or path == "/" or path.endswith("/"):
            raise ValueError(f"store URL {url!r} names no database file (e.g. sqlite:///data/responses.db)")
        if path == ":memory:":
            # Each operation of a worker-thread store would need the same connection forever, and a
            # store that forgets everything on restart is better spelled 'none'.
            raise ValueError("sqlite :memory: is not supported as a response store; use a file path")
        return SqliteResponseStore(path, synchronous=sqlite_synchronous)
    if stripped.startswith(("postgresql://", "postgres://")):
        from gateway.store.postgres import PostgresResponseStore

        return PostgresResponseStore(stripped)
    raise ValueError(
        f"unsupported response store URL {url!r}: expected 'none', 'sqlite:///relative/path.db', "
        "'sqlite:////absolute/path.db', or 'postgresql://user@host:port/dbname'"
    )


def __getattr__(name: str) -> object:
    # asyncpg (a few MB of RSS) is imported only by gateways that use PostgreSQL.
    if name == "PostgresResponseStore":
        from gateway.store.postgres import PostgresResponseStore

        return PostgresResponseStore
    raise AttributeError(name)
