"""The log tail: with a shared store, the frames other servers append reach this server's followers.

A caller connected to server A follows its sessions here (its events, a 2026-07-28 wait's
request-scoped events); the agent of one of them may be on server B, whose appends (the
agent's `caller_tool_request`, its deltas, its turn's end) A's `FrameLog` never sees. One
`LogTail` per server brings them: the store's LISTEN connection tells it of every commit
(instance, first and last seq: `AppendNoticeHook`), and for each instance it was told of and
that has a follower here it reads the new frames once (one query per instance and wake, not
one per caller), from its cursor, and hands those this server did not append to `push_frame`,
the push path of local appends (docs/SCALING.md, "The log tail").

- **Pushed once.** `FrameLog` tells the tail of each of its own appends (`appending`: the seq
  stored); the tail skips those, and before it decides, waits for the local appends that were in
  flight when its read returned (one of them may have stored a frame the read saw). An append
  whose outcome this server never learned (the store failed after the commit) was pushed by
  nobody here, so the tail pushes it.
- **Nothing lost.** The cursor moves only past frames handled; when the listener reconnects
  (`missed`), every followed instance is read again from its cursor. An instance that has no
  follower is not read: its cursor follows the notices.
- **Bounded.** Cursors of at most `MAX_INSTANCES` instances (the least recently noticed are
  forgotten, and start again from their next notice); the seqs appended here are kept only
  above the cursor; a read is one page (`MAX_LIMIT` frames) at a time.
- **Store outage.** A read that fails with `StoreUnavailable` is logged and tried again after
  `OUTAGE_RETRY` s (doubling to `OUTAGE_RETRY_MAX`), or at once when a notice arrives; nothing
  is skipped meanwhile. Any other failure of a read is logged with its traceback and tried the
  same way: it never ends the server.

With SQLite the server is alone on its log and no tail runs (`frame_log.AloneOnTheLog`).
"""

from __future__ import annotations

import collections
import logging
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import trio

from ...core.frame_log import push_frame
from ...core.server_owned import PUSHED_TO_NOBODY
from ...core.sessions import SessionRegistry, delivers
from ...store.api import (
    MAX_LIMIT, OUTAGE_RETRY, OUTAGE_RETRY_MAX, AppendNotices, CursorPruned, FrameFields, StoreUnavailable,
)

log = logging.getLogger("oubliette.server.log_tail")

#: `_needed` after notices were lost: every seq may be wanted.
UNKNOWN_SEQS = sys.maxsize
#: Instances whose cursor the tail keeps at most (one int each); the least recently noticed go first.
MAX_INSTANCES = 10_000


def _nothing(count: int, seconds: float) -> None:
    """No metrics."""


