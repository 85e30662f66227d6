"""The frame store: the per-instance tether log, kept in SQLite.

Every message and event of every session is a *frame* (see DESIGN.md, "Frames", and seed 004
section 3).  This module stores frames, hands out the per-instance ``seq``, answers filtered
queries and wakes long-poll waiters.  It returns the protocol's one frame model,
:class:`protocol.frames.Frame`, so every view of a frame (wire, caller event) comes from it.

Storage decisions
=================

Engine and durability
    One SQLite database file in WAL mode.  The default ``durability="normal"`` runs with
    ``PRAGMA synchronous=NORMAL``: when :meth:`FrameStore.append` returns, its frames are
    committed to the WAL file, i.e. they sit in the OS page cache.  A crash of the server
    *process* loses nothing; only an OS crash or a power loss can lose the last few commits
    (the WAL is fsynced at checkpoints).  ``durability="full"`` runs with
    ``synchronous=FULL`` and fsyncs the WAL on every commit, so an append that returned
    survives a power loss too, at the price of one fsync per append (or per
    :meth:`FrameStore.append_many` batch).  ``path=":memory:"`` (:meth:`FrameStore.in_memory`)
    keeps everything in RAM, for tests.

Threads
    None.  Every SQLite call runs directly on the Trio thread: an append is one small
    transaction and a query reads at most ``limit`` (<= 200) rows through an index, so each
    SQLite call takes microseconds (an append is ~100 µs in all with its commit, a 50-row
    query ~100-300 µs including JSON decoding, at 1M frames; see ``bench/bench_store.py``).
    Handing them to a worker thread would cost as much as the work itself and would allow
    appends and queries to interleave.  The exceptions are rare and bounded: the automatic
    retention pass deletes about ``prune_every`` rows (~2 ms for 1000), and SQLite's
    automatic WAL checkpoint (every ~4 MiB of WAL) copies pages back into the database file.  Because everything happens on one thread, a query and the ``last_seq`` it
    sees are never interleaved with an append, which the long poll relies on.

    One server process owns a store file and is its only writer.  Another process may read the
    file (WAL allows it), but long-poll wakeups are in-process only.

Group commit
    The store's single writer hands out ``seq`` in memory (the highest assigned seq of each
    instance is read once from the file, then kept) and commits appends in groups: the first
    append of a burst yields once to the scheduler, so the appends of other tasks that are
    ready to run join it, then one transaction stores them all; every append of the group
    returns (is acknowledged) only after that commit.  A lone append costs one transaction, as
    before, minus the per-append update of ``instances.last_seq`` (see "Schema").  If the
    commit fails, every append of the group raises and their seqs are handed out again.  An
    append whose task is cancelled while its group commits still completes (the cancellation
    is seen at the caller's next checkpoint), so "if it raises, nothing was stored" holds.

Schema (``PRAGMA user_version = 1``)
    ``instances(iid INTEGER PRIMARY KEY, name UNIQUE, last_seq, pruned_below)`` — the highest
    ``seq`` ever committed for the instance is ``max(last_seq, MAX(frames.seq))``: appends
    do not update ``last_seq`` (one row write fewer per commit); retention writes it in the
    transaction that deletes frames, so pruning (even of every frame) never resets ``seq``.  ``pruned_below`` says that every
    frame with ``seq <= pruned_below`` has been deleted by retention; the retained log of an
    instance is always the contiguous range ``pruned_below+1 .. last_seq``.

    ``frames(iid, seq, ts, channel, session_id, type, msg_id, reply_to, payload)``,
    ``PRIMARY KEY (iid, seq) WITHOUT ROWID`` — the table is clustered by instance and seq, so
    "frames of an instance after a seq" is one b-tree range scan.  The instance name is
    interned as a small integer (``iid``) to keep the table and its indexes small.
    ``payload`` is JSON text.  Secondary indexes (each also carries the primary key):

    * ``frames_by_session (iid, session_id, channel, seq)`` — channel + session id + after_seq
      (the tether_read / session_events shape) is one range scan already in seq order.
      ``session_id`` comes before ``channel`` so a query by session id alone still uses the
      index (it then sorts that session's frames after ``after_seq``).
    * ``frames_by_type (iid, type, seq)`` — a ``types`` filter without a session filter runs
      one range scan per type (each stopping after ``limit`` matches; index-only when there
      is no channel filter), merges them and reads just the winning rows, so its cost does
      not depend on how rare the types are.  (More than 16 types: row-by-row filter.)
    * ``frames_by_reply (iid, reply_to, seq) WHERE reply_to IS NOT NULL`` — ``reply_to``.

    The plan for each filter combination is pinned with ``INDEXED BY`` (a missing index is an
    error, not a silent full scan); :meth:`FrameStore.query_plan` shows it, and the tests
    check it with ``EXPLAIN QUERY PLAN``.  Residual filters (``types`` together with a
    session, ``channel`` alone) are checked row by row during the scan; ``channel`` without
    ``session_id`` uses the primary key.

    ``cursors(instance, name, seq)`` — named durable cursors (for example the seq the guest
    runtime has delivered), ``PRIMARY KEY (instance, name) WITHOUT ROWID``.

Retention
    By default the newest ``100_000`` frames of each instance are kept
    (``retention_frames``); ``retention_seconds`` additionally drops frames older than that
    (by their ``ts``).  ``None`` disables either rule.  Retention is applied when the store is
    opened, every ``prune_every`` (default 1000) appends to an instance, and whenever
    :meth:`FrameStore.prune` is called (a server that uses ``retention_seconds`` should call it
    periodically, since time passes without appends).  Retention only ever deletes the oldest
    frames of an instance.  A query whose ``after_seq`` points below the retained log raises
    :class:`CursorPruned`, which names the ``after_seq`` to resume from, instead of silently
    skipping frames.

Files
    The parent directory is created if missing (mode 0700).  A database file created by the
    store gets mode 0600; SQLite gives its ``-wal`` and ``-shm`` files the same mode.

Long poll
    One ``trio.Event`` per instance that has waiters.  Every append replaces it (the old one
    is set: a broadcast); woken waiters re-run their own query, looking only at frames newer
    than the ones they already examined, and go back to waiting until their deadline.  The
    event is dropped when the last waiter of an instance leaves, including by cancellation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from protocol.frames import FRAME_VERSION, Frame, SessionRef

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_PRUNE_EVERY",
    "DEFAULT_RETENTION_FRAMES",
    "MAX_LIMIT",
    "CursorPruned",
    "FrameQuery",
    "FrameStore",
    "format_ts",
]

log = logging.getLogger(__name__)

MAX_LIMIT = 200
#: The largest seq SQLite can hold (a signed 64-bit INTEGER); numbers from outside are
#: range-checked against it before they reach a query, which would raise OverflowError.
MAX_SEQ = 2**63 - 1
DEFAULT_LIMIT = 50
DEFAULT_RETENTION_FRAMES = 100_000
DEFAULT_PRUNE_EVERY = 1000
SCHEMA_VERSION = 1

# A ``types`` filter with more distinct types than this is not split into one index scan per
# type; it is checked row by row along the primary key instead.
_MAX_TYPE_UNION = 16

# One encoder for every payload (json.dumps with options builds a new one per call).
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode

_APPEND_KEYS = frozenset({"channel", "session_id", "type", "payload", "msg_id", "reply_to"})
_REQUIRED_KEYS = frozenset({"channel", "session_id", "type", "payload"})


_ts_cache: tuple[int, str] = (-1, "")


def format_ts(epoch: float) -> str:
    """ISO-8601 UTC with milliseconds and ``Z``: ``2026-11-22T10:00:00.123Z``."""
    global _ts_cache
    secs, ms = divmod(round(epoch * 1000), 1000)
    cached_secs, prefix = _ts_cache
    if secs != cached_secs:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
        _ts_cache = (secs, prefix)
    return f"{prefix}.{ms:03d}Z"


# --------------------------------------------------------------------------------------------
# Records


def _frame(seq: int, ts: str, instance: str, channel: str, session_id: str, type: str, msg_id: str,
           reply_to: str | None, payload: dict[str, Any]) -> Frame:
    return Frame(
        v=FRAME_VERSION, seq=seq, ts=ts, instance=instance, session=SessionRef(channel=channel, id=session_id),
        type=type, msg_id=msg_id, reply_to=reply_to, payload=payload,
    )


def _types_converter(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise TypeError(f"types must be a sequence of strings, not a single {type(value).__name__}")
    types = tuple(dict.fromkeys(value))  # dedupe, keep order
    # An empty list means "no filter" (tether_read: "Default: all types").
    return types or None


@attrs.define(frozen=True)
class FrameQuery:
    """Filters for :meth:`FrameStore.query` and :meth:`FrameStore.wait_for_frames`.

    Frames with ``seq > after_seq`` that match every given filter, oldest first, at most
    ``limit`` (1..200, default 50).  ``types`` is any iterable of type names (stored as a
    tuple; an empty one means no filter)."""

    channel: str | None = None
    session_id: str | None = None
    after_seq: int = 0
    types: tuple[str, ...] | None = attrs.field(default=None, converter=_types_converter)
    reply_to: str | None = None
    limit: int = DEFAULT_LIMIT

    def __attrs_post_init__(self) -> None:
        if not _is_int(self.limit):
            raise TypeError(f"limit must be an integer, got {self.limit!r}")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {self.limit}")
        if not _is_int(self.after_seq):
            raise TypeError(f"after_seq must be an integer, got {self.after_seq!r}")
        if self.after_seq < 0:
            raise ValueError(f"after_seq must be >= 0, got {self.after_seq}")
        if self.after_seq > MAX_SEQ:
            raise ValueError(f"after_seq must be <= {MAX_SEQ} (2^63 - 1), got {self.after_seq}")
        for name in ("channel", "session_id", "reply_to"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None, got {value!r}")
        if self.types is not None:
            for t in self.types:
                if not isinstance(t, str):
                    raise TypeError(f"types must contain strings only, got {t!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CursorPruned(Exception):
    """``after_seq`` points below the retained log of the instance: frames the reader has
    not seen were deleted by retention.  ``first_seq`` is the oldest seq that may still be
    kept; read again from ``after_seq = first_seq - 1`` (accepting the gap)."""

    def __init__(self, instance: str, after_seq: int, first_seq: int, *, empty: bool = False) -> None:
        self.instance = instance
        self.after_seq = after_seq
        self.first_seq = first_seq
        if empty:
            where = f"every frame up to seq {first_seq - 1} has been pruned"
        else:
            where = f"oldest kept frame is seq {first_seq}"
        super().__init__(
            f"cursor after_seq={after_seq} is older than the retained log of instance "
            f"{instance!r} ({where}); read from after_seq={first_seq - 1}"
        )

    def __reduce__(self) -> Any:  # keep pickling (and copying) working
        return (_rebuild_cursor_pruned, (self.instance, self.after_seq, self.first_seq, str(self)))


def _rebuild_cursor_pruned(instance: str, after_seq: int, first_seq: int, message: str) -> CursorPruned:
    exc = CursorPruned(instance, after_seq, first_seq)
    exc.args = (message,)
    return exc


# --------------------------------------------------------------------------------------------
# The store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS instances (
    iid          INTEGER PRIMARY KEY,
    name         TEXT    NOT NULL UNIQUE,
    last_seq     INTEGER NOT NULL,
    pruned_below INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS frames (
    iid        INTEGER NOT NULL,
    seq        INTEGER NOT NULL,
    ts         TEXT    NOT NULL,
    channel    TEXT    NOT NULL,
    session_id TEXT    NOT NULL,
    type       TEXT    NOT NULL,
    msg_id     TEXT    NOT NULL,
    reply_to   TEXT,
    payload    TEXT    NOT NULL,
    PRIMARY KEY (iid, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS frames_by_session ON frames (iid, session_id, channel, seq);
CREATE INDEX IF NOT EXISTS frames_by_type ON frames (iid, type, seq);
CREATE INDEX IF NOT EXISTS frames_by_reply ON frames (iid, reply_to, seq) WHERE reply_to IS NOT NULL;
CREATE TABLE IF NOT EXISTS cursors (
    instance TEXT    NOT NULL,
    name     TEXT    NOT NULL,
    seq      INTEGER NOT NULL,
    PRIMARY KEY (instance, name)
) WITHOUT ROWID;
"""

