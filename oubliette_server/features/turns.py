"""Turn waits: a caller's `wait` on a session's turn, until it ends or needs the caller.

A `session_message`, `caller_tool_response` or `approval_response` with `wait` waits here for
the turn's first stop (`TurnWaits.wait`): its end (`assistant.done`, `session.error`), or
sooner the moment it needs the caller — a caller tool request or an approval of the session
pending (the pending-request engine's per-session events, one already pending counts) — or,
for a message nothing can run, `no_guest`. The MCP adapters (caller_api/tools.py) only
translate arguments and results; the race is this service's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

import trio
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from protocol.frames import TURN_END_TYPES, FrameType

from ..core.callers import EVENT_QUEUE_SIZE, CallerConnection, RequestScopedSink
from ..core.sessions import EventSink, Session, SessionRegistry
from ..store.api import FrameQuery, FrameStoreAPI, StoreUnavailable
from .approvals import ApprovalElicitation, ApprovalService, InputRequired
from .caller_tool_relay import CallerCallRegistry

log = logging.getLogger("oubliette.server.caller_api")

EVENT_DRAIN_SECONDS = 2.0
"""How long a 2026-07-28 wait lets its request-scoped events go out before it returns its stop."""
NO_GUEST_GRACE = 8.0
"""Seconds a `session_message` wait gives a guest to connect before it stops with `no_guest`
(an instance with no guest and no start command: nothing would run the message). Longer than
oubliette-client's longest reconnect delay (5 s), so a guest reconnecting after a server restart,
or one started just before the message on a busy host, is not reported missing."""
STREAM_GONE_STATE = "oubliette_stream_gone"
"""Key of the `trio.Event` the HTTP layer sets in a request's scope state when its client goes away."""


def stream_gone(ctx: Any) -> trio.Event | None:
    """The event set when this request's HTTP client disconnects before its answer (None on stdio)."""
    state = getattr(getattr(ctx, "request", None), "scope", {}).get("state") or {}
    gone = state.get(STREAM_GONE_STATE)
    return gone if isinstance(gone, trio.Event) else None


class OwnerKeyedSink:
    """A request-scoped sink whose events carry the caller's `owner_key` (2026-07-28).

    Only the owner's own waiting request gets these events, so the key travels to nobody
    else; a caller can answer a request before its `session_message` returns the key.
    """

    def __init__(self, sink: RequestScopedSink, owner_key: str) -> None:
        self._sink = sink
        self._owner_key = owner_key

    def push(self, event: dict) -> None:
        """Pass the event on with the owner_key added, so a stateless caller can act on it."""
        self._sink.push({**event, "owner_key": self._owner_key})


REQUEST_EVENT = "caller_tool_request"
"""The event a 2026-07-28 wait's stop carries whole when it lists its request in `pending`."""


class WaitEvents:
    """The follower of a 2026-07-28 wait: the session's events, to ride the waiting request.

    A `caller_tool_request` event, and every event after it, is held until the stop is known
    (`release`): the stop lists a request still pending in `pending`, whole, so its event is not
    sent (README.md, "Caller tools"). A wait that stops for a request then sends no event, and the
    answer is plain JSON, on a connection the SDK's client keeps (an SSE answer costs it a new
    one, docs/SCALING.md). Every other event goes out, in order; the delivery task (`start`) is
    started only for the first one.
    """

    def __init__(self, sink: EventSink, start: Callable[[], object]) -> None:
        self._sink = sink
        self._start = start
        self._held: list[dict] | None = None
        self.started = False

    def push(self, event: dict) -> None:
        """Hold a request's event (and what follows it) for `release`, else send it."""
        if self._held is None and event.get("type") != REQUEST_EVENT:
            self._send(event)
        elif self._held is None:
            self._held = [event]
        else:
            self._held.append(event)

    def release(self, stop: dict[str, Any]) -> None:
        """The events held, but the requests `stop` lists in `pending`, sent in order."""
        held, self._held = self._held or [], None
        listed = {entry.get("request_id") for entry in stop.get("pending", ()) if entry.get("kind") == "caller_tool"}
        for event in held:
            if event.get("type") != REQUEST_EVENT or event.get("request_id") not in listed:
                self._send(event)

    def _send(self, event: dict) -> None:
        if not self.started:
            self.started = True
            self._start()
        self._sink.push(event)