class LogTail:
    """One server's tail of a shared log: pushes other servers' frames to the followers held here.

    Owns: one task (`await nursery.start(tail.serve)`). Needs: the shared store (its notices and
    `frames_after`), the session registry (who follows what), and `on_pushed(count, seconds)`, told how
    many frames one read pushed and how long after the first notice of them (metrics).
    Also a `frame_log.LocalAppends`: give it to the `FrameLog` as `local_appends`.
    """

    def __init__(
        self, store: AppendNotices, sessions: SessionRegistry,
        on_pushed: Callable[[int, float], None] = _nothing,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.on_pushed = on_pushed
        #: instance -> the last seq handled (pushed or passed), least recently noticed first.
        self._cursor: collections.OrderedDict[str, int] = collections.OrderedDict()
        #: instance -> seqs this server appended above the cursor (pushed by `FrameLog` already).
        self._here: dict[str, set[int]] = {}
        #: instance -> one event per local append in flight, set when it has noted its seq.
        self._busy: dict[str, set[trio.Event]] = {}
        #: instance -> (the last seq noticed, when the first unhandled notice came).
        self._dirty: dict[str, tuple[int, float]] = {}
        #: instance -> the last seq noticed that a follower here may want (or whose fields no
        #: notice named): the tail reads an instance only up to such a seq, else passes the notices.
        self._needed: dict[str, int] = {}
        #: instance -> events set when a read of it that began after they were asked for ends.
        self._asked: dict[str, list[trio.Event]] = {}
        self._missed = False
        self._wake = trio.Event()
        #: Frames pushed so far (for tests and benchmarks).
        self.pushed = 0

    # -- what the store tells (AppendNoticeHook) ----------------------------------------

    def appended(self, instance: str, first: int | None, last: int | None, fields: list[FrameFields] | None = None) -> None:
        """Frames `first`..`last` of `instance` were committed by some server: read them soon (when
        `fields`, the frames' filter fields, show one a follower here may want: else the cursor
        passes them unread)."""
        cursor = self._cursor.get(instance)
        if first is None or last is None:
            if cursor is None:
                return  # a notice without seqs (an earlier server version): nowhere to start from
            last = cursor
        elif cursor is None:
            self._remember(instance, first - 1)
        else:
            self._cursor.move_to_end(instance)
        if first is None or fields is None or self._wanted(instance, fields):
            self._needed[instance] = UNKNOWN_SEQS if first is None else max(self._needed.get(instance, 0), last)
        elif cursor == first - 1 and instance not in self._dirty:
            self._advance(instance, last)  # nothing before it to read, nothing in it: no wake of the task
            return
        noticed, since = self._dirty.get(instance, (last, trio.current_time()))
        self._dirty[instance] = (max(noticed, last), since)
        self._wake.set()

    def _wanted(self, instance: str, fields: list[FrameFields]) -> bool:
        """Some frame of these may be pushed here: of a session held here that someone follows (a
        sink that `delivers`: a 2026-07-28 caller's own connection does not), and of a type pushed
        to anyone."""
        for channel, session_id, type, _ in fields:
            if type not in PUSHED_TO_NOBODY:
                session = self.sessions.get(instance, channel, session_id)
                if session is not None and any(delivers(sink) for sink in session.sinks):
                    return True
        return False

    def _all_here(self, instance: str, first: int, last: int) -> bool:
        here = self._here.get(instance, ())
        return all(seq in here for seq in range(first, last + 1))

    def missed(self) -> None:
        """The listener reconnected: notices may have been lost, so read every followed instance again."""
        self._missed = True
        self._wake.set()

    async def caught_up(self, instance: str) -> None:
        """Return once everything of `instance` committed before this call was pushed here: a wait
        about to stop on a frame it read itself (a turn's end, another server's request) lets that
        frame's event go out first, as on one server. At once when nobody here follows it.
        Cancellation: the read goes on for the others; bound it with a cancel scope."""
        if instance not in self._cursor or not self._followed(instance):
            return
        read = trio.Event()
        self._asked.setdefault(instance, []).append(read)
        cursor = self._cursor[instance]
        noticed, since = self._dirty.get(instance, (cursor, trio.current_time()))
        self._dirty[instance] = (noticed, since)
        self._wake.set()
        await read.wait()

    # -- what FrameLog tells (LocalAppends) ---------------------------------------------

    @contextmanager
    def appending(self, instance: str) -> Iterator[Callable[[int], None]]:
        """Around one append of this server to `instance`: the seq it stored is noted as pushed here."""
        done = trio.Event()
        busy = self._busy.setdefault(instance, set())
        busy.add(done)
        try:
            yield lambda seq: self._stored_here(instance, seq)
        finally:
            busy.discard(done)
            if not busy and self._busy.get(instance) is busy:
                del self._busy[instance]
            done.set()

    def _stored_here(self, instance: str, seq: int) -> None:
        cursor = self._cursor.get(instance)
        if cursor is None or seq > cursor:
            self._here.setdefault(instance, set()).add(seq)

    # -- the task ------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hear the store's notices and push what other servers append, until cancelled."""
        self.store.hear_appends(self)
        task_status.started()
        delay = OUTAGE_RETRY
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self._catch_up()
            except Exception as exc:  # contained: an escape would end the server; the cursor stays
                if isinstance(exc, StoreUnavailable):
                    log.warning("log tail: cannot read the frames other servers appended (%s); again in %.0f s",
                                exc, delay)
                else:
                    log.exception("log tail: reading the frames other servers appended failed; again in %.0f s", delay)
                with trio.move_on_after(delay):
                    await self._wake.wait()
                self._wake.set()
                delay = min(delay * 2, OUTAGE_RETRY_MAX)
            else:
                delay = OUTAGE_RETRY

    async def _catch_up(self) -> None:
        """Read every instance noticed (all followed ones after `missed`); one that fails stays to read."""
        if self._missed:
            self._missed = False
            now = trio.current_time()
            for instance in list(self._cursor):
                if self._followed(instance):
                    self._dirty.setdefault(instance, (self._cursor[instance], now))
                    self._needed[instance] = UNKNOWN_SEQS  # what was missed is not known: read it all
                else:
                    self._forget(instance)  # no follower to owe: start again from its next notice
            for instance in list(self._here):
                if instance not in self._cursor and instance not in self._busy:
                    del self._here[instance]  # its notices were lost: it starts from the next one
        while self._dirty:
            instance = next(iter(self._dirty))
            noticed, since = self._dirty.pop(instance)
            asked = self._asked.pop(instance, [])
            needed = self._needed.pop(instance, None)
            try:
                await self._read(instance, noticed, since, asked=bool(asked), needed=needed)
            except BaseException:
                old = self._dirty.get(instance)
                self._dirty[instance] = (max(noticed, old[0]), since) if old else (noticed, since)
                self._asked.setdefault(instance, []).extend(asked)
                if needed is not None:
                    self._needed[instance] = max(needed, self._needed.get(instance, 0))
                raise
            for read in asked:
                read.set()

    async def _read(self, instance: str, noticed: int, since: float, *, asked: bool = False, needed: int | None = None) -> None:
        """Push the frames of `instance` after its cursor that other servers appended, page by page
        (no read when the notices were all of this server's appends, or named only frames nobody
        here follows (`needed`: the last seq one may want), unless `asked` by `caught_up`)."""
        cursor = self._cursor.get(instance)
        if cursor is None:
            return
        if not self._followed(instance) or (not asked and (needed is None or needed <= cursor)):
            self._advance(instance, max(cursor, noticed))
            return
        await self._local_appends_noted(instance)  # a notice may overtake its own append's return
        cursor = self._cursor.get(instance, cursor)
        if not asked and noticed > cursor and self._all_here(instance, cursor + 1, noticed):
            self._advance(instance, noticed)
            return
        pushed = 0
        while True:
            try:
                page = await self.store.frames_after(instance, cursor, MAX_LIMIT)
            except CursorPruned as exc:
                log.warning("log tail: frames %d-%d of %s were pruned before they were read here",
                            cursor + 1, exc.first_seq - 1, instance)
                cursor = exc.first_seq - 1
                continue
            # A local append in flight when the read returned may have stored one of these frames.
            await self._local_appends_noted(instance)
            here = self._here.get(instance, ())
            for frame in page:
                if frame.seq in here or frame.type in PUSHED_TO_NOBODY:
                    continue
                session = self.sessions.get(instance, frame.channel, frame.session_id)
                if session is not None and session.sinks:
                    push_frame(session, frame)
                    pushed += 1
            if page:
                cursor = page[-1].seq
            self._advance(instance, cursor)
            if len(page) < MAX_LIMIT:
                break
        if pushed:
            self.pushed += pushed
            self.on_pushed(pushed, trio.current_time() - since)

    async def _local_appends_noted(self, instance: str) -> None:
        """Until the appends of this server to `instance` in flight now have noted their seq (each
        is one store call, bounded by its own deadline)."""
        for done in list(self._busy.get(instance, ())):
            await done.wait()

    def _followed(self, instance: str) -> bool:
        """Some session of `instance` held here has a follower."""
        return self.sessions.followed(instance)

    def _remember(self, instance: str, cursor: int) -> None:
        self._cursor[instance] = cursor
        self._cursor.move_to_end(instance)
        while len(self._cursor) > MAX_INSTANCES:
            self._forget(next(iter(self._cursor)))
        here = self._here.get(instance)
        if here:
            self._here[instance] = {seq for seq in here if seq > cursor}

    def _advance(self, instance: str, cursor: int) -> None:
        """Everything of `instance` up to `cursor` is handled."""
        self._remember(instance, max(cursor, self._cursor.get(instance, cursor)))
        if not self._here.get(instance):
            self._here.pop(instance, None)

    def _forget(self, instance: str) -> None:
        self._cursor.pop(instance, None)
        self._needed.pop(instance, None)
        self._here.pop(instance, None)
        self._dirty.pop(instance, None)
        for read in self._asked.pop(instance, []):
            read.set()  # nothing to wait for: nobody follows it here