_COLS = "seq, ts, channel, session_id, type, msg_id, reply_to, payload"

_INSERT_FRAME = (
    "INSERT INTO frames (iid, seq, ts, channel, session_id, type, msg_id, reply_to, payload) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# A new instance's row, created in the transaction of its first frames.
_NEW_INSTANCE = "INSERT INTO instances (name, last_seq, pruned_below) VALUES (?, 0, 0)"

_DURABILITY = {"normal": "NORMAL", "full": "FULL"}


class FrameStore:
    """The tether log of every instance, in one SQLite database (see the module docstring).

    Use it from one Trio thread.  ``append``/``append_many``/``wait_for_frames`` are async
    (they are Trio checkpoints and ``wait_for_frames`` blocks); the other methods are plain
    synchronous calls that take microseconds."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention_frames: int | None = DEFAULT_RETENTION_FRAMES,
        retention_seconds: float | None = None,
        durability: str = "normal",
        prune_every: int = DEFAULT_PRUNE_EVERY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if retention_frames is not None and (not _is_int(retention_frames) or retention_frames < 1):
            raise ValueError(f"retention_frames must be a positive integer or None, got {retention_frames!r}")
        if retention_seconds is not None and not (
            isinstance(retention_seconds, (int, float)) and retention_seconds > 0 and math.isfinite(retention_seconds)
        ):
            raise ValueError(f"retention_seconds must be a positive number or None, got {retention_seconds!r}")
        if durability not in _DURABILITY:
            raise ValueError(f"durability must be one of {sorted(_DURABILITY)}, got {durability!r}")
        if not _is_int(prune_every) or prune_every < 1:
            raise ValueError(f"prune_every must be a positive integer, got {prune_every!r}")
        self.retention_frames = retention_frames
        self.retention_seconds = retention_seconds
        self.durability = durability
        self.prune_every = prune_every
        self._clock = clock

        spath = os.fspath(path)
        self.path = spath
        if spath != ":memory:" and not spath.startswith("file:"):
            _prepare_file(Path(spath))

        self._conn: sqlite3.Connection | None = sqlite3.connect(spath, isolation_level=None)
        try:
            self._setup()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise

        self._iids: dict[str, int] = {}
        # Per instance: the highest seq handed out, and the highest committed (see "Group commit").
        self._assigned: dict[str, int] = {}
        self._committed: dict[str, int] = {}
        self._group: _Group | None = None
        self._appends_since_prune: dict[str, int] = {}
        self._wake: dict[str, trio.Event] = {}
        self._waiters: dict[str, int] = {}
        self.prune()

    @classmethod
    def in_memory(cls, **kw: Any) -> FrameStore:
        """A store that lives in RAM only (for tests)."""
        return cls(":memory:", **kw)

    # -- setup ---------------------------------------------------------------------------

    def _setup(self) -> None:
        db = self._db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={_DURABILITY[self.durability]}")
        db.execute("PRAGMA busy_timeout=5000")
        db.execute("PRAGMA temp_store=MEMORY")
        db.execute("PRAGMA cache_size=-32768")  # 32 MiB
        db.execute("PRAGMA journal_size_limit=67108864")  # truncate the WAL to 64 MiB after checkpoints
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"frame store {self.path!r} has schema version {version}; this program knows "
                f"version {SCHEMA_VERSION} — refusing to open it"
            )
        with self._transaction():
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the frame store is closed")
        return self._conn

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def close(self) -> None:
        """Close the database.  Idempotent."""
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def __enter__(self) -> FrameStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether `close` has run (the database connection is gone)."""
        return self._conn is None

    # -- instances -----------------------------------------------------------------------

    def _iid(self, instance: str) -> int | None:
        iid = self._iids.get(instance)
        if iid is None:
            row = self._db.execute("SELECT iid FROM instances WHERE name = ?", (instance,)).fetchone()
            if row is None:
                return None
            iid = self._iids[instance] = row[0]
        return iid

    def instances(self) -> list[str]:
        """Names of every instance that has ever had a frame appended, sorted."""
        return [r[0] for r in self._db.execute("SELECT name FROM instances ORDER BY name")]

    def last_seq(self, instance: str) -> int:
        """The highest seq ever committed for ``instance`` (0 if none)."""
        return self._committed_seq(instance)

    def _committed_seq(self, instance: str) -> int:
        """The highest committed seq of ``instance``, read from the file once, then kept in memory."""
        last = self._committed.get(instance)
        if last is None:
            row = self._db.execute("SELECT iid, last_seq FROM instances WHERE name = ?", (instance,)).fetchone()
            if row is None:
                return 0  # not cached: the instance's first commit creates it
            iid, last = row
            top = self._db.execute("SELECT MAX(seq) FROM frames WHERE iid = ?", (iid,)).fetchone()[0]
            last = max(last, top or 0)
            self._iids[instance] = iid
            self._committed[instance] = self._assigned[instance] = last
        return last

    def pruned_below(self, instance: str) -> int:
        """Every frame of ``instance`` with ``seq <=`` this has been deleted by retention (0 if
        none).  Reading from ``after_seq = pruned_below(instance)`` never raises
        :class:`CursorPruned` (until retention runs again)."""
        row = self._db.execute("SELECT pruned_below FROM instances WHERE name = ?", (instance,)).fetchone()
        return 0 if row is None else row[0]

    # -- append --------------------------------------------------------------------------

    def _prepare(
        self,
        channel: Any,
        session_id: Any,
        type: Any,
        payload: Any,
        msg_id: Any,
        reply_to: Any,
    ) -> tuple[str, str, str, str, str | None, str, dict]:
        for name, value in (("channel", channel), ("session_id", session_id), ("type", type)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(payload, dict):
            raise TypeError(f"payload must be a dict, got {payload.__class__.__name__}")
        if msg_id is None:
            msg_id = "m-" + os.urandom(16).hex()  # 128 random bits, as uuid4().hex, at a quarter of its cost
        elif not isinstance(msg_id, str) or not msg_id:
            raise ValueError(f"msg_id must be a non-empty string or None, got {msg_id!r}")
        if reply_to is not None and not isinstance(reply_to, str):
            raise TypeError(f"reply_to must be a string or None, got {reply_to!r}")
        # allow_nan=False: NaN/Infinity are not JSON.  Round-trip so the returned frame holds
        # exactly what a later query returns (and is not shared with the caller).
        text = _ENCODE(payload)
        return channel, session_id, type, msg_id, reply_to, text, json.loads(text)

    async def append(
        self,
        instance: str,
        *,
        channel: str,
        session_id: str,
        type: str,
        payload: dict,
        msg_id: str | None = None,
        reply_to: str | None = None,
    ) -> Frame:
        """Append one frame; its seq is the next after the highest ever assigned for the
        instance.  ``msg_id`` defaults to ``"m-"`` and 32 random hex digits.  Wakes the instance's
        waiters.  The frame is committed when this returns (see the module docstring for
        what that means for durability); if it raises, nothing was stored."""
        prepared = [self._prepare(channel, session_id, type, payload, msg_id, reply_to)]
        return (await self._append(instance, prepared))[0]

    async def append_many(self, instance: str, frames: list[dict]) -> list[Frame]:
        """Append several frames in one transaction (consecutive seqs, one commit, one
        wakeup).  Each dict holds :meth:`append`'s keyword arguments."""
        prepared = []
        for i, f in enumerate(frames):
            if not isinstance(f, dict):
                raise TypeError(f"frames[{i}] must be a dict, got {f.__class__.__name__}")
            unknown = f.keys() - _APPEND_KEYS
            if unknown:
                raise TypeError(f"frames[{i}] has unknown keys {sorted(unknown)}")
            missing = _REQUIRED_KEYS - f.keys()
            if missing:
                raise TypeError(f"frames[{i}] is missing {sorted(missing)}")
            prepared.append(
                self._prepare(
                    f["channel"], f["session_id"], f["type"], f["payload"], f.get("msg_id"), f.get("reply_to")
                )
            )
        return await self._append(instance, prepared)

    async def _append(self, instance: str, prepared: list[tuple]) -> list[Frame]:
        if not isinstance(instance, str) or not instance:
            raise ValueError(f"instance must be a non-empty string, got {instance!r}")
        await trio.lowlevel.checkpoint_if_cancelled()
        if not prepared:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        if self._conn is None:  # a closed store refuses before a seq is handed out
            raise RuntimeError("the frame store is closed")
        n = len(prepared)
        last = self._assigned.get(instance)
        if last is None:
            last = self._committed_seq(instance)
        first = last + 1
        self._assigned[instance] = last + n
        ts = format_ts(self._clock())
        group = self._group
        leader = group is None
        if group is None:
            group = self._group = _Group()
        group.base.setdefault(instance, last)
        group.parts.append((instance, first, ts, prepared))
        if leader:
            # Let the appends of other ready tasks join this commit; nothing may stop it now
            # (the others wait for it, shielded).
            try:
                await trio.lowlevel.cancel_shielded_checkpoint()
            finally:
                self._group = None
                self._commit(group)
        else:
            with trio.CancelScope(shield=True):
                await group.done.wait()
        if group.error is not None:
            raise group.error
        return [
            _frame(first + i, ts, instance, ch, sid, typ, mid, rt, obj)
            for i, (ch, sid, typ, mid, rt, _, obj) in enumerate(prepared)
        ]

    def _commit(self, group: _Group) -> None:
        """Store a group's frames in one transaction, then wake waiters and apply retention;
        on failure, hand the group's seqs out again.  Sets ``group.done`` either way."""
        created: list[str] = []
        try:
            db = self._db
            # A deferred BEGIN: this process is the only writer, so the write lock is free.
            with _Transaction(db, "BEGIN"):
                for instance in group.base:
                    if instance not in self._iids:
                        self._iids[instance] = db.execute(_NEW_INSTANCE, (instance,)).lastrowid
                        created.append(instance)
                rows = [
                    (self._iids[instance], first + i, ts, ch, sid, typ, mid, rt, text)
                    for instance, first, ts, prepared in group.parts
                    for i, (ch, sid, typ, mid, rt, text, _) in enumerate(prepared)
                ]
                if len(rows) == 1:
                    db.execute(_INSERT_FRAME, rows[0])
                else:
                    db.executemany(_INSERT_FRAME, rows)
        except BaseException as exc:
            for instance, base in group.base.items():
                self._assigned[instance] = base
            for instance in created:
                del self._iids[instance]
            group.error = exc
            group.done.set()
            return
        group.done.set()
        for instance, _, _, prepared in group.parts:
            self._committed[instance] = max(self._committed.get(instance, 0), self._assigned[instance])
        for instance in group.base:
            event = self._wake.pop(instance, None)
            if event is not None:
                event.set()
            count = self._appends_since_prune.get(instance, 0) + sum(
                len(prepared) for inst, _, _, prepared in group.parts if inst == instance
            )
            if count >= self.prune_every:
                self._appends_since_prune[instance] = 0
                try:
                    self._prune_instance(instance, self._iids[instance])
                except sqlite3.Error:
                    # The frames are committed; retention will be retried next time.
                    log.exception("frame store: retention for instance %r failed", instance)
            else:
                self._appends_since_prune[instance] = count

    # -- query ---------------------------------------------------------------------------

    def _build(self, iid: int, q: FrameQuery) -> tuple[str, list[Any]]:
        """SQL and parameters for ``q`` (see "Schema" in the module docstring)."""
        extra: list[str] = []
        params: list[Any] = []

        def residual(*names: str) -> None:
            for name in names:
                value = getattr(q, name)
                if value is not None:
                    extra.append(f"{name} = ?")
                    params.append(value)

        def residual_types() -> None:
            if q.types is not None:
                extra.append(f"type IN ({', '.join('?' * len(q.types))})")
                params.extend(q.types)

        if q.reply_to is not None:
            head = f"SELECT {_COLS} FROM frames INDEXED BY frames_by_reply WHERE iid = ? AND reply_to = ? AND seq > ?"
            params = [iid, q.reply_to, q.after_seq]
            residual("session_id", "channel")
            residual_types()
        elif q.session_id is not None:
            head = f"SELECT {_COLS} FROM frames INDEXED BY frames_by_session WHERE iid = ? AND session_id = ?"
            params = [iid, q.session_id]
            if q.channel is not None:
                head += " AND channel = ?"
                params.append(q.channel)
            head += " AND seq > ?"
            params.append(q.after_seq)
            residual_types()
        elif q.types is not None and len(q.types) == 1:
            head = f"SELECT {_COLS} FROM frames INDEXED BY frames_by_type WHERE iid = ? AND type = ? AND seq > ?"
            params = [iid, q.types[0], q.after_seq]
            residual("channel")
        elif q.types is not None and len(q.types) <= _MAX_TYPE_UNION:
            # One range scan per type along (iid, type, seq), each stopping after ``limit``
            # matches; merge them.  Without a channel filter the scans read the index only
            # and just the ``limit`` winning rows are fetched from the table.
            if q.channel is None:
                cols, sub_cols = "seq", "seq"
            else:
                cols, sub_cols = _COLS, "*"
            parts = []
            for t in q.types:
                sub = f"SELECT {cols} FROM frames INDEXED BY frames_by_type WHERE iid = ? AND type = ? AND seq > ?"
                params.extend((iid, t, q.after_seq))
                if q.channel is not None:
                    sub += " AND channel = ?"
                    params.append(q.channel)
                parts.append(f"SELECT {sub_cols} FROM ({sub} ORDER BY seq LIMIT ?)")
                params.append(q.limit)
            sql = " UNION ALL ".join(parts) + " ORDER BY seq LIMIT ?"
            params.append(q.limit)
            if q.channel is None:
                sql = f"SELECT {_COLS} FROM frames WHERE iid = ? AND seq IN ({sql}) ORDER BY seq"
                params.insert(0, iid)
            return sql, params
        else:
            head = f"SELECT {_COLS} FROM frames WHERE iid = ? AND seq > ?"
            params = [iid, q.after_seq]
            residual("channel")
            residual_types()
        sql = head + "".join(f" AND {e}" for e in extra) + " ORDER BY seq LIMIT ?"
        params.append(q.limit)
        return sql, params

    def query(self, instance: str, q: FrameQuery) -> list[Frame]:
        """Frames of ``instance`` matching ``q``, by seq ascending, at most ``q.limit``.

        Raises :class:`CursorPruned` if ``q.after_seq`` is below the retained log (frames
        after it were deleted by retention).  An unknown instance has no frames."""
        if not isinstance(q, FrameQuery):
            raise TypeError(f"q must be a FrameQuery, got {q.__class__.__name__}")
        db = self._db
        last = self._committed_seq(instance)
        row = db.execute("SELECT iid, pruned_below FROM instances WHERE name = ?", (instance,)).fetchone()
        if row is None:
            return []
        iid, pruned = row
        if q.after_seq < pruned:
            raise CursorPruned(instance, q.after_seq, pruned + 1, empty=pruned >= last)
        if q.after_seq >= last:
            return []
        sql, params = self._build(iid, q)
        loads = json.loads
        return [
            _frame(seq, ts, instance, ch, sid, typ, mid, rt, loads(payload))
            for seq, ts, ch, sid, typ, mid, rt, payload in db.execute(sql, params)
        ]

    def query_plan(self, instance: str, q: FrameQuery) -> list[str]:
        """``EXPLAIN QUERY PLAN`` of the SQL :meth:`query` runs for ``q`` (for tests and the
        benchmark); one line per plan step."""
        sql, params = self._build(self._iid(instance) or 0, q)
        return [r[3] for r in self._db.execute("EXPLAIN QUERY PLAN " + sql, params)]

    # -- long poll -----------------------------------------------------------------------

    async def wait_for_frames(self, instance: str, q: FrameQuery, timeout: float) -> tuple[list[Frame], bool]:
        """Long poll: :meth:`query`; if nothing matches and ``timeout > 0`` (seconds), wait
        until a matching frame is appended or the timeout expires.

        Returns ``(frames, timed_out)``.  ``timed_out`` is True only when it waited and got
        nothing; with ``timeout == 0`` it returns at once with ``timed_out=False``.
        Cancellation propagates as usual (``trio.Cancelled``) and leaves nothing behind."""
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or math.isnan(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        await trio.lowlevel.checkpoint_if_cancelled()
        # No await between reading last_seq and querying: no append can slip in between, so
        # every frame with seq <= seen has been examined.
        seen = self.last_seq(instance)
        frames = self.query(instance, q)
        if frames or timeout == 0:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return frames, False
        deadline = trio.current_time() + timeout
        self._waiters[instance] = self._waiters.get(instance, 0) + 1
        try:
            while True:
                if seen > q.after_seq:
                    # Frames up to ``seen`` did not match and never will (frames are
                    # immutable), so only look at newer ones.
                    q = attrs.evolve(q, after_seq=seen)
                event = self._wake.get(instance)
                if event is None:
                    event = self._wake[instance] = trio.Event()
                with trio.move_on_at(deadline) as scope:
                    await event.wait()
                seen = self.last_seq(instance)
                frames = self.query(instance, q)
                if frames:
                    return frames, False
                if scope.cancelled_caught:
                    return [], True
        finally:
            left = self._waiters[instance] - 1
            if left:
                self._waiters[instance] = left
            else:
                del self._waiters[instance]
                self._wake.pop(instance, None)

    def waiter_count(self, instance: str | None = None) -> int:
        """How many tasks are in :meth:`wait_for_frames` for ``instance`` (or for all)."""
        if instance is None:
            return sum(self._waiters.values())
        return self._waiters.get(instance, 0)

    # -- named cursors -------------------------------------------------------------------

    def get_cursor(self, instance: str, name: str) -> int:
        """The durable cursor ``name`` of ``instance`` (0 if never set)."""
        row = self._db.execute(
            "SELECT seq FROM cursors WHERE instance = ? AND name = ?", (instance, name)
        ).fetchone()
        return 0 if row is None else row[0]

    def set_cursor(self, instance: str, name: str, seq: int) -> None:
        """Set (and commit) the durable cursor ``name`` of ``instance``."""
        if not isinstance(instance, str) or not instance or not isinstance(name, str) or not name:
            raise ValueError("instance and cursor name must be non-empty strings")
        if not _is_int(seq) or seq < 0:
            raise ValueError(f"cursor seq must be an integer >= 0, got {seq!r}")
        if seq > MAX_SEQ:
            raise ValueError(f"cursor seq must be <= {MAX_SEQ} (2^63 - 1), got {seq}")
        with self._transaction():
            self._db.execute(
                "INSERT INTO cursors (instance, name, seq) VALUES (?, ?, ?) "
                "ON CONFLICT (instance, name) DO UPDATE SET seq = excluded.seq",
                (instance, name, seq),
            )

    # -- retention -----------------------------------------------------------------------

    def prune(self) -> int:
        """Apply retention to every instance now; return how many frames were deleted."""
        total = 0
        for instance, iid in self._db.execute("SELECT name, iid FROM instances").fetchall():
            total += self._prune_instance(instance, iid)
            self._appends_since_prune[instance] = 0
        return total

    def _prune_instance(self, instance: str, iid: int) -> int:
        if self.retention_frames is None and self.retention_seconds is None:
            return 0
        db = self._db
        last = self._committed_seq(instance)
        with self._transaction():
            (pruned,) = db.execute("SELECT pruned_below FROM instances WHERE iid = ?", (iid,)).fetchone()
            cut = pruned
            if self.retention_frames is not None:
                cut = max(cut, last - self.retention_frames)
            if self.retention_seconds is not None:
                oldest_ts = format_ts(self._clock() - self.retention_seconds)
                # The first retained frame that is young enough; everything before it goes.
                row = db.execute(
                    "SELECT seq FROM frames WHERE iid = ? AND seq > ? AND ts >= ? ORDER BY seq LIMIT 1",
                    (iid, cut, oldest_ts),
                ).fetchone()
                cut = last if row is None else max(cut, row[0] - 1)
            if cut <= pruned:
                return 0
            deleted = db.execute("DELETE FROM frames WHERE iid = ? AND seq <= ?", (iid, cut)).rowcount
            # last_seq with the deletion: the frames that held the highest seq may be gone now.
            db.execute("UPDATE instances SET pruned_below = ?, last_seq = ? WHERE iid = ?", (cut, last, iid))
        if deleted:
            log.debug("frame store: pruned %d frames of instance %r (seq <= %d)", deleted, instance, cut)
        return deleted


@attrs.define(eq=False)
class _Group:
    """Appends committed together (see "Group commit"): their frames, the seq each instance had
    before them (to hand out again if the commit fails), and the commit's outcome."""

    parts: list[tuple[str, int, str, list[tuple]]] = attrs.field(factory=list)
    base: dict[str, int] = attrs.field(factory=dict)
    done: trio.Event = attrs.field(factory=trio.Event)
    error: BaseException | None = None


class _Transaction:
    """``BEGIN IMMEDIATE`` (or the given ``begin``) … ``COMMIT``, or ``ROLLBACK`` on any exception."""

    __slots__ = ("_begin", "_db")

    def __init__(self, db: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> None:
        self._db = db
        self._begin = begin

    def __enter__(self) -> None:
        self._db.execute(self._begin)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._db.execute("COMMIT")
        elif self._db.in_transaction:
            self._db.execute("ROLLBACK")


def _prepare_file(path: Path) -> None:
    """Create the parent directory (0700) and the database file (0600) if missing."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