class EarlyEvents:
    """The session's events from the start of an answer with `wait` to the start of its wait
    (2026-07-28 callers, `TurnWaits.following_answer`): the answer is stored first, and another
    server's frame that came in that time (the agent's next line, once it had the answer) would
    otherwise reach no follower, pushed nowhere. `TurnWaits.wait` hands them to its follower
    (`hand_over`), in order. Bounded as a request's sink is (`EVENT_QUEUE_SIZE`): past it, the rest
    is dropped, as there (the caller reads them with `session_events`)."""

    def __init__(self, sessions: SessionRegistry, followed: list[Session], caller: CallerConnection) -> None:
        self._sessions = sessions
        self._sinks = [(session, _EarlySink(self, session, caller)) for session in followed]
        self._events: list[tuple[Session, dict]] = []
        for session, sink in self._sinks:
            sessions.follow(session, sink)

    def keep(self, session: Session, event: dict) -> None:
        """One event of `session`, kept for the wait."""
        if len(self._events) < EVENT_QUEUE_SIZE:
            self._events.append((session, event))

    def hand_over(self, session: Session | None, follower: EventSink | None) -> None:
        """Stop following; `follower` (now following `session`) gets that session's events kept
        (none when there is no follower). No checkpoint: no event comes twice or is lost between."""
        sinks, self._sinks = self._sinks, []
        for followed, sink in sinks:
            self._sessions.unfollow(followed, sink)
        events, self._events = self._events, []
        if follower is not None:
            for kept_session, event in events:
                if kept_session is session:
                    follower.push(event)


class _EarlySink:
    """`EarlyEvents`' follower of one session, for `caller` (`acts_for`: the events of its own
    answers skip it, as they skip the caller, `push_frame`)."""

    def __init__(self, early: EarlyEvents, session: Session, caller: CallerConnection) -> None:
        self.early = early
        self.session = session
        self.acts_for = caller

    def push(self, event: dict) -> None:
        """Keep the event for the wait."""
        self.early.keep(self.session, event)


