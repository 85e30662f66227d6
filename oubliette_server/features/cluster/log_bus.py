"""The frame log as the bus between servers, for caller tool calls (docs/SCALING.md).

With a shared store (PostgreSQL) the caller that declared a session's tools may be on one
server and the agent's client on another. Nothing passes between the servers but the log:

- the caller's server records the session's owner and each declaration in a `session_record`
  frame (`{owner, caller_tools?: {caller_id, tools}}`), a type only the server appends
  (server_owned.py: no door accepts it, nor those keys in any payload), so a server with no
  caller for the session reads them when a client bound to the session connects. Nothing else
  in the log is taken for them: a `user.message` is what a sender wrote, not a fact;
- the agent's server appends `caller_tool_request` (with `expires_at`) and waits for the
  request's outcome frame in the log, woken across servers by LISTEN;
- the caller's server learns of the request from the log and answers it with
  `append_outcome`, which the database lets win once, whichever server races it.

This module reads and waits on the log; `pending.py` decides what the frames mean.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import trio

from protocol import Frame

from ...core.frame_log import AppendOutcome
from ...core.sessions import Session
from ...store.api import (
    MAX_LIMIT,
    OUTAGE_RETRY,
    AppendNotices,
    CursorPruned,
    FrameQuery,
    FrameStoreAPI,
    StoreUnavailable,
)

log = logging.getLogger("oubliette.server.calls")

REQUEST = "caller_tool_request"
OUTCOME_TYPES = ("caller_tool_result", "caller_tool_cancelled")
REQUEST_TYPES = (REQUEST, *OUTCOME_TYPES)
#: A caller's progress report on another server's request; the agent's server forwards it.
PROGRESS = "caller_tool_progress"
#: How long one long poll on the log lasts before it is simply asked again (no deadline: the
#: waits that need one are bounded by their caller's own cancel scope).
WAIT_SLICE = 3600.0



class LogBus:
    """Reads and waits on one session's caller tool frames in a store other servers share.

    Needs: the shared store and the frame log's `append_outcome` (store, then push to the
    session's followers). Raises: `StoreUnavailable` as the store does.
    Cancellation: waits hold nothing; cancelling one leaves the log as it was.
    """

    def __init__(self, store: FrameStoreAPI, append_outcome: AppendOutcome) -> None:
        self.store = store
        self.append_outcome = append_outcome
        self._known = store.known_frames if isinstance(store, AppendNotices) else None

    async def frames(self, session: Session, types: tuple[str, ...], after_seq: int, *, known: bool = False) -> list[Frame]:
        """Every frame of `session` of `types` after `after_seq` (paged; a pruned start skips to what is kept);
        with `known`, only those the store knows whole without reading (`AppendNotices.known_frames`):
        the answering server's look for a request whose notice it heard, before it reads."""
        found: list[Frame] = []
        after = after_seq
        while True:
            q = FrameQuery(channel=session.channel, session_id=session.id, after_seq=after, types=types, limit=MAX_LIMIT)
            if known:
                return (self._known(session.instance, q) if self._known is not None else None) or []
            try:
                page = await self.store.query(session.instance, q)
            except CursorPruned as exc:
                after = exc.first_seq - 1
                continue
            found.extend(page)
            if len(page) < MAX_LIMIT:
                return found
            after = page[-1].seq

    async def wait_frames(self, session: Session, types: tuple[str, ...], after_seq: int) -> list[Frame]:
        """Wait until `session` has frames of `types` after `after_seq`; at most one page of them."""
        while True:
            try:
                frames, _ = await self.store.wait_for_frames(session.instance, FrameQuery(
                    channel=session.channel, session_id=session.id, after_seq=after_seq, types=types, limit=MAX_LIMIT,
                ), WAIT_SLICE)
            except CursorPruned as exc:
                after_seq = exc.first_seq - 1
                continue
            if frames:
                return frames

    async def outcome_of(self, session: Session, request_id: str, after_seq: int) -> Frame | None:
        """The outcome frame of `request_id` (stored after its request at `after_seq`), if any."""
        for frame in await self.frames(session, OUTCOME_TYPES, after_seq):
            if frame.payload.get("request_id") == request_id:
                return frame
        return None

    async def wait_outcome(
        self, session: Session, request_id: str, after_seq: int,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        outcome_types: tuple[str, ...] = OUTCOME_TYPES,
    ) -> Frame:
        """Wait for the outcome frame of `request_id` (one of `outcome_types`), appended by any server;
        `on_progress` gets the payload of each progress report on it stored meanwhile. A store outage
        does not end the wait (it reads again every `OUTAGE_RETRY` s): the caller's deadline does, for
        the outcome may still be stored, and the agent must hear the one the log has."""
        types = (*outcome_types, PROGRESS) if on_progress is not None else outcome_types
        while True:
            try:
                frames = await self.wait_frames(session, types, after_seq)
            except StoreUnavailable as exc:
                log.warning("request %s: waiting for its outcome, the store is unavailable: %s", request_id, exc)
                await trio.sleep(OUTAGE_RETRY)
                continue
            for frame in frames:
                after_seq = frame.seq
                if frame.payload.get("request_id") != request_id:
                    continue
                if frame.type != PROGRESS:
                    return frame
                if on_progress is not None:
                    on_progress(frame.payload)

    async def recorded_owner(self, session: Session) -> str | None:
        """The identity of the session's owner, as its first `session_record` recorded it (None if none did)."""
        return (await self.session_record(session))[0]

    async def session_record(self, session: Session) -> tuple[str | None, dict[str, Any] | None]:
        """`(owner identity, last declaration)` of the session, from its `session_record` frames in
        its instance's log: the store's `session_records` (one query along the records' own
        index; the first owner recorded counts, for it opened the session). Only the server
        appends that type (server_owned.py), so only what a server recorded is read."""
        records = await self.store.session_records(session.channel, session.id, limit=1, instance=session.instance)
        return (records[0].owner, records[0].declared) if records else (None, None)
