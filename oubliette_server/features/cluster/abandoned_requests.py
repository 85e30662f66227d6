"""Closing the caller tool requests and approvals a dead server left open (shared store only).

The server whose agent asked a caller tool (or whose gated call asked an approval) waits for
the request's outcome and, at the request's `expires_at`, stores its timeout itself; the
request names that server (`server`),
which renews its own lease while it lives (cluster/leases.py). A request without an outcome
whose server's lease expired, or well past its `expires_at`, has lost its waiter: that server
died (kill -9, a lost host). With one
server the next start closes such requests (`caller_tool_relay/restart.py`); with several on
one database every surviving server sweeps the log every `period` seconds and stores
`caller_tool_cancelled` (reason `ABANDONED_REASON`) through `append_outcome`, which lets
exactly one outcome win, so the caller is never left with a request nobody waits for. An
`approval_request` is closed the same way with an `approval_resolved` denial (`who`
`SERVER_STOPPED`), shaped as approvals/service.py writes every decision, so the caller's server
stops listing it and a late answer is refused as already resolved.

Owns: its sweep task (start it with `await nursery.start(sweeper.serve)`). Needs: the
PostgreSQL store's `abandoned_requests`, the session registry and the frame log's
`append_outcome` (store, then tell the session's callers on this server).
"""

from __future__ import annotations

import logging

import trio

from protocol import Frame

from ...core.frame_log import AppendOutcome
from ...core.sessions import SessionRegistry
from ...store.api import AbandonedStore, StoreUnavailable
from ..approvals.service import REQUEST as APPROVAL_REQUEST
from ..approvals.service import RESOLVED as APPROVAL_RESOLVED
from ..approvals.service import Decision, resolved_payload

log = logging.getLogger("oubliette.server.calls")

ABANDONED_REASON = "its server stopped: no server waits for it"
SERVER_STOPPED = "server_stopped"
"""`who` of the denial the sweep stores for an approval whose server died."""


class AbandonedRequests:
    """Every `period` seconds, closes the requests without an outcome whose server died (its lease
    expired, or `expires_at` + `grace` passed)."""

    def __init__(
        self, store: AbandonedStore, sessions: SessionRegistry, append_outcome: AppendOutcome,
        *, period: float, grace: float,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.append_outcome = append_outcome
        self.period = period
        self.grace = grace

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sweep every `period` seconds until cancelled (a store outage skips a sweep)."""
        task_status.started()
        while True:
            await trio.sleep(self.period)  # a sweep on a clock: a dead server sends no event
            try:
                await self.sweep()
            except StoreUnavailable as exc:
                log.warning("could not look for abandoned caller tool or approval requests: %s", exc)

    async def sweep(self) -> int:
        """Close every abandoned request now; how many this server closed (others may race it)."""
        closed = 0
        while True:
            frames = await self.store.abandoned_requests(self.grace)
            won = 0
            for frame in frames:
                won += await self._close(frame)
            closed += won
            if len(frames) < 100 or not won:
                break
        if closed:
            log.warning("closed %d caller tool or approval request(s) whose server stopped waiting", closed)
        return closed

    async def _close(self, frame: Frame) -> int:
        request_id = frame.payload.get("request_id")
        if not isinstance(request_id, str):
            return 0
        session = self.sessions.get_or_create(frame.instance, frame.channel, frame.session_id)
        if frame.type == APPROVAL_REQUEST:
            denial = Decision(approve=False, who=SERVER_STOPPED, reason=ABANDONED_REASON)
            payload = resolved_payload(request_id, str(frame.payload.get("tool_name")), frame.payload.get("arguments"), denial)
            stored = await self.append_outcome(session, APPROVAL_RESOLVED, payload, request_id)
        else:
            payload = {"request_id": request_id, "tool": frame.payload.get("tool"), "reason": ABANDONED_REASON}
            stored = await self.append_outcome(session, "caller_tool_cancelled", payload, request_id)
        return 1 if stored is not None else 0
