"""The frame store: the per-instance tether log, kept in SQLite (the default store).

Every message and event of every session is a *frame* (docs/TETHER.md, "Frames").
This module stores frames, hands out the per-instance ``seq``, answers filtered queries and
wakes long-poll waiters. It returns the protocol's one frame model,
:class:`protocol.frames.Frame`, so every view of a frame (wire, caller event) comes from it.
Its interface is :class:`api.FrameStoreAPI`, which the PostgreSQL store
(``store/postgres.py``) implements too.

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

    The append path is kept lean (``bench/bench_store.py``, single appends): the
    payload is serialised once (``api.prepare_frame``; a flat payload's private copy is
    a ``dict`` copy, not a decode of the text), the group is a slotted object whose wake-up
    event exists only when a second append joins, and the returned ``Frame`` is built straight
    from the checked fields.  A lone frame of a known instance is one ``INSERT`` run in
    autocommit mode, which SQLite commits (or rolls back and raises) before ``execute``
    returns: the same transaction and durability as ``BEGIN``/``INSERT``/``COMMIT`` in one
    call instead of three (~84 → ~80 µs of CPU per append; the raw calls alone take ~15% less
    wall time, measured by themselves).  A group, or a new instance's first
    frame, is one explicit transaction.  The rest is the one schedule point (~10 µs), the
    ``Frame`` and the JSON encoding, which an acknowledged append in this API needs.

Schema (``PRAGMA user_version = 1``)
    ``instances(iid INTEGER PRIMARY KEY, name UNIQUE, last_seq, pruned_below)`` — the highest
    ``seq`` ever committed for the instance is ``max(last_seq, MAX(frames.seq))``: appends
    do not update ``last_seq`` (one row write fewer per commit); retention writes it in the
    transaction that deletes frames, so pruning (even of every frame) never resets ``seq``.  ``pruned_below`` says that every
    frame with ``seq <= pruned_below`` has been deleted by retention; the retained log of an
    instance is always the contiguous range ``pruned_below+1 .. last_seq``.

    ``frames(iid, seq, ts, channel, session_id, type, msg_id, reply_to, payload, append_id, ends_turn)``,
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
    * ``frames_by_append_id (iid, append_id) WHERE append_id IS NOT NULL``, unique — the frame a
      guest appended with an ``append_id`` (``append_once``: a resend finds it and stores
      nothing). The nullable ``append_id`` column and this index are added to a store file made
      before them when the server opens it (``ALTER TABLE … ADD COLUMN``, then ``CREATE UNIQUE
      INDEX IF NOT EXISTS``: the column is NULL in every old frame, so the index is built at once).
    * ``frames_turn_ends (iid, ends_turn) WHERE ends_turn IS NOT NULL``, unique — one end per
      message's turn (``TurnEnded``): ``ends_turn`` is the msg_id a turn end (``TURN_END_TYPES``)
      replies to, NULL in every other frame. A store file made before it gets the column, filled
      on the first end of each turn only (``first_turn_ends_sql``: a log may hold a second end
      stored before), and then the index, when the server opens it.
    * ``frames_session_records (session_id, channel, iid, seq) WHERE type = 'session_record'``
      — the instances whose log records a session (``session_records``), across instances in
      one query: it holds the server's session records only, a few per session.  Added to a
      store file made before it when the server opens it (``CREATE INDEX IF NOT EXISTS``: one
      pass over the frames, once).
    * ``frames_session_owners (session_id, channel, json_extract(payload, '$.owner'), iid) WHERE
      type = 'session_record'`` — the instances where a given owner recorded a session
      (``session_records(..., owner=…)``), whatever other callers recorded under the same id.
      Added the same way.

    The plan for each filter combination is pinned with ``INDEXED BY`` (a missing index is an
    error, not a silent full scan); :meth:`FrameStore.query_plan` shows it, and the tests
    check it with ``EXPLAIN QUERY PLAN``.  Residual filters (``types`` together with a
    session, ``channel`` alone) are checked row by row during the scan; ``channel`` without
    ``session_id`` uses the primary key.

    ``hash`` (BLOB) is the frame's link of its instance's hash chain (``chain.py``): the single
    writer hands it out with the seq (``_heads``, the chain's head per instance, read once from the
    file); NULL in frames stored before the chain (the column is added to an older file on open).
    ``checkpoints(iid, seq, hash, ts, reason, signature)`` — the chain's hash after a seq: where
    retention deletes (in its transaction), every ``checkpoint_every`` frames, and on demand.

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

import collections
import json
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from protocol.frames import FRAME_VERSION, Frame, SessionRef

from .api import (
    DECLARATION_KEY,
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_LIMIT,
    DEFAULT_PRUNE_EVERY,
    DEFAULT_RETENTION_FRAMES,
    MAX_LIMIT,
    MAX_RECORDED_INSTANCES,
    MAX_SEQ,
    OWNER_KEY,
    SESSION_RECORD,
    CursorPruned,
    FrameAppends,
    FrameQuery,
    RecordedSession,
    StoreDamaged,
    StoreUnavailable,
    TURN_ENDS_INDEX,
    TurnEnded,
    check_checkpoint_every,
    check_cursor_args,
    check_retention,
    check_timeout,
    ended_turns,
    ends_turn,
    first_turn_ends_sql,
    format_ts,
    retention_cut,
)
from .api import make_frame as _frame
from .chain import DEMAND, EVERY, GENESIS, RETENTION, ChainedFrame, Checkpoint, content_digest, link

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_PRUNE_EVERY",
    "DEFAULT_RETENTION_FRAMES",
    "MAX_LIMIT",
    "MAX_SEQ",
    "CursorPruned",
    "FrameQuery",
    "FrameStore",
    "format_ts",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: How many resolved requests `append_outcome` remembers (older ones ended long before).
OUTCOME_MEMORY = 100_000

# A ``types`` filter with more distinct types than this is not split into one index scan per
# type; it is checked row by row along the primary key instead.
_MAX_TYPE_UNION = 16

# --------------------------------------------------------------------------------------------
# The store

_SCHEMA = f"""
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
    append_id  TEXT,
    ends_turn  TEXT,
    hash       BLOB,
    PRIMARY KEY (iid, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS frames_by_session ON frames (iid, session_id, channel, seq);
CREATE INDEX IF NOT EXISTS frames_by_type ON frames (iid, type, seq);
CREATE INDEX IF NOT EXISTS frames_by_reply ON frames (iid, reply_to, seq) WHERE reply_to IS NOT NULL;
CREATE INDEX IF NOT EXISTS frames_session_records ON frames (session_id, channel, iid, seq)
    WHERE type = '{SESSION_RECORD}';
CREATE INDEX IF NOT EXISTS frames_session_owners ON frames (session_id, channel, json_extract(payload, '$.{OWNER_KEY}'), iid)
    WHERE type = '{SESSION_RECORD}';
CREATE TABLE IF NOT EXISTS checkpoints (
    iid       INTEGER NOT NULL,
    seq       INTEGER NOT NULL,
    hash      BLOB    NOT NULL,
    ts        TEXT    NOT NULL,
    reason    TEXT    NOT NULL,
    signature BLOB,
    PRIMARY KEY (iid, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS cursors (
    instance TEXT    NOT NULL,
    name     TEXT    NOT NULL,
    seq      INTEGER NOT NULL,
    PRIMARY KEY (instance, name)
) WITHOUT ROWID;
"""

_COLS = "seq, ts, channel, session_id, type, msg_id, reply_to, payload"

# `append_once`'s index: one frame per (instance, append_id). Made after the column, which a store
# file made before it gets when the server opens it (`_setup`).
_APPEND_ID_INDEX = (
    "CREATE UNIQUE INDEX IF NOT EXISTS frames_by_append_id ON frames (iid, append_id) WHERE append_id IS NOT NULL"
)
_FRAME_OF_APPEND_ID = (
    f"SELECT {_COLS} FROM frames INDEXED BY frames_by_append_id WHERE iid = ? AND append_id = ? AND append_id IS NOT NULL"
)
# One end per message's turn (`TurnEnded`): made after the column and its backfill (`_setup`).
_TURN_ENDS_UNIQUE = (
    f"CREATE UNIQUE INDEX IF NOT EXISTS {TURN_ENDS_INDEX} ON frames (iid, ends_turn) WHERE ends_turn IS NOT NULL"
)
_END_OF_TURN = (
    f"SELECT {_COLS} FROM frames INDEXED BY {TURN_ENDS_INDEX} WHERE iid = ? AND ends_turn = ? AND ends_turn IS NOT NULL"
)

# The records of one session in one instance, along `frames_session_records` (the type is written
# out, not bound: SQLite uses a partial index only for a query whose WHERE names its condition).
_RECORDS_OF = (
    "FROM frames f INDEXED BY frames_session_records WHERE f.session_id = :sid AND f.channel = :ch "
    f"AND f.type = '{SESSION_RECORD}' AND f.iid = r.iid"
)
_FIRST_OWNER = (
    f"(SELECT json_extract(f.payload, '$.{OWNER_KEY}') {_RECORDS_OF} "
    f"AND json_type(f.payload, '$.{OWNER_KEY}') = 'text' ORDER BY f.seq LIMIT 1)"
)
_LAST_DECLARATION = (
    f"(SELECT json_extract(f.payload, '$.{DECLARATION_KEY}') {_RECORDS_OF} "
    f"AND json_type(f.payload, '$.{DECLARATION_KEY}') = 'object' ORDER BY f.seq DESC LIMIT 1)"
)
#: `FrameStore.session_records`: the first `:limit` instances (by name, as `instances()` sorts them;
#: only `:inst` when it is not NULL) with a record of the session, each with its first owner and
#: its last declaration.
SESSION_RECORDS_SQL = (
    f"SELECT r.name, {_FIRST_OWNER}, {_LAST_DECLARATION} "
    f"FROM (SELECT DISTINCT i.iid, i.name FROM frames INDEXED BY frames_session_records JOIN instances i "
    f"ON i.iid = frames.iid WHERE session_id = :sid AND channel = :ch AND type = '{SESSION_RECORD}' "
    f"AND (:inst IS NULL OR i.name = :inst) "
    f"ORDER BY i.name LIMIT :limit) r ORDER BY r.name"
)
#: `FrameStore.session_records(..., owner=…)`: the same, of the instances whose first owner is
#: `:owner`, found along `frames_session_owners` (the instances where it recorded the session),
#: so what other callers recorded under the id takes none of the `:limit` places.
OWNED_SESSION_RECORDS_SQL = (
    f"SELECT r.name, r.owner, {_LAST_DECLARATION} FROM ("
    f"SELECT r.iid, r.name, {_FIRST_OWNER} AS owner FROM (SELECT DISTINCT iid FROM frames "
    f"INDEXED BY frames_session_owners WHERE session_id = :sid AND channel = :ch AND type = '{SESSION_RECORD}' "
    f"AND json_extract(payload, '$.{OWNER_KEY}') = :owner) m JOIN instances r ON r.iid = m.iid "
    f"WHERE (:inst IS NULL OR r.name = :inst) AND owner = :owner ORDER BY r.name LIMIT :limit) r ORDER BY r.name"
)

_INSERT_FRAME = (
    "INSERT INTO frames (iid, seq, ts, channel, session_id, type, msg_id, reply_to, payload, append_id, ends_turn, hash) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# A checkpoint (`chain.Checkpoint`): a second one at the same seq only adds a signature the first lacked.
_INSERT_CHECKPOINT = (
    "INSERT INTO checkpoints (iid, seq, hash, ts, reason, signature) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (iid, seq) DO UPDATE SET signature = excluded.signature WHERE checkpoints.signature IS NULL"
)
# A new instance's row, created in the transaction of its first frames.
_NEW_INSTANCE = "INSERT INTO instances (name, last_seq, pruned_below) VALUES (?, 0, 0)"

_DURABILITY = {"normal": "NORMAL", "full": "FULL"}


class FrameStore(FrameAppends):
    """The tether log of every instance, in one SQLite database (see the module docstring).

    Use it from one Trio thread.  It implements :class:`api.FrameStoreAPI`: every method
    that reads or writes the database is async (a Trio checkpoint) although its SQLite work
    runs right on the Trio thread in microseconds; ``close``, ``query_plan`` and
    ``waiter_count`` stay synchronous."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention_frames: int | None = DEFAULT_RETENTION_FRAMES,
        retention_seconds: float | None = None,
        durability: str = "normal",
        prune_every: int = DEFAULT_PRUNE_EVERY,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
        checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
        sign: Callable[[bytes], bytes] | None = None,
    ) -> None:
        check_retention(retention_frames, retention_seconds, prune_every)
        check_checkpoint_every(checkpoint_every)
        self.checkpoint_every = checkpoint_every
        self._sign = sign
        if durability not in _DURABILITY:
            raise ValueError(f"durability must be one of {sorted(_DURABILITY)}, got {durability!r}")
        self.retention_frames = retention_frames
        self.retention_seconds = retention_seconds
        self.durability = durability
        self.prune_every = prune_every
        self._clock = clock

        spath = os.fspath(path)
        self.path = spath
        self.read_only = read_only
        """Another process's view of a store its server writes (see `reader`)."""
        if read_only:
            if not Path(spath).is_file():
                raise OSError(f"there is no frame store at {spath}")
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                Path(spath).absolute().as_uri() + "?mode=ro", uri=True, isolation_level=None,
            )
        else:
            if spath != ":memory:" and not spath.startswith("file:"):
                _prepare_file(Path(spath))
            self._conn = sqlite3.connect(spath, isolation_level=None)
        try:
            self._setup()
        except sqlite3.DatabaseError as exc:  # one line for the operator, naming the file, not a traceback
            self._conn.close()
            self._conn = None
            if isinstance(exc, sqlite3.OperationalError):  # locked, unreadable: not the file's content
                raise OSError(f"cannot use the frame store {spath}: {exc}") from None
            raise StoreDamaged(spath, str(exc)) from None
        except BaseException:
            self._conn.close()
            self._conn = None
            raise

        self._iids: dict[str, int] = {}
        # Per instance: the highest seq handed out, and the highest committed (see "Group commit").
        self._assigned: dict[str, int] = {}
        self._committed: dict[str, int] = {}
        # Per instance: the chain hash after its highest assigned seq (`chain.py`), read once.
        self._heads: dict[str, bytes] = {}
        self._appends_since_checkpoint: dict[str, int] = {}
        self._group: _Group | None = None
        self._appends_since_prune: dict[str, int] = {}
        # The rows the last commit stored, per instance a long poll waits on (see `_just_committed`).
        self._fresh: dict[str, list[tuple]] = {}
        FrameAppends.__init__(self)
        # (instance, request_id) of the outcomes `append_outcome` recorded, newest last (bounded).
        self._outcomes: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        # (instance, append_id) of the `append_once` calls between their check and their commit.
        self._once_in_flight: dict[tuple[str, str], trio.Event] = {}
        # (instance, msg_id) of the turn ends between their check and their commit.
        self._ends_in_flight: dict[tuple[str, str], trio.Event] = {}
        if read_only:
            return
        try:
            self._prune_all()  # reads every instance's oldest frames: a damaged table shows here too
        except sqlite3.DatabaseError as exc:
            self.close()
            if isinstance(exc, sqlite3.OperationalError):
                raise OSError(f"cannot use the frame store {spath}: {exc}") from None
            raise StoreDamaged(spath, str(exc)) from None

    @classmethod
    def reader(cls, path: str | os.PathLike[str]) -> FrameStore:
        """A read-only view of the store at `path` for another process (`oubliette-server status`,
        `tail`) while its server writes it: WAL lets readers run beside the writer. It writes
        nothing (no schema, no retention), reads each instance's last seq from the file on
        every query (the server's appends are not known here otherwise), and its long polls
        are woken by nobody: they wait their whole timeout, then query again."""
        return cls(path, retention_frames=None, read_only=True)

    def backup_to(self, target: str | os.PathLike[str]) -> None:
        """Copy this store, as of one commit, to the new file `target` (mode 0600), while its
        server goes on writing it (`oubliette-server backup`, docs/DEPLOY.md).

        Why not `cp`: a copy of a live store's file and its `-wal` can catch a commit half-way.
        SQLite's online backup copies every page in one step, inside one read transaction, and
        WAL lets the server keep committing meanwhile: the copy is one consistent snapshot.
        Raises `FileExistsError` if `target` exists.
        """
        target = Path(target)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        copy = sqlite3.connect(target, isolation_level=None)
        try:
            self._db.backup(copy)  # pages=-1: every page in one step, so one snapshot
        finally:
            copy.close()

    @classmethod
    def in_memory(cls, **kw: Any) -> FrameStore:
        """A store that lives in RAM only (for tests)."""
        return cls(":memory:", **kw)

    # -- setup ---------------------------------------------------------------------------

    def _setup(self) -> None:
        db = self._db
        db.execute("PRAGMA busy_timeout=5000")
        if self.read_only:
            if db.execute("PRAGMA user_version").fetchone()[0] > SCHEMA_VERSION:
                raise RuntimeError(f"frame store {self.path!r} has a newer schema than this program knows")
            return
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={_DURABILITY[self.durability]}")
        db.execute("PRAGMA temp_store=MEMORY")
        # 8 MiB of page cache: the pages a log reads again are its newest (long polls, SSE, a
        # session's recent frames), which this holds many times over. It is filled once and then
        # stays that size, so it is part of the server's steady memory (bench/soak.py --duration:
        # at 32 MiB it took a busy server 40 minutes to reach its plateau, which looked like a leak).
        db.execute("PRAGMA cache_size=-8192")
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
            columns = {row[1] for row in db.execute("PRAGMA table_info(frames)")}
            if "append_id" not in columns:
                db.execute("ALTER TABLE frames ADD COLUMN append_id TEXT")  # a file made before append_once
            db.execute(_APPEND_ID_INDEX)
            if "ends_turn" not in columns:  # a file made before one turn end per message
                db.execute("ALTER TABLE frames ADD COLUMN ends_turn TEXT")
                db.execute(first_turn_ends_sql("iid"))
            db.execute(_TURN_ENDS_UNIQUE)
            if "hash" not in columns:  # a file made before the hash chain: its frames stay without one
                db.execute("ALTER TABLE frames ADD COLUMN hash BLOB")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the frame store is closed")
        return self._conn

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def describe(self) -> str:
        """`sqlite:PATH` (for /v1/health and logs)."""
        return f"sqlite:{self.path}"

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Nothing runs in the background (every call is on the Trio thread); close on exit."""
        try:
            yield
        finally:
            self.close()

    @property
    def shared(self) -> bool:
        """False: one server process owns a SQLite store file."""
        return False

    async def shared_secret(self, candidate: bytes) -> bytes | None:
        """None: one server per SQLite file, whose secret stays in its data directory."""
        await trio.lowlevel.checkpoint()
        return None

    async def check_available(self, timeout: float) -> None:
        """The database file answers a query (`StoreUnavailable` if not): on the Trio thread, it
        cannot hang on a peer, so `timeout` is not needed."""
        await trio.lowlevel.checkpoint()
        try:
            self._db.execute("SELECT 1").fetchone()
        except (sqlite3.Error, RuntimeError) as exc:
            raise StoreUnavailable(f"the SQLite store {self.describe()} is unavailable: {exc}") from None

    async def aclose(self) -> None:
        """`close`, as the async interface has it."""
        self.close()
        await trio.lowlevel.checkpoint()

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

    async def instances(self) -> list[str]:
        """Names of every instance that has ever had a frame appended, sorted."""
        return await _on_loop(lambda: [r[0] for r in self._db.execute("SELECT name FROM instances ORDER BY name")])

    async def last_seq(self, instance: str) -> int:
        """The highest seq ever committed for ``instance`` (0 if none)."""
        return await _on_loop(self._committed_seq, instance)

    def _committed_seq(self, instance: str) -> int:
        """The highest committed seq of ``instance``, read from the file once, then kept in memory."""
        last = self._committed.get(instance)
        if last is None or self.read_only:
            row = self._db.execute("SELECT iid, last_seq FROM instances WHERE name = ?", (instance,)).fetchone()
            if row is None:
                return 0  # not cached: the instance's first commit creates it
            iid, last = row
            top = self._db.execute("SELECT MAX(seq) FROM frames WHERE iid = ?", (iid,)).fetchone()[0]
            last = max(last, top or 0)
            self._iids[instance] = iid
            self._committed[instance] = self._assigned[instance] = last
        return last

    async def pruned_below(self, instance: str) -> int:
        """Every frame of ``instance`` with ``seq <=`` this has been deleted by retention (0 if
        none).  Reading from ``after_seq = pruned_below(instance)`` never raises
        :class:`CursorPruned` (until retention runs again)."""
        def read() -> int:
            row = self._db.execute("SELECT pruned_below FROM instances WHERE name = ?", (instance,)).fetchone()
            return 0 if row is None else row[0]
        return await _on_loop(read)

    # -- append --------------------------------------------------------------------------

    async def _append_claimed(self, instance: str, request_id: str, prepared: list[tuple]) -> Frame | None:
        """This process is the only writer of its log, so the claim is kept in memory (the last
        `OUTCOME_MEMORY` requests), taken before the append and given back if the append fails."""
        key = (instance, request_id)
        if key in self._outcomes:
            await trio.lowlevel.checkpoint()
            return None
        self._outcomes[key] = None
        try:
            frame = (await self._append(instance, prepared))[0]
        except BaseException:
            self._outcomes.pop(key, None)
            raise
        while len(self._outcomes) > OUTCOME_MEMORY:
            self._outcomes.popitem(last=False)
        return frame

    async def _append_once(self, instance: str, prepared: tuple) -> tuple[Frame, bool]:
        """This process is the only writer of its log: the frame of the id is looked up and, if
        there is none, its append is handed a seq with no checkpoint between. An append of the
        same id still in its group commit is waited for first (it may yet fail)."""
        key = (instance, prepared[-1])
        while (pending := self._once_in_flight.get(key)) is not None:
            await pending.wait()
        stored = self._frame_of_append_id(instance, prepared[-1])
        if stored is not None:
            await trio.lowlevel.checkpoint()  # nothing was stored: a cancellation here loses nothing
            return stored, False
        done = self._once_in_flight[key] = trio.Event()
        try:
            return (await self._append(instance, [prepared]))[0], True
        finally:
            del self._once_in_flight[key]
            done.set()

    async def frame_of_append_id(self, instance: str, append_id: str) -> Frame | None:
        """The frame of `instance` stored with `append_id`, or None (along `frames_by_append_id`)."""
        return await _on_loop(self._frame_of_append_id, instance, append_id)

    def _frame_of_append_id(self, instance: str, append_id: str) -> Frame | None:
        return self._one_frame(_FRAME_OF_APPEND_ID, instance, append_id)

    def _end_of_turn(self, instance: str, msg_id: str) -> Frame | None:
        """The stored end of the turn of `msg_id` (along the unique index), or None."""
        return self._one_frame(_END_OF_TURN, instance, msg_id)

    def _one_frame(self, sql: str, instance: str, key: str) -> Frame | None:
        """The frame of `instance` that `sql` (by iid and a key, along a unique index) finds, or None."""
        iid = self._iid(instance) if isinstance(instance, str) else None
        row = None if iid is None else self._db.execute(sql, (iid, key)).fetchone()
        if row is None:
            return None
        seq, ts, ch, sid, typ, mid, rt, payload = row
        return _frame(seq, ts, instance, ch, sid, typ, mid, rt, json.loads(payload))

    async def _append(self, instance: str, prepared: list[tuple]) -> list[Frame]:
        if not isinstance(instance, str) or not instance:
            raise ValueError(f"instance must be a non-empty string, got {instance!r}")
        ends = ended_turns(prepared)
        if ends:
            return await self._append_turn_ends(instance, prepared, ends)
        return await self._append_now(instance, prepared)

    async def _append_turn_ends(self, instance: str, prepared: list[tuple], ends: list[str]) -> list[Frame]:
        """The append of frames ending the turns of `ends`: this process is the only writer of its
        log, so each turn's stored end is looked up and, if there is none, the append is handed
        its seq with no checkpoint between (`TurnEnded` otherwise; the unique index is the last
        line). An end of the same turn still in its group commit is waited for first (it may fail)."""
        keys = [(instance, msg_id) for msg_id in ends]
        while (pending := next((self._ends_in_flight[k] for k in keys if k in self._ends_in_flight), None)) is not None:
            await pending.wait()
        for msg_id in ends:
            stored = self._end_of_turn(instance, msg_id)
            if stored is not None:
                await trio.lowlevel.checkpoint()  # nothing was stored: a cancellation here loses nothing
                raise TurnEnded(stored)
        done = trio.Event()
        for key in keys:
            self._ends_in_flight[key] = done
        try:
            return await self._append_now(instance, prepared)
        finally:
            for key in keys:
                del self._ends_in_flight[key]
            done.set()

    async def _append_now(self, instance: str, prepared: list[tuple]) -> list[Frame]:
        """Hand out the seqs and join (or lead) a group commit."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not prepared:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        if self._conn is None:  # a closed store refuses before a seq is handed out
            raise RuntimeError("the frame store is closed")
        last = self._assigned.get(instance)
        if last is None or self.read_only:
            last = self._committed_seq(instance)
        first = last + 1
        ts = format_ts(self._clock())
        head = self._heads.get(instance)
        if head is None:
            head = self._heads[instance] = self._stored_head(instance, last)
        hashes = []
        for i, (ch, sid, typ, mid, rt, _, obj, _) in enumerate(prepared):
            head = link(head, first + i, content_digest(instance, ts, ch, sid, typ, mid, rt, obj))
            hashes.append(head)
        base_head = self._heads[instance]
        self._heads[instance] = head
        self._assigned[instance] = last + len(prepared)
        part = (instance, first, ts, prepared, hashes)
        group = self._group
        if group is None:
            group = self._group = _Group(instance, last, base_head, part)
            # Let the appends of other ready tasks join this commit (the one schedule point of
            # an append); nothing may stop it now (the others wait for it, shielded).
            try:
                await trio.lowlevel.cancel_shielded_checkpoint()
            finally:
                self._group = None
                self._commit(group)
        else:
            if instance not in group.base:
                group.base[instance] = (last, base_head)
            group.parts.append(part)
            if group.done is None:
                group.done = trio.Event()
            with trio.CancelScope(shield=True):
                await group.done.wait()
        if group.error is not None:
            raise group.error
        # The frames as stored, built straight from the checked fields (prepare_frame checked
        # them; the payload is already the caller's private copy): no second validation.
        return [
            Frame(
                v=FRAME_VERSION, seq=first + i, ts=ts, instance=instance, session=SessionRef(channel=ch, id=sid),
                type=typ, msg_id=mid, reply_to=rt, payload=obj,
            )
            for i, (ch, sid, typ, mid, rt, _, obj, _) in enumerate(prepared)
        ]

    def _commit(self, group: _Group) -> None:
        """Store a group's frames in one transaction, then wake waiters and apply retention;
        on failure, hand the group's seqs out again.  Sets ``group.done`` (when an append joined) either way."""
        created: list[str] = []
        parts = group.parts
        try:
            db = self._db
            iids = self._iids
            if len(parts) == 1 and len(parts[0][3]) == 1 and parts[0][0] in iids:
                # A lone frame of a known instance: one INSERT in autocommit mode is its own
                # transaction (SQLite commits it before execute returns, or rolls it back and
                # raises), with the same durability as BEGIN/INSERT/COMMIT at a third of the calls.
                instance, first, ts, ((ch, sid, typ, mid, rt, text, _, aid),), (hash,) = parts[0]
                db.execute(_INSERT_FRAME, (
                    iids[instance], first, ts, ch, sid, typ, mid, rt, text, aid, ends_turn(typ, rt), hash,
                ))
            else:
                self._commit_transaction(db, parts, group.base, created)
        except BaseException as exc:
            for instance, (base, base_head) in group.base.items():
                self._assigned[instance] = base
                self._heads[instance] = base_head
            for instance in created:
                del self._iids[instance]
            if isinstance(exc, sqlite3.OperationalError):  # a full disk, an I/O error, a lock held elsewhere
                group.error = StoreUnavailable(f"the SQLite store {self.path} could not store the frame: {exc}")
                group.error.__cause__ = exc
            else:
                group.error = exc
            if group.done is not None:
                group.done.set()
            return
        if group.done is not None:
            group.done.set()
        self._keep_fresh(parts)
        if len(parts) == 1:
            self._committed_frames(parts[0][0], len(parts[0][3]))
            return
        added: dict[str, int] = {}
        for instance, _, _, prepared, _ in parts:
            added[instance] = added.get(instance, 0) + len(prepared)
        for instance, count in added.items():
            self._committed_frames(instance, count)

    def _keep_fresh(self, parts: list[_Part]) -> None:
        """Keep the rows this commit stored for the instances a long poll waits on (the last commit's
        only), so that a waiter it wakes takes them from memory instead of reading them back."""
        fresh: dict[str, list[tuple]] = {}
        waited = self._waiters
        for instance, first, ts, prepared, _ in parts:
            if instance in waited:
                rows = fresh.setdefault(instance, [])
                rows.extend((first + i, ts, ch, sid, typ, mid, rt, text) for i, (ch, sid, typ, mid, rt, text, _, _) in enumerate(prepared))
        self._fresh = fresh

    def _just_committed(self, instance: str, q: FrameQuery, seen: int, last: int) -> list[Frame] | None:
        """The frames matching `q` among seqs `seen`+1..`last`, when the last commit stored exactly
        those (the rows `_keep_fresh` kept, matched by `FrameQuery.matches`, the rule the SQL
        applies); None otherwise, and the log is read."""
        rows = self._fresh.get(instance)
        if not rows or rows[0][0] != seen + 1 or rows[-1][0] != last:
            return None
        loads = json.loads
        return [
            _frame(seq, ts, instance, ch, sid, typ, mid, rt, loads(text))
            for seq, ts, ch, sid, typ, mid, rt, text in rows
            if seq > q.after_seq and q.matches(ch, sid, typ, rt)
        ][: q.limit]

    def _read_after(self, instance: str, q: FrameQuery, seen: int, last: int, read_if_none: bool) -> list[Frame]:
        """The frames matching `q`, where those up to `seen` are known not to match (`last`: the
        committed head): none when nothing was committed after `seen` since the waiter's last look,
        the last commit's rows when it stored every frame after `seen`, else from the log. With
        `read_if_none` (a long poll's first look, and a look after a wake of every waiter, a store's
        fault: `_wake_all`) a look that finds nothing reads the log all the same, so a poll started
        while the store is down, or woken by its fault, meets the fault at once; a look after an
        append's wake takes the rows' "none match" as the answer (that commit just succeeded)."""
        if read_if_none:
            frames = self._just_committed(instance, q, seen, last) if last > seen else None
            return frames or self._query(instance, q)
        if last <= seen:
            return []
        frames = self._just_committed(instance, q, seen, last)
        return self._query(instance, q) if frames is None else frames

    def _committed_frames(self, instance: str, count: int) -> None:
        """After a commit of ``count`` frames of ``instance``: move its committed seq, wake its
        waiters, and apply retention every ``prune_every`` frames."""
        assigned = self._assigned[instance]
        if self._committed.get(instance, 0) < assigned:
            self._committed[instance] = assigned
        rows = self._fresh.get(instance)
        if rows and rows[-1][0] - rows[0][0] + 1 == len(rows):  # the commit's frames, each kept: who wants them
            self._wake_for(instance, rows[0][0], [(ch, sid, typ, rt) for _, _, ch, sid, typ, _, rt, _ in rows])
        else:
            self._wake_instance(instance)
        if self.checkpoint_every is not None:
            since = self._appends_since_checkpoint.get(instance, 0) + count
            if since >= self.checkpoint_every:
                since = 0
                try:
                    self._checkpoint_head(instance, EVERY)
                except sqlite3.Error:
                    log.exception("frame store: the checkpoint of instance %r failed", instance)
            self._appends_since_checkpoint[instance] = since
        count += self._appends_since_prune.get(instance, 0)
        if count >= self.prune_every:
            self._appends_since_prune[instance] = 0
            try:
                self._prune_instance(instance, self._iids[instance])
            except sqlite3.Error:
                # The frames are committed; retention will be retried next time.
                log.exception("frame store: retention for instance %r failed", instance)
        else:
            self._appends_since_prune[instance] = count

    def _commit_transaction(
        self, db: sqlite3.Connection, parts: list[_Part], base: dict[str, tuple[int, bytes]], created: list[str],
    ) -> None:
        """Store several frames (or a new instance's first) in one explicit transaction; the
        instances it creates are added to ``created`` (to forget again if the commit fails)."""
        # A deferred BEGIN: this process is the only writer, so the write lock is free.
        db.execute("BEGIN")
        try:
            iids = self._iids
            for instance in base:
                if instance not in iids:
                    rowid = db.execute(_NEW_INSTANCE, (instance,)).lastrowid
                    assert rowid is not None  # an INSERT's cursor always has one
                    iids[instance] = rowid
                    created.append(instance)
            db.executemany(_INSERT_FRAME, [
                (iids[instance], first + i, ts, ch, sid, typ, mid, rt, text, aid, ends_turn(typ, rt), hashes[i])
                for instance, first, ts, prepared, hashes in parts
                for i, (ch, sid, typ, mid, rt, text, _, aid) in enumerate(prepared)
            ])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    # -- the hash chain (chain.py) --------------------------------------------------------

    def _stored_head(self, instance: str, last: int) -> bytes:
        """The chain hash after seq `last` of `instance`, as stored: that frame's hash, else (every
        frame pruned) the checkpoint at it, else `GENESIS` (no frame yet, or one from before the chain)."""
        iid = self._iid(instance)
        if iid is None or last == 0:
            return GENESIS
        row = self._db.execute("SELECT hash FROM frames WHERE iid = ? AND seq = ?", (iid, last)).fetchone()
        if row is None:
            row = self._db.execute("SELECT hash FROM checkpoints WHERE iid = ? AND seq = ?", (iid, last)).fetchone()
        return GENESIS if row is None or row[0] is None else bytes(row[0])

    def _write_checkpoint(self, instance: str, iid: int, seq: int, reason: str) -> Checkpoint:
        """Store (signed, with a key) the checkpoint after the stored frame `seq` of `instance`."""
        row = self._db.execute("SELECT hash FROM frames WHERE iid = ? AND seq = ?", (iid, seq)).fetchone()
        head = GENESIS if row is None or row[0] is None else bytes(row[0])
        checkpoint = Checkpoint(instance, seq, head, format_ts(self._clock()), reason)
        if self._sign is not None:
            checkpoint = attrs.evolve(checkpoint, signature=self._sign(checkpoint.message()))
        self._db.execute(_INSERT_CHECKPOINT, (iid, seq, head, checkpoint.ts, reason, checkpoint.signature))
        return checkpoint

    def _checkpoint_head(self, instance: str, reason: str) -> Checkpoint | None:
        """A checkpoint after the instance's last stored frame (None: it has none)."""
        iid = self._iid(instance)
        if iid is None:
            return None
        row = self._db.execute("SELECT MAX(seq) FROM frames WHERE iid = ?", (iid,)).fetchone()
        if row is None or row[0] is None:
            return None
        with self._transaction():
            return self._write_checkpoint(instance, iid, row[0], reason)

    async def add_checkpoint(self, instance: str) -> Checkpoint | None:
        """Checkpoint the chain of `instance` after its last stored frame now (`audit checkpoint`),
        signed when the store has a key; None when the instance has no frame."""
        return await _on_loop(self._checkpoint_head, instance, DEMAND)

    async def checkpoints(self, instance: str) -> list[Checkpoint]:
        """Every checkpoint of `instance`, by seq."""
        def read() -> list[Checkpoint]:
            rows = self._db.execute(
                "SELECT c.seq, c.hash, c.ts, c.reason, c.signature FROM checkpoints c JOIN instances i ON i.iid = c.iid "
                "WHERE i.name = ? ORDER BY c.seq", (instance,),
            )
            return [
                Checkpoint(instance, seq, bytes(h), ts, reason, None if sig is None else bytes(sig))
                for seq, h, ts, reason, sig in rows
            ]
        return await _on_loop(read)

    async def chained_frames(self, instance: str, after_seq: int, limit: int) -> list[ChainedFrame]:
        """The stored frames of `instance` after `after_seq` (at most `limit`, by seq) with their
        hashes, as they are in the file (no `CursorPruned`: verify judges gaps itself)."""
        def read() -> list[ChainedFrame]:
            rows = self._db.execute(
                f"SELECT {_COLS}, f.hash FROM frames f JOIN instances i ON i.iid = f.iid "
                "WHERE i.name = ? AND f.seq > ? ORDER BY f.seq LIMIT ?", (instance, after_seq, limit),
            )
            return [
                ChainedFrame(_frame(seq, ts, instance, ch, sid, typ, mid, rt, json.loads(payload)),
                             None if h is None else bytes(h))
                for seq, ts, ch, sid, typ, mid, rt, payload, h in rows
            ]
        return await _on_loop(read)

    async def chain_head(self, instance: str) -> bytes | None:
        """None: SQLite keeps no head apart from the frames (the last frame's hash is the head)."""
        await trio.lowlevel.checkpoint()
        return None

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

    async def query(self, instance: str, q: FrameQuery) -> list[Frame]:
        """Frames of ``instance`` matching ``q``, by seq ascending, at most ``q.limit``.

        Raises :class:`CursorPruned` if ``q.after_seq`` is below the retained log (frames
        after it were deleted by retention).  An unknown instance has no frames."""
        return await _on_loop(self._query, instance, q)

    def _query(self, instance: str, q: FrameQuery) -> list[Frame]:
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

    async def session_records(
        self, channel: str, session_id: str, limit: int = MAX_RECORDED_INSTANCES, instance: str | None = None,
        owner: str | None = None,
    ) -> list[RecordedSession]:
        """The instances (at most `limit`, the first by name) whose log holds a `session_record` of the
        session (with `owner`: whose first owner is `owner`), with the owner and last declaration each
        records: one query along `frames_session_records` (`frames_session_owners`; see "Schema")."""
        sql = SESSION_RECORDS_SQL if owner is None else OWNED_SESSION_RECORDS_SQL

        def read() -> list[RecordedSession]:
            rows = self._db.execute(sql, {"sid": session_id, "ch": channel, "limit": limit, "inst": instance, "owner": owner})
            return [
                RecordedSession(name, owner, None if declared is None else json.loads(declared))
                for name, owner, declared in rows
            ]
        return await _on_loop(read)

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
        check_timeout(timeout)
        await trio.lowlevel.checkpoint_if_cancelled()
        # No await between reading last_seq and querying: no append can slip in between, so
        # every frame with seq <= seen has been examined.
        seen = self._committed_seq(instance)
        frames = self._read_after(instance, q, q.after_seq, seen, read_if_none=True)
        if frames or timeout == 0:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return frames, False
        deadline = trio.current_time() + timeout
        with self._waiting(instance, q, seen) as parked:
            while True:
                if seen > q.after_seq:
                    # Frames up to ``seen`` did not match and never will (frames are
                    # immutable), so only look at newer ones.
                    q = attrs.evolve(q, after_seq=seen)
                woken_all = self._woken_all
                timed_out = await self._woken_by(parked.armed(), deadline)
                # An append of frames it does not want moved it past them without a wake (`_wake_for`).
                seen = max(seen, parked.seen or 0)
                last = self._committed_seq(instance)
                # Woken with every waiter (a store's fault): read the log, and meet the fault at once.
                frames = self._read_after(instance, q, seen, last, read_if_none=woken_all != self._woken_all)
                seen = parked.seen = last
                if frames:
                    return frames, False
                if timed_out:
                    return [], True

    # -- named cursors -------------------------------------------------------------------

    async def get_cursor(self, instance: str, name: str) -> int:
        """The durable cursor ``name`` of ``instance`` (0 if never set)."""
        def read() -> int:
            row = self._db.execute(
                "SELECT seq FROM cursors WHERE instance = ? AND name = ?", (instance, name)
            ).fetchone()
            return 0 if row is None else row[0]
        return await _on_loop(read)

    async def set_cursor(self, instance: str, name: str, seq: int) -> None:
        """Set (and commit) the durable cursor ``name`` of ``instance``."""
        check_cursor_args(instance, name, seq)
        await _on_loop(self._write_cursor, instance, name, seq, "excluded.seq")

    async def advance_cursor(self, instance: str, name: str, seq: int) -> bool:
        """Move the cursor ``name`` forward to ``seq`` (never back), in one statement; True if it moved."""
        check_cursor_args(instance, name, seq)
        return await _on_loop(self._write_cursor, instance, name, seq, "max(seq, excluded.seq)") > 0

    def _write_cursor(self, instance: str, name: str, seq: int, new_seq: str) -> int:
        with self._transaction():
            return self._db.execute(
                "INSERT INTO cursors (instance, name, seq) VALUES (?, ?, ?) "
                f"ON CONFLICT (instance, name) DO UPDATE SET seq = {new_seq} WHERE {new_seq} != seq",
                (instance, name, seq),
            ).rowcount

    # -- retention -----------------------------------------------------------------------

    async def prune(self) -> int:
        """Apply retention to every instance now; return how many frames were deleted."""
        return await _on_loop(self._prune_all)

    def _prune_all(self) -> int:
        total = 0
        for instance, iid in self._db.execute("SELECT name, iid FROM instances").fetchall():
            total += self._prune_instance(instance, iid)
            self._appends_since_prune[instance] = 0
        return total

    def _prune_instance(self, instance: str, iid: int) -> int:
        if self.retention_frames is None and self.retention_seconds is None:
            return 0
        self._fresh.pop(instance, None)  # a waiter reads the log: it says which frames are left
        db = self._db
        last = self._committed_seq(instance)
        with self._transaction():
            (pruned,) = db.execute("SELECT pruned_below FROM instances WHERE iid = ?", (iid,)).fetchone()

            def first_young(after: int, oldest_ts: str) -> int | None:
                row = db.execute(
                    "SELECT seq FROM frames WHERE iid = ? AND seq > ? AND ts >= ? ORDER BY seq LIMIT 1",
                    (iid, after, oldest_ts),
                ).fetchone()
                return None if row is None else row[0]

            cut = retention_cut(pruned, last, self.retention_frames, self.retention_seconds, self._clock(), first_young)
            if cut <= pruned:
                return 0
            # The chain goes on across the gap: a checkpoint holds the hash of the last frame deleted.
            self._write_checkpoint(instance, iid, cut, RETENTION)
            deleted = db.execute("DELETE FROM frames WHERE iid = ? AND seq <= ?", (iid, cut)).rowcount
            # last_seq with the deletion: the frames that held the highest seq may be gone now.
            db.execute("UPDATE instances SET pruned_below = ?, last_seq = ? WHERE iid = ?", (cut, last, iid))
        if deleted:
            log.debug("frame store: pruned %d frames of instance %r (seq <= %d)", deleted, instance, cut)
        return deleted


#: One append of a group: instance, first seq, ts, the prepared frames and their chain hashes.
_Part = tuple[str, int, str, list[tuple], list[bytes]]


class _Group:
    """Appends committed together (see "Group commit"): their frames, the seq and chain head each
    instance had before them (to hand out again if the commit fails), and the commit's outcome.

    A plain slotted class (one is made per commit, on the append path) that the leader starts
    with its own append; ``done`` is made only when a second append joins (a lone append has
    nobody to wake)."""

    __slots__ = ("parts", "base", "done", "error")

    def __init__(self, instance: str, base: int, base_head: bytes, part: _Part) -> None:
        self.parts: list[_Part] = [part]
        self.base: dict[str, tuple[int, bytes]] = {instance: (base, base_head)}
        self.done: trio.Event | None = None
        self.error: BaseException | None = None


_T = TypeVar("_T")


async def _on_loop(work: Callable[..., _T], *args: Any) -> _T:
    """Run one short SQLite call on the Trio thread as a checkpoint: a cancellation is seen
    before the work starts, never after it is done (its result is not lost)."""
    await trio.lowlevel.checkpoint_if_cancelled()
    result = work(*args)
    await trio.lowlevel.cancel_shielded_checkpoint()
    return result


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