class TurnWaits:
    """Waits on a session's turn for the caller-facing tools.

    Needs: the store (the turn's end), the session registry (a 2026-07-28 wait follows the
    session for its duration), the pending caller tool calls and approvals (what stops a wait,
    and what ends when the waiting caller leaves), the approval elicitation (how approvals
    reach the person), `guest_absent(instance)` (guests/presence.py): why a message cannot
    reach a guest, or None, and with a shared store `caught_up(instance)` (the log tail's), which
    returns once the other servers' frames committed so far were pushed here.
    """

    def __init__(
        self, *, store: FrameStoreAPI, sessions: SessionRegistry, calls: CallerCallRegistry,
        approvals: ApprovalService, elicitation: ApprovalElicitation,
        guest_absent: Callable[[str], Awaitable[str | None]] | None = None,
        caught_up: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.caught_up = caught_up
        self.store = store
        self.sessions = sessions
        self.calls = calls
        self.approvals = approvals
        self.elicitation = elicitation
        self.guest_absent = guest_absent

    def caller_gone(self, caller: CallerConnection, session: Session | None = None) -> int:
        """The caller's stream ended (HTTP): its pending calls (of `session`, if given) fail now and
        its pending approvals are denied (fail closed). Returns how many of both ended."""
        return self.calls.fail_caller(caller, session) + self.approvals.fail_caller(caller, session)

    def following_answer(self, ctx: Any, caller: CallerConnection, sessions: list[Session]) -> EarlyEvents | None:
        """For an answer with `wait` from a 2026-07-28 caller, before the answer is stored: the
        events of `sessions` until its wait follows one of them (`wait(..., early=...)`), so the
        wait pushes every frame after the answer (but the caller's own answers', as ever). None
        for a caller with a stream of its own."""
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return None
        return EarlyEvents(self.sessions, sessions, caller)

    async def wait(
        self, ctx: Any, caller: CallerConnection, session: Session, msg_id: str | None, after_seq: int, seconds: float,
        *, watch_guest: bool = False, early: EarlyEvents | None = None,
    ) -> dict[str, Any]:
        """Wait for the turn's end (the first one after `after_seq` when `msg_id` is None) or for a
        pending approval in the session, whichever comes first, at most `seconds`; with
        `watch_guest`, stop with `no_guest` when nothing can run the message (`_first_stop`).
        `early` (`following_answer`): the session's events since before the answer, handed to
        this wait's follower first."""
        query = FrameQuery(
            channel=session.channel, session_id=session.id, after_seq=after_seq,
            types=TURN_END_TYPES, reply_to=msg_id, limit=1,
        )
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        deadline = time.time() + seconds
        gone = stream_gone(ctx)
        dropped = False
        stop: dict[str, Any] = {}
        unavailable: StoreUnavailable | None = None
        ended = False
        try:
            async with trio.open_nursery() as nursery:
                sink = None
                follower: WaitEvents | None = None
                delivered = trio.Event()
                if modern:
                    # 2026-07-28 callers have no standalone stream: events ride this request.
                    sink = RequestScopedSink(ctx.session, ctx.request_id)

                    async def deliver(sink: RequestScopedSink = sink) -> None:
                        try:
                            await sink.run()
                        finally:
                            delivered.set()

                    follower = WaitEvents(
                        OwnerKeyedSink(sink, caller.owner_key) if caller.owner_key else sink,
                        lambda: nursery.start_soon(deliver),
                    )
                    self.sessions.follow(session, follower)
                if early is not None:
                    early.hand_over(session, follower)
                if gone is not None and not modern:  # a 2026-07-28 request's door cancels it (below) instead

                    async def watch(gone: trio.Event = gone) -> None:
                        nonlocal dropped
                        await gone.wait()
                        dropped = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(watch)
                try:
                    stop = await self._first_stop(ctx, caller, session, query, msg_id, seconds, watch_guest)
                    if sink is not None and self.caught_up is not None:
                        # Another server's frame that stopped the wait (its request, the turn's end)
                        # is pushed before the stop returns, as on one server (docs/SCALING.md).
                        with trio.move_on_after(EVENT_DRAIN_SECONDS):
                            await self.caught_up(session.instance)
                except StoreUnavailable as exc:  # raised below, not wrapped in this nursery's group
                    unavailable = exc
                finally:
                    if sink is not None and follower is not None:
                        self.sessions.unfollow(session, follower)
                        follower.release(stop)
                        sink.close()
                if follower is not None and follower.started:
                    # The events that led to this stop go out before the result that reports it.
                    with trio.move_on_after(EVENT_DRAIN_SECONDS):
                        await delivered.wait()
                nursery.cancel_scope.cancel()
            ended = True
        finally:
            if not ended and modern:  # 2026-07-28: closing the request's stream is how it is cancelled
                self._waiting_caller_left(caller, session)
        if unavailable is not None:  # the store went away during the wait: the caller hears of it now
            raise StoreUnavailable(
                f"{unavailable.message} (while waiting: what this call sent is stored, do not send it again; "
                f"read the turn's end with session_events after_seq {after_seq})"
            )
        if dropped:
            self._waiting_caller_left(caller, session)
            return {"stop_reason": "error", "text": "the caller's stream closed", "pending": []}
        if stop.get("stop_reason") == "requires_approval" and self.elicitation.route(ctx) == "input_required":
            # 2026-07-28 with elicitation: the call returns an input_required result, resumed on retry.
            raise InputRequired(session, self.approvals.pending_for(session), msg_id, after_seq, deadline)
        return stop

    def _stop(
        self, session: Session, frames: list[Any] | None, msg_id: str | None, approvals_stop: bool = True,
    ) -> dict[str, Any] | None:
        """The fields of a turn stop: `stop_reason`, `text`, and `pending`, everything the caller must
        answer now (caller tool requests, then approvals), read from the services, not from events.
        None when `frames` is None (the turn needs the caller) but nothing is pending any more.
        With `approvals_stop` False (they are being put to the person), approvals do not stop the turn."""
        calls = [c.summary() for c in self.calls.pending_for(session)]
        approvals = [p.summary() for p in self.approvals.pending_for(session)]
        pending = calls + [{"kind": "approval", "tool": a["tool_name"], **a} for a in approvals]
        if frames is None:
            if approvals and approvals_stop:
                return {"stop_reason": "requires_approval", "text": "", "pending": pending, "approval_requests": approvals}
            if calls:
                return {"stop_reason": "requires_action", "text": "", "pending": pending}
            return None
        if not frames:
            return {"stop_reason": "timeout", "text": "", "pending": pending}
        end = frames[0]
        turn = {"msg_id": end.reply_to} if msg_id is None and end.reply_to else {}
        if end.type == FrameType.SESSION_ERROR:
            return {"stop_reason": "error", "text": end.payload.get("message", ""), "pending": pending, **turn}
        return {"stop_reason": "end_turn", "text": end.payload.get("text", ""), "pending": pending, **turn}

    async def _first_stop(
        self, ctx: Any, caller: CallerConnection, session: Session, query: FrameQuery, msg_id: str | None, seconds: float,
        watch_guest: bool = False,
    ) -> dict[str, Any]:
        """The turn's first stop within `seconds`: its end (or `timeout`), or, sooner, the moment it
        needs the caller: a caller tool request or an approval of the session is pending (one already
        pending counts). The pending list is read at that moment, so nothing resolved is listed.
        Approvals put to the person in the caller's client (`ApprovalElicitation`) do not stop it.
        With `watch_guest`, a message that nothing can run `NO_GUEST_GRACE` seconds after it was
        stored (no guest connected anywhere, no start command) stops the wait with `no_guest`."""
        stops: list[dict[str, Any]] = []
        failed: list[StoreUnavailable] = []
        approvals_stop = self.elicitation.route(ctx) in ("tool", "input_required")
        async with trio.open_nursery() as race:

            async def turn_end() -> None:
                try:
                    frames, _ = await self.store.wait_for_frames(session.instance, query, timeout=seconds)
                except StoreUnavailable as exc:  # raised below, not wrapped in the race's group
                    failed.append(exc)
                else:
                    stops.append(self._stop(session, frames, msg_id, approvals_stop) or {})
                race.cancel_scope.cancel()

            async def approval() -> None:
                await self.elicitation.approval_stop(ctx, caller, session)
                # No checkpoint since approval_stop saw a pending entry: the stop lists it.
                stops.append(self._stop(session, None, msg_id, approvals_stop) or {})
                race.cancel_scope.cancel()

            async def no_guest() -> None:
                # A grace, not a poll: one look, once a guest that was connecting has had its moment.
                await trio.sleep(NO_GUEST_GRACE)
                assert self.guest_absent is not None
                reason = await self.guest_absent(session.instance)
                if reason is not None:
                    stops.append({"stop_reason": "no_guest", "text": reason, "pending": []})
                    race.cancel_scope.cancel()

            race.start_soon(turn_end)
            race.start_soon(approval)
            if watch_guest and self.guest_absent is not None and seconds > NO_GUEST_GRACE:
                race.start_soon(no_guest)
            # A caller tool request, the usual stop of a caller answering with `wait`: watched by this
            # task, not a task of its own (one task and one scheduler round trip fewer per wait).
            await self.calls.wait_pending(session)
            stops.append(self._stop(session, None, msg_id, approvals_stop) or {})
            race.cancel_scope.cancel()
        if failed:
            raise failed[0]
        return stops[0]

    def _waiting_caller_left(self, caller: CallerConnection, session: Session) -> None:
        failed = self.caller_gone(caller, session)
        log.info("%r left while waiting in session %s; %d pending call(s) and approval(s) ended", caller, session.id, failed)
