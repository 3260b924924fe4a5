"""The storage interface for stored Responses (previous_response_id, GET/DELETE /v1/responses/{id}) and
Conversations (/v1/conversations).

Ownership: every read, continuation and delete takes an optional ``owner`` (the keyed hash of the caller's
gateway API key, see gateway/server/auth.py). ``owner=None`` means single-tenant: no filter, everything is
visible. A given owner sees only rows written with that owner; another owner's row answers exactly as a
missing one (None, [], False), so an id's existence never leaks across tenants.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_CHAIN_DEPTH = 1000

# Statuses of a background response that may still change; every other status is final.
RUNNING_STATUSES = ("queued", "in_progress")

# A background-response notification: (response_id, what), what being the last sequence number written (as
# text) or "cancel". A hint only: listeners re-read the store (gateway.engine.background).
EventListener = Callable[[str, str], None]


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
    owner: str | None = None  # keyed hash of the API key that created it; None: single-tenant


@dataclass(frozen=True, slots=True)
class StoredConversation:
    """One conversation's own row; its items live in their own table, ordered by position."""

    id: str
    created_at: int
    updated_at: int  # bumped by every change (items added or deleted, metadata); the TTL sweep keys on it
    metadata: dict[str, Any]
    owner: str | None = None

    def public(self) -> dict[str, Any]:
        """OpenAI's ``conversation`` object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


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


class HistoryTooLargeError(StoreError):
    """The history being loaded (a chain, a conversation's items, referenced items) passed ``max_bytes``; the
    store stopped reading there. ``item_id``: the referenced item that crossed the bound (get_items)."""

    def __init__(self, max_bytes: int, item_id: str | None = None) -> None:
        super().__init__(f"the history is larger than {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.item_id = item_id


def check_item_budget(ids: Sequence[str], sizes: Mapping[str, int], max_bytes: int | None) -> None:
    """``get_items``' bound, from the stored sizes before anything is loaded: the referenced items in the order
    given, the first one past ``max_bytes`` named (ids not stored count nothing)."""
    if max_bytes is None:
        return
    total = 0
    for item_id in ids:
        total += sizes.get(item_id, 0)
        if total > max_bytes:
            raise HistoryTooLargeError(max_bytes, item_id)


@dataclass(frozen=True, slots=True)
class ConversationTurn:
    """A response's turn (its input and output items, each with an "id") for its conversation: written by
    put() in the record's transaction."""

    conversation_id: str
    items: list[dict[str, Any]]
    updated_at: int


class CursorNotFoundError(StoreError):
    """``after`` names no item of the conversation being listed."""

    def __init__(self, item_id: str) -> None:
        super().__init__(f"no item {item_id!r} in this conversation")
        self.item_id = item_id


class ResponseStore(ABC):
    """Persistence of Responses. Call start() before anything else and close() at shutdown."""

    @abstractmethod
    async def start(self) -> None:
        """Connect and create/migrate the schema; idempotent, safe for processes starting at once."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections. The store is unusable afterwards."""

    @abstractmethod
    async def put(self, record: StoredResponse | None, turn: ConversationTurn | None = None,
                  owner: str | None = None) -> bool:
        """Insert or replace the record with this id (None: only the turn) and append ``turn`` to its conversation
        (as append_conversation_items, scoped to ``owner``), in one transaction committed durably when it returns.
        False when the turn's conversation does not exist (or is another owner's): the record is written anyway."""

    @abstractmethod
    async def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The record, or None if there is none (or it belongs to another owner)."""

    @abstractmethod
    async def get_chain(self, response_id: str, max_depth: int = DEFAULT_MAX_CHAIN_DEPTH,
                        owner: str | None = None, max_bytes: int | None = None) -> list[StoredResponse]:
        """The record and its ancestors via previous_response_id, oldest first, in one read transaction.

        Returns [] if response_id itself is unknown (or another owner's). Raises BrokenChainError if an
        ancestor is missing, ChainTooDeepError if the chain has more than max_depth records,
        HistoryTooLargeError if their stored input and response JSON pass ``max_bytes`` (measured in the
        database, newest first, before any record is loaded).
        """

    @abstractmethod
    async def get_items(self, item_ids: list[str], owner: str | None = None,
                        max_bytes: int | None = None) -> dict[str, dict[str, Any]]:
        """Stored input or output items by id (``item_reference``); ids not found are left out.

        Ids are scoped to their owner: each owner may store the same id once. HistoryTooLargeError (naming the
        first id, in the order given, at which the sizes pass ``max_bytes``) before any item is loaded.

        An id stored by several responses (a client resending an item) resolves to the latest write of the
        same owner (another owner's write never replaces it). Ids no response holds are looked up in the
        owner's conversations.
        """

    @abstractmethod
    async def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Delete the record; True if it existed. Children are kept (their chains become broken)."""

    @abstractmethod
    async def sweep(self, older_than: int) -> int:
        """Delete every response with created_at < older_than (unix seconds) and every conversation with
        updated_at < older_than (created and not changed since), with their items; return how many."""

    # ------------------------------------------------------------------ background responses
    #
    # A background response (gateway.engine.background) is a responses row with ``background`` set, a lease
    # (the replica running it, until when), a ``cancel_requested`` flag, and its stream events in their own
    # table, keyed by sequence number. Its row's status moves queued -> in_progress -> a final status once:
    # a final status is never replaced, not even by put() (a late write of a run that was cancelled or given
    # up is dropped). Events go with their response (delete, sweep).

    @abstractmethod
    async def create_background(self, record: StoredResponse, lease_owner: str, lease_expires_at: float) -> None:
        """Insert the row of a new background response (status ``record.status``, normally queued), leased to
        ``lease_owner`` until ``lease_expires_at`` (unix seconds)."""

    @abstractmethod
    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Store stream events (each with its ``sequence_number``), atomically; a number already stored is
        kept as it is. Listeners (of every replica) are told the last number written."""

    @abstractmethod
    async def get_events(self, response_id: str, after: int = -1, owner: str | None = None,
                         limit: int = 1000) -> list[dict[str, Any]]:
        """Up to ``limit`` stored events with sequence_number > ``after``, in order ([] for a response that
        does not exist or is another owner's)."""

    @abstractmethod
    async def set_status(self, response_id: str, status: str, response: dict[str, Any], *,
                         event: dict[str, Any] | None = None, lease_owner: str | None = None,
                         expired_before: float | None = None) -> bool:
        """Move a background response that is still queued or in_progress to ``status`` with ``response`` as
        its stored object; False (nothing written) when it is not (any more). ``event``: a terminal event
        appended in the same transaction, its ``sequence_number`` set here to the next one. ``lease_owner`` /
        ``expired_before``: only if the lease is that replica's / expired before that time (the lease is then
        cleared, so a replica that was only stalled learns at its next renewal that the run is no longer its)."""

    @abstractmethod
    async def renew_leases(self, lease_owner: str, response_ids: list[str], lease_expires_at: float) -> list[str]:
        """Extend the leases ``lease_owner`` holds on these responses; the ids whose run must stop: cancel
        requested, leased by another replica, or gone (deleted)."""

    @abstractmethod
    async def request_cancel(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """Cancel a background response that is queued or in_progress: status and stored object become
        ``cancelled`` and the running replica is told (its listeners, its next renew_leases). The row as it
        is afterwards (unchanged when it had already ended, or is not a background response); None if there
        is none (or it is another owner's)."""

    @abstractmethod
    async def expired_leases(self, now: float, limit: int = 100) -> list[str]:
        """Ids of background responses still queued or in_progress whose lease expired before ``now``."""

    async def key_material(self) -> bytes:
        """The gateway's own 32-byte key (``--reasoning-key`` unset): made by the first gateway that asks, then
        kept with the store, so every worker, every restart and every replica sharing the store has the same one.
        NotImplementedError where a store keeps none."""
        raise NotImplementedError

    def add_event_listener(self, listener: EventListener) -> None:
        """Call ``listener(response_id, what)`` on each notification (see EventListener), on the event loop."""
        self.__dict__.setdefault("_event_listeners", []).append(listener)

    def remove_event_listener(self, listener: EventListener) -> None:
        listeners = self.__dict__.get("_event_listeners", [])
        if listener in listeners:
            listeners.remove(listener)

    async def listen(self) -> None:
        """Make sure notifications from other processes arrive (PostgreSQL: a LISTEN connection, reopened if
        it was lost); a no-op where there are none (SQLite: in-process only; other processes are polled)."""
        return None

    def _notify_local(self, response_id: str, what: str) -> None:
        for listener in list(self.__dict__.get("_event_listeners", ())):
            try:
                listener(response_id, what)
            except Exception:  # a listener's bug must not fail the write that notified it
                logging.getLogger(__name__).exception("background event listener failed")

    # ------------------------------------------------------------------ conversations

    @abstractmethod
    async def create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        """Insert the conversation and its first items (each with an "id"), atomically."""

    @abstractmethod
    async def get_conversation(self, conversation_id: str, owner: str | None = None) -> StoredConversation | None:
        """The conversation, or None if there is none (or it is another owner's)."""

    @abstractmethod
    async def update_conversation(self, conversation_id: str, metadata: dict[str, Any], updated_at: int,
                                  owner: str | None = None) -> StoredConversation | None:
        """Replace the metadata; the updated conversation, or None if there is none."""

    @abstractmethod
    async def delete_conversation(self, conversation_id: str, owner: str | None = None) -> bool:
        """Delete the conversation and all its items; True if it existed."""

    @abstractmethod
    async def append_conversation_items(self, conversation_id: str, items: list[dict[str, Any]], updated_at: int,
                                        owner: str | None = None) -> bool:
        """Append items (each with an "id") after the conversation's last one, atomically and in order.

        Concurrent appends to one conversation are serialized (none is lost; each batch stays contiguous,
        in commit order). An item whose id the conversation already holds is skipped: it is the same item.
        False if the conversation does not exist (or is another owner's); nothing is written then.
        """

    @abstractmethod
    async def get_conversation_items(self, conversation_id: str, owner: str | None = None,
                                     max_bytes: int | None = None) -> list[dict[str, Any]] | None:
        """Every item in order (the history of a response created with ``conversation``), or None.
        HistoryTooLargeError when their stored JSON passes ``max_bytes`` (summed in the database first)."""

    @abstractmethod
    async def list_conversation_items(self, conversation_id: str, *, limit: int, order: str = "desc",
                                      after: str | None = None, owner: str | None = None
                                      ) -> tuple[list[dict[str, Any]], bool] | None:
        """One page (``order`` "asc" or "desc", items after the item ``after``) and whether more follow;
        None if there is no such conversation. Raises CursorNotFoundError for an unknown ``after``."""

    @abstractmethod
    async def get_conversation_item(self, conversation_id: str, item_id: str, owner: str | None = None
                                    ) -> dict[str, Any] | None:
        """One item of the conversation, or None."""

    @abstractmethod
    async def delete_conversation_item(self, conversation_id: str, item_id: str, updated_at: int,
                                       owner: str | None = None) -> bool:
        """Remove one item; True if the conversation held it."""


def record_items(record: StoredResponse) -> list[tuple[str, dict[str, Any]]]:
    """``(item id, item)`` for every input and output item of a record that has an id."""
    out: list[tuple[str, dict[str, Any]]] = []
    for item in (*record.input_items, *(record.response.get("output") or ())):
        if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]:
            out.append((item["id"], item))
    return out


def chain_sizes(response_id: str, rows: list[tuple[str, str | None, int]], max_depth: int,
                max_bytes: int | None) -> list[str]:
    """Validate a chain's (id, previous_response_id, running byte total) rows, newest first, as the recursive
    queries return them (they stop once the total passes the bound); the ids to load, oldest first."""
    if max_depth < 1:
        raise ValueError("max_depth must be at least 1")
    if not rows:
        return []
    if max_bytes is not None and rows[-1][2] > max_bytes:
        raise HistoryTooLargeError(max_bytes)
    oldest = rows[-1]
    if oldest[1] is not None:
        if len(rows) >= max_depth:
            raise ChainTooDeepError(response_id, max_depth)
        raise BrokenChainError(oldest[1])
    return [row[0] for row in reversed(rows)]


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
