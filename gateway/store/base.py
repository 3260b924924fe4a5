"""The storage interface for stored Responses (previous_response_id, GET/DELETE /v1/responses/{id})."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_CHAIN_DEPTH = 1000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response, as the client saw it, plus what is needed to continue from it."""

    id: str
    created_at: int  # unix seconds; the TTL sweeper keys on this
    previous_response_id: str | None
    status: str
    response: dict[str, Any]  # the public Response object, byte-for-byte what the client got
    input_items: list[dict[str, Any]]  # the request's input items in public form, each with an "id"
    tool_context: dict[str, Any] | None  # opaque to the store; JSON-able
    updated_at: int


class StoreError(Exception):
    """Base class of the errors a ResponseStore raises on purpose."""


class BrokenChainError(StoreError):
    """An ancestor named by previous_response_id no longer exists (deleted or swept)."""

    def __init__(self, missing_id: str) -> None:
        super().__init__(f"previous response {missing_id!r} of the chain is missing")
        self.missing_id = missing_id


class ChainTooDeepError(StoreError):
    """The chain is longer than max_depth (or cyclic, which only a corrupt store can be)."""

    def __init__(self, response_id: str, max_depth: int) -> None:
        super().__init__(f"the chain ending at {response_id!r} is longer than {max_depth} responses")
        self.response_id = response_id
        self.max_depth = max_depth


class ResponseStore(ABC):
    """Persistence of Responses. Call start() before anything else and close() at shutdown."""

    @abstractmethod
    async def start(self) -> None:
        """Connect and create/migrate the schema; idempotent, safe for processes starting at once."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections. The store is unusable afterwards."""

    @abstractmethod
    async def put(self, record: StoredResponse) -> None:
        """Insert or replace the record with this id; committed durably when it returns."""

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None if there is none."""

    @abstractmethod
    async def get_chain(self, response_id: str, max_depth: int = DEFAULT_MAX_CHAIN_DEPTH) -> list[StoredResponse]:
        """The record and its ancestors via previous_response_id, oldest first, in one query.

        Returns [] if response_id itself is unknown. Raises BrokenChainError if an ancestor is
        missing, ChainTooDeepError if the chain has more than max_depth records.
        """

    @abstractmethod
    async def get_items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Stored input or output items by id (``item_reference``); ids not found are left out.

        An id stored by several responses (a client resending an item) resolves to the latest write.
        """

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Delete the record; True if it existed. Children are kept (their chains become broken)."""

    @abstractmethod
    async def sweep(self, older_than: int) -> int:
        """Delete every record with created_at < older_than (unix seconds); return how many."""


def record_items(record: StoredResponse) -> list[tuple[str, dict[str, Any]]]:
    """``(item id, item)`` for every input and output item of a record that has an id."""
    out: list[tuple[str, dict[str, Any]]] = []
    for item in (*record.input_items, *(record.response.get("output") or ())):
        if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]:
            out.append((item["id"], item))
    return out


def check_chain(response_id: str, chain: list[StoredResponse], max_depth: int) -> list[StoredResponse]:
    """Validate a chain fetched newest first (as the recursive queries return it); return it oldest first."""
    if max_depth < 1:
        raise ValueError("max_depth must be at least 1")
    if not chain:
        return []
    oldest = chain[-1]
    if oldest.previous_response_id is not None:
        # The recursion stopped with a parent still named: either the depth bound cut it off
        # or the parent row does not exist.
        if len(chain) >= max_depth:
            raise ChainTooDeepError(response_id, max_depth)
        raise BrokenChainError(oldest.previous_response_id)
    chain.reverse()
    return chain
