"""The frame store on PostgreSQL: one log shared by several servers (docs/SCALING.md).

Same interface and promises as the SQLite store (`api.FrameStoreAPI`); what differs
is how they are kept.

Driver and threads
    psycopg 3's async API and asyncpg run on asyncio only, so the store uses psycopg in
    blocking mode with `psycopg_pool.ConnectionPool`, each call handed to a worker thread by
    `trio.to_thread.run_sync`, bounded by a `trio.CapacityLimiter` the size of the pool (a
    thread never waits for a connection another thread holds).  A call in a thread is not
    abandoned when its task is cancelled: an append that started is committed and reported.

Sequence
    `instances(name, last_seq, pruned_below)`: an append bumps its instance's row with
    `INSERT … ON CONFLICT DO UPDATE SET last_seq = last_seq + n RETURNING last_seq` in the same
    transaction as the frames' insert.  The row lock is held until commit, so seqs are
    gapless and in commit order: a reader resuming by `after_seq` never skips a frame that
    commits later with a smaller seq.  (A PostgreSQL SEQUENCE is not commit-ordered.)

Hash chain
    The same row keeps the instance's chain head (`last_hash`, migration 10): the single-frame
    statements advance it with the seq, `sha256(last_hash || seq || digest)` in SQL (the frame's
    content digest computed here, `chain.content_digest`), and store it as the frame's `hash`;
    several frames read it with the bump and write it back before commit. Under the row lock,
    so the chain is in commit order, per instance, with no lock across instances.

Wake-ups
    Each append sends `NOTIFY oubliette_frames, '<instance>\t<first seq>\t<last seq>\t<frames>'`
    (`notice_payload`: each whole frame, `notice_frames`, or past a bound the fields each frame is
    filtered on, bounded too) inside its transaction
    (delivered at commit, in commit order).  Each store object keeps one dedicated LISTEN
    connection, driven on the Trio thread without a worker:
    `trio.lowlevel.wait_readable(pgconn.socket)`, then `consume_input()` and drain `notifies()`.
    A notification only wakes the instance's waiters (when one's query may match a frame it
    names), which re-run their own query, and tells the hooks given to `hear_appends` (the
    server's log tail) which seqs, and which frames' fields, were committed; NOTIFY
    is a hint, not a log.  While the listener is disconnected notifications are lost, so on
    every reconnect (and on every failure) all waiters are woken to re-query by `after_seq`,
    and on every reconnect the hooks hear `missed()`.  Appends made through this store object
    wake its waiters directly as well; a waiter reads again only when a seq it was woken for may
    match its query (`_skip_known`: not a frame whose fields, known from this store's own append or
    named by the notice, show it does not), and a long poll that starts after frames all known
    so, none matching, waits without reading first; one whose matching frames are all known whole
    (this server's appends, and notices that carry whole frames) takes them from memory without
    reading (`_known_after`). What was heard is kept of the instances a long poll waits on here
    and of the last `KNOWN_AFTER_WAIT` whose waiters left (`_follows`), and forgotten when notices
    may have been lost, and at each retention cut (its NOTIFY names the instance alone).

Queries
    A query is one statement, so one snapshot: the instance's `last_seq` and `pruned_below`
    with the matching frames (a LATERAL join).  Frames deleted by retention show in that
    `pruned_below`, so a gap raises `CursorPruned` instead of being skipped; and every frame
    up to that `last_seq` is visible in it, so a long poll examines each frame once.

Outcomes
    `append_outcome` records the one outcome of a request (a caller tool call): a row in
    `resolutions` (primary key `(instance, request_id)`) is inserted `ON CONFLICT DO NOTHING`
    in the transaction of the outcome frame, so of two servers racing, the second one's insert
    waits for the first commit and then finds the row: nothing is written, it lost.

Turn ends
    A frame that ends a turn carries the msg_id it ends in `ends_turn`, under a unique index on
    (instance, `ends_turn`) (migration 8). Of two ends of one turn, from any path of any server,
    the second one's insert waits for the first's commit, then breaks the index: its statement
    rolls back (no seq spent) and the append raises `TurnEnded` with the stored end.

Schema and migrations
    Versioned migrations (`MIGRATIONS`) are applied at start in one transaction holding a
    transaction-scoped advisory lock, so several servers starting together apply each
    migration once; a database with a newer schema than this program knows is refused. Each
    version not recorded in `oubliette_schema` is applied, in order, even one below the newest
    recorded (migrations developed in parallel may be merged in either order).

Failures
    A database that cannot be reached gives `StoreUnavailable` with one clear line (at start,
    from `running()`; later, from the call that failed).  The pool replaces broken
    connections and the listener reconnects with backoff, so the store recovers by itself
    when the database returns.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import psycopg
import psycopg.conninfo
import psycopg_pool
import trio

from protocol.frames import Frame

from .api import (
    DECLARATION_KEY,
    MAX_RECORDED_INSTANCES,
    OWNER_KEY,
    SESSION_RECORD,
    AppendNoticeHook,
    FrameFields,
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_PRUNE_EVERY,
    DEFAULT_RETENTION_FRAMES,
    CursorPruned,
    FrameAppends,
    FrameQuery,
    RecordedSession,
    StoreUnavailable,
    TURN_ENDS_INDEX,
    TurnEnded,
    check_checkpoint_every,
    check_cursor_args,
    check_instance,
    check_retention,
    check_timeout,
    ended_turns,
    ends_turn,
    first_turn_ends_sql,
    format_ts,
    make_frame,
    retention_cut,
)
from .chain import DEMAND, EVERY, GENESIS, RETENTION, ChainedFrame, Checkpoint, content_digest, link
from .postgres_loop import LoopStatements

__all__ = ["MIGRATIONS", "NOTIFY_CHANNEL", "PostgresFrameStore", "safe_url"]

log = logging.getLogger(__name__)

#: Seconds between two of the connection pool's own warnings that reach the log (`PoolLogThrottle`).
POOL_LOG_INTERVAL = 30.0


class PoolLogThrottle(logging.Filter):
    """Keeps psycopg_pool's own warnings (logger `psycopg.pool`) to one line per `interval`.

    During a database outage the pool warns of every failed connection attempt, each message two
    lines long (libpq's hint on its own line): 20 per server per 9 s were seen. The first passes,
    on one line; the next passes `interval` seconds later saying how many were held back; the
    store's own `StoreUnavailable` lines already say what fails and what to do.
    """

    def __init__(self, interval: float = POOL_LOG_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        self._next = -math.inf
        self._held = 0
        self._lock = threading.Lock()  # the pool logs from its worker threads

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether `record` is written (flattened to one line), else counted until the next one is."""
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._held += 1
                return False
            held, self._next, self._held = self._held, now + self.interval, 0
        message = " ".join(record.getMessage().split())
        if held:
            message += f" ({held} more pool warning(s) in the last {self.interval:g} s not logged)"
        record.msg, record.args = message, None
        return True


def throttle_pool_log() -> None:
    """Install `PoolLogThrottle` on the pool's logger, once per process."""
    pool_log = logging.getLogger("psycopg.pool")
    if not any(isinstance(f, PoolLogThrottle) for f in pool_log.filters):
        pool_log.addFilter(PoolLogThrottle())

NOTIFY_CHANNEL = "oubliette_frames"
#: The advisory lock key that serialises migrations between servers ("oubliett" in ASCII).
MIGRATION_LOCK = 0x6F75626C69657474
#: Separates the instance and the seqs in a notification's payload (split from the right, so
#: the instance may hold anything).
NOTICE_SEPARATOR = "\t"


#: The longest list of frame fields a notice carries (JSON, in characters): a longer one is left out
#: (the waiters and the log tail then read, as for an older server's notice), so the payload stays
#: well under NOTIFY's 8000 bytes with the instance's name.
MAX_NOTICE_FIELDS = 2000
#: The longest list of whole frames a notice carries (JSON, in UTF-8 bytes): a longer one names the
#: fields alone (`MAX_NOTICE_FIELDS`), and a waiter that matches such a frame reads it.
MAX_NOTICE_FRAMES = 6000

#: What a notice tells of one frame beyond its fields: `(ts, msg_id, payload)`.
NoticeRest = tuple[str, str, dict[str, Any]]


def notice_fields(frames: Sequence[FrameFields]) -> str:
    """The end of a notice that names the filter fields of each frame it tells of: a tab and a JSON
    list of `[channel, session_id, type, reply_to]` (escaped: no tab in it), or "" past `MAX_NOTICE_FIELDS`."""
    text = json.dumps([list(fields) for fields in frames], separators=(",", ":"))
    return "" if len(text) > MAX_NOTICE_FIELDS else NOTICE_SEPARATOR + text


def notice_frames(prepared: Sequence[tuple], ts: str) -> str:
    """The end of the notice of an append of `prepared` frames at `ts`: a tab and a JSON list of each
    whole frame, `[channel, session_id, type, reply_to, ts, msg_id, payload]` (the payload the text
    stored, so a server that hears it holds the frame a read returns), up to `MAX_NOTICE_FRAMES`
    bytes; past that, the fields alone (`notice_fields`)."""
    text = "[" + ",".join(
        json.dumps([ch, sid, typ, rt, ts, mid], separators=(",", ":"))[:-1] + "," + stored + "]"
        for ch, sid, typ, mid, rt, stored, *_ in prepared) + "]"
    if len(text) <= MAX_NOTICE_FRAMES // 4 or len(text.encode()) <= MAX_NOTICE_FRAMES:
        return NOTICE_SEPARATOR + text
    return notice_fields([(ch, sid, typ, rt) for ch, sid, typ, _, rt, *_ in prepared])


def notice_payload(instance: str, first: int, last: int, frames: Sequence[FrameFields] = (), tail: str | None = None) -> str:
    """What an append of frames `first`..`last` of `instance` (with `frames`, their filter fields, or
    `tail`, `notice_frames`) sends with `NOTIFY oubliette_frames`."""
    if tail is None:
        tail = notice_fields(frames) if frames else ""
    return f"{instance}{NOTICE_SEPARATOR}{first}{NOTICE_SEPARATOR}{last}" + tail


def parse_notice(payload: str) -> tuple[str, int | None, int | None]:
    """`(instance, first, last)` of a notification; the seqs are None in a payload that is the
    instance alone (what an earlier version of the server sent)."""
    return read_notice(payload)[:3]


def read_notice(payload: str) -> tuple[str, int | None, int | None, list[FrameFields] | None]:
    """`parse_notice` and the frames' filter fields, one per seq (None when the notice names none:
    too many, or an earlier version's)."""
    return read_whole_notice(payload)[:4]


def read_whole_notice(
    payload: str,
) -> tuple[str, int | None, int | None, list[FrameFields] | None, list[NoticeRest] | None]:
    """`read_notice` and the rest of each whole frame it carries (`notice_frames`; None when it
    names the fields alone, or nothing)."""
    if payload.endswith("]"):
        parts = payload.rsplit(NOTICE_SEPARATOR, 3)
        if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit():
            first, last = int(parts[1]), int(parts[2])
            return (parts[0], first, last, *_frames_of(parts[3], last - first + 1))
    parts = payload.rsplit(NOTICE_SEPARATOR, 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return parts[0], int(parts[1]), int(parts[2]), None, None
    return payload, None, None, None, None


def _frames_of(text: str, count: int) -> tuple[list[FrameFields] | None, list[NoticeRest] | None]:
    """The `count` frames' fields of a notice's JSON list, and the rest of each when it carries whole
    frames; None for anything else."""
    try:
        listed = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(listed, list) or len(listed) != count:
        return None, None
    fields: list[FrameFields] = []
    rest: list[NoticeRest] | None = []
    for item in listed:
        if not (isinstance(item, list) and len(item) in (4, 7) and all(isinstance(v, str) for v in item[:3])
                and (item[3] is None or isinstance(item[3], str))):
            return None, None
        fields.append((item[0], item[1], item[2], item[3]))
        if rest is not None and len(item) == 7 and isinstance(item[4], str) and isinstance(item[5], str) \
                and isinstance(item[6], dict):
            rest.append((item[4], item[5], item[6]))
        else:
            rest = None
    return fields, rest


#: How many recent frames of an instance a store remembers the fields of for its waiters (`_skip_known`).
KNOWN_FRAMES_KEPT = 256
#: Of those, how many of the latest seqs of an instance it keeps whole (older ones by their fields:
#: a long poll that matches one reads it), so one instance's frames do not take `KNOWN_WHOLE_BYTES`.
KNOWN_WHOLE_KEPT = 128
#: The bytes of whole frames (their payload as stored) a store keeps, every instance together: past
#: it a frame is kept by its fields alone. With `MAX_NOTICE_FRAMES` a frame, what a peer appending
#: large frames to many instances can make every server hold.
KNOWN_WHOLE_BYTES = 8 * 1024 * 1024
#: How many instances whose last long poll here returned a store still follows (their notices
#: heard as a waited-on instance's, the most recently left kept): a waiter comes back soon (an
#: agent's next call, a caller's next long poll, an answer that lands here), and a store that
#: followed the instance without a break answers it from memory, where a break makes it read.
KNOWN_AFTER_WAIT = 64
#: Reconnect backoff of the LISTEN connection, seconds.
LISTEN_BACKOFF = (0.05, 2.0)
#: How long a long poll waits for a pooled connection before it reports the store unavailable.
FAIL_FAST_SECONDS = 2.0

#: `chain.GENESIS` as a PostgreSQL value.
_GENESIS_SQL = "'\\x" + GENESIS.hex() + "'::bytea"

#: (version, statements): applied in order, each once, recorded in `oubliette_schema`. A number
#: is never reused nor renumbered, since deployed databases record it: 4 was never released, so
#: the list (and `oubliette_schema`) goes 1, 2, 3, 5, … (docs/SCALING.md).
MIGRATIONS: list[tuple[int, str]] = [
    (1, """
CREATE TABLE instances (
    name         text   PRIMARY KEY,
    last_seq     bigint NOT NULL,
    pruned_below bigint NOT NULL DEFAULT 0
);
CREATE TABLE frames (
    instance   text   NOT NULL,
    seq        bigint NOT NULL,
    ts         text   NOT NULL,
    channel    text   NOT NULL,
    session_id text   NOT NULL,
    type       text   NOT NULL,
    msg_id     text   NOT NULL,
    reply_to   text,
    payload    text   NOT NULL,
    PRIMARY KEY (instance, seq)
);
CREATE INDEX frames_by_session ON frames (instance, session_id, channel, seq);
CREATE INDEX frames_by_type ON frames (instance, type, seq);
CREATE INDEX frames_by_reply ON frames (instance, reply_to, seq) WHERE reply_to IS NOT NULL;
CREATE TABLE cursors (
    instance text   NOT NULL,
    name     text   NOT NULL,
    seq      bigint NOT NULL,
    PRIMARY KEY (instance, name)
);
"""),
    (2, """
CREATE TABLE oubliette_secrets (
    name  text PRIMARY KEY,
    value text NOT NULL
);
"""),
    # One row per resolved request (`append_outcome`): its primary key lets exactly one outcome
    # win whichever servers race; `seq` is the winning frame's (retention deletes both).
    (3, """
CREATE TABLE resolutions (
    instance   text   NOT NULL,
    request_id text   NOT NULL,
    seq        bigint NOT NULL,
    PRIMARY KEY (instance, request_id)
);
"""),
    # Instance presence (docs/SCALING.md, "Instance leases"): which server holds an instance's
    # guest connection, until `expires_at` unless that server renews it; and each server's own
    # lease (is it alive: are the requests it waits on still waited on). Self-contained: it
    # depends on no other migration (a parallel branch adds version 4).
    (5, """
CREATE TABLE instance_leases (
    instance   text        PRIMARY KEY,
    server     text        NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE server_leases (
    server     text        PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
"""),
    # A session's records across instances (`session_records`, docs/SCALING.md, "Every server
    # knows every session"): a server learns a session it never held in one indexed query, not
    # one per instance. Partial: it holds the server's session records only, a few per session.
    # Built once by the first server of the new version (its CREATE INDEX reads every frame and
    # holds appends meanwhile: about 0.1 s over a million frames in cache, bench/bench_learn.py).
    (6, f"""
CREATE INDEX frames_session_records ON frames (session_id, channel, instance, seq)
    WHERE type = '{SESSION_RECORD}';
"""),
    # A guest's append stored once however often it is resent (`append_once`, docs/TETHER.md,
    # "Exactly-once appends"): the unique index decides between servers racing with one id.
    # NULL in every older frame, so the index is built without reading payloads; self-contained.
    (7, """
ALTER TABLE frames ADD COLUMN append_id text;
CREATE UNIQUE INDEX frames_by_append_id ON frames (instance, append_id) WHERE append_id IS NOT NULL;
"""),
    # One end per message's turn (`TurnEnded`, docs/SECURITY.md "One turn end per message"): the
    # unique index refuses a second end, whichever path or server stores it. The column is filled
    # on the first end of each turn of an older log only (it may hold a second end stored before);
    # self-contained.
    (8, f"""
ALTER TABLE frames ADD COLUMN ends_turn text;
{first_turn_ends_sql("instance")};
CREATE UNIQUE INDEX {TURN_ENDS_INDEX} ON frames (instance, ends_turn) WHERE ends_turn IS NOT NULL;
"""),
    # The instances where one owner recorded a session (`session_records(..., owner=…)`, docs/SCALING.md,
    # "Every server knows every session"): a caller's own sessions are found whatever other callers
    # recorded under the same id. Partial, on the session records only, as migration 6; self-contained.
    (9, f"""
CREATE INDEX frames_session_owners ON frames (session_id, channel, (payload::jsonb ->> '{OWNER_KEY}'), instance)
    WHERE type = '{SESSION_RECORD}';
"""),
    # The hash chain (store/chain.py, docs/AUDIT.md): each frame's hash, the instance's chain head
    # beside its last_seq (advanced under the same row lock, so appends by several servers chain in
    # commit order, per instance), and the checkpoints. Older frames keep no hash: an instance's
    # chain starts after them, from `GENESIS`; self-contained.
    (10, f"""
ALTER TABLE frames ADD COLUMN hash bytea;
ALTER TABLE instances ADD COLUMN last_hash bytea NOT NULL DEFAULT {_GENESIS_SQL};
CREATE TABLE checkpoints (
    instance  text   NOT NULL,
    seq       bigint NOT NULL,
    hash      bytea  NOT NULL,
    ts        text   NOT NULL,
    reason    text   NOT NULL,
    signature bytea,
    PRIMARY KEY (instance, seq)
);
"""),
]
SCHEMA_VERSION = max(version for version, _ in MIGRATIONS)

#: Several frames' seqs, and the chain head before them (the row is not updated but locked: the
#: hashes are computed in Python and the head written back in the same transaction, `_SET_HEAD`).
_BUMP_SEQ = (
    "INSERT INTO instances (name, last_seq) VALUES (%s, %s) "
    "ON CONFLICT (name) DO UPDATE SET last_seq = instances.last_seq + EXCLUDED.last_seq RETURNING last_seq, last_hash"
)
_SET_HEAD = "UPDATE instances SET last_hash = %s WHERE name = %s"


def _bump_one(digest: bytes, unless: bytes | None = None) -> bytes:
    """A CTE taking one frame's seq and chain hash under the instance row's lock, the one recipe of
    every single-frame append: `digest` names the parameter of the frame's content digest
    (`chain.content_digest`), and the new head, `chain.link` of the head before it, comes back as
    `last_hash`, the frame's `hash`. `unless`: a query that, when it has a row, bumps nothing."""
    where = b"" if unless is None else b"WHERE NOT EXISTS (" + unless + b") "
    return (
        b"bumped AS (INSERT INTO instances (name, last_seq, last_hash) SELECT $1, 1, sha256(" + _GENESIS_SQL.encode()
        + b" || int8send(1::int8) || " + digest + b"::bytea) " + where
        + b"ON CONFLICT (name) DO UPDATE SET last_seq = instances.last_seq + 1, "
        b"last_hash = sha256(instances.last_hash || int8send(instances.last_seq + 1) || " + digest + b"::bytea) "
        b"RETURNING last_seq, last_hash)"
    )


#: The frame of `$2`-`$8` and `$10` (its `ends_turn`) stored at the seq and hash `_bump_one` took.
_STORE_ONE = (
    b"stored AS (INSERT INTO frames (instance, seq, ts, channel, session_id, type, msg_id, reply_to, payload, "
    b"ends_turn, hash) SELECT $1, last_seq, $2, $3, $4, $5, $6, $7, $8, $10, last_hash FROM bumped RETURNING seq) "
)
#: The stored frame's seq, and its NOTIFY (`notice_payload`'s shape: `$9` is `notice_fields` of the frame).
_NOTIFY_STORED = (
    b"SELECT seq, pg_notify('" + NOTIFY_CHANNEL.encode() + b"', $1 || chr(9) || seq || chr(9) || seq || $9) FROM stored"
)
#: One frame in one statement (autocommit: the bump, the insert and the NOTIFY commit together),
#: run on the Trio loop by `postgres_loop` (no worker thread, one round trip); `$11` its digest.
_APPEND_ONE = b"WITH " + _bump_one(b"$11") + b", " + _STORE_ONE + _NOTIFY_STORED
#: `append_once`'s one statement: the frame of `$10` if the instance has it (then nothing is bumped
#: or stored: no row comes back), else `_APPEND_ONE`'s bump, insert and NOTIFY. Of two servers
#: racing with one id, the second waits for the first's bump (the instance's row lock), then its
#: insert breaks the unique index and the whole statement fails: no seq is lost.
_APPEND_ONCE = (
    b"WITH found AS (SELECT seq FROM frames WHERE instance = $1 AND append_id = $10), "
    + _bump_one(b"$12", unless=b"SELECT 1 FROM found") + b", "
    b"stored AS (INSERT INTO frames (instance, seq, ts, channel, session_id, type, msg_id, reply_to, payload, "
    b"append_id, ends_turn, hash) SELECT $1, last_seq, $2, $3, $4, $5, $6, $7, $8, $10, $11, last_hash FROM bumped "
    b"RETURNING seq) "
    + _NOTIFY_STORED
)
_FRAME_BY = b"SELECT seq, ts, channel, session_id, type, msg_id, reply_to, payload FROM frames WHERE instance = $1 AND "
_FRAME_OF_APPEND_ID = _FRAME_BY + b"append_id = $2"
#: The stored end of a message's turn, along the unique index.
_END_OF_TURN = _FRAME_BY + b"ends_turn = $2"
#: The frames of an instance after a seq, in one snapshot with its `last_seq` and `pruned_below`
#: (`_build`'s statement without filters), run on the Trio loop: the log tail's one read per wake.
_FRAMES_AFTER = (
    b"SELECT i.last_seq, i.pruned_below, f.seq, f.ts, f.channel, f.session_id, f.type, f.msg_id, f.reply_to, "
    b"f.payload FROM instances i LEFT JOIN LATERAL (SELECT * FROM frames f WHERE f.instance = i.name "
    b"AND f.seq > $1 ORDER BY f.seq LIMIT $2) f ON true WHERE i.name = $3 ORDER BY f.seq"
)
# The records of one session in one instance, along `frames_session_records` (the type is written
# out, not bound: the planner uses a partial index only for a query whose WHERE implies its condition).
_RECORDS_OF = (
    f"FROM frames f WHERE f.session_id = %(sid)s AND f.channel = %(ch)s AND f.type = '{SESSION_RECORD}' "
    "AND f.instance = r.instance"
)
#: `PostgresFrameStore.session_records`: the first `%(limit)s` instances (by name, as `instances()`
#: sorts them; only `%(inst)s` when it is not NULL) with a record of the session, each with its
#: first owner and its last declaration.
_OWNER_AND_DECLARATION = (
    f"LEFT JOIN LATERAL (SELECT f.payload::jsonb ->> '{OWNER_KEY}' AS owner {_RECORDS_OF} "
    f"AND jsonb_typeof(f.payload::jsonb -> '{OWNER_KEY}') = 'string' ORDER BY f.seq LIMIT 1) o ON true "
    f"LEFT JOIN LATERAL (SELECT (f.payload::jsonb -> '{DECLARATION_KEY}')::text AS declared {_RECORDS_OF} "
    f"AND jsonb_typeof(f.payload::jsonb -> '{DECLARATION_KEY}') = 'object' ORDER BY f.seq DESC LIMIT 1) d ON true "
)
SESSION_RECORDS_SQL = (
    "SELECT r.instance, o.owner, d.declared FROM ("
    "SELECT instance FROM frames WHERE session_id = %(sid)s AND channel = %(ch)s "
    f"AND type = '{SESSION_RECORD}' AND (%(inst)s::text IS NULL OR instance = %(inst)s) GROUP BY instance ORDER BY instance COLLATE \"C\" LIMIT %(limit)s) r "
    + _OWNER_AND_DECLARATION
    + "ORDER BY r.instance COLLATE \"C\""
)
#: `PostgresFrameStore.session_records(..., owner=…)`: the same, of the instances whose first owner
#: is `%(owner)s`, found along `frames_session_owners` (migration 9: the instances where it recorded
#: the session), so what other callers recorded under the id takes none of the `%(limit)s` places.
OWNED_SESSION_RECORDS_SQL = (
    "SELECT r.instance, o.owner, d.declared FROM ("
    "SELECT instance FROM frames WHERE session_id = %(sid)s AND channel = %(ch)s "
    f"AND type = '{SESSION_RECORD}' AND (payload::jsonb ->> '{OWNER_KEY}') = %(owner)s "
    "AND (%(inst)s::text IS NULL OR instance = %(inst)s) GROUP BY instance) r "
    + _OWNER_AND_DECLARATION
    + "WHERE o.owner = %(owner)s ORDER BY r.instance COLLATE \"C\" LIMIT %(limit)s"
)
#: `append_outcome`'s one statement, on the Trio loop: `_APPEND_ONE`'s bump (the chain's link
#: too), insert and NOTIFY unless the request's claim (a `resolutions` row, `$12`) is stored, and the
#: claim with the frame's seq. Of two servers racing, the second waits for the first's bump (the
#: instance's row lock), then its claim breaks `resolutions`' primary key and the whole statement
#: fails: it lost, no seq spent, the chain head unmoved.
_APPEND_CLAIMED = (
    b"WITH " + _bump_one(b"$11", unless=b"SELECT 1 FROM resolutions WHERE instance = $1 AND request_id = $12") + b", "
    b"claimed AS (INSERT INTO resolutions (instance, request_id, seq) SELECT $1, $12, last_seq FROM bumped), "
    + _STORE_ONE + _NOTIFY_STORED
)
#: The primary key a losing claim breaks (`_APPEND_CLAIMED`).
_CLAIM_KEY = "resolutions_pkey"
_INSERT_FRAME = (
    "INSERT INTO frames (instance, seq, ts, channel, session_id, type, msg_id, reply_to, payload, ends_turn, hash) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
#: A checkpoint (`chain.Checkpoint`): a second one at the same seq only adds a signature the first lacked.
_INSERT_CHECKPOINT = (
    "INSERT INTO checkpoints (instance, seq, hash, ts, reason, signature) VALUES (%s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (instance, seq) DO UPDATE SET signature = EXCLUDED.signature WHERE checkpoints.signature IS NULL"
)

_T = TypeVar("_T")


def safe_url(url: str) -> str:
    """`postgresql://user@host:port/dbname` (or `…/dbname?host=/socket/dir`) of a libpq URI,
    without its password or other options."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(invalid URI)"
    user = f"{info['user']}@" if info.get("user") else ""
    host = str(info.get("host") or "")
    port = f":{info['port']}" if info.get("port") else ""
    dbname = info.get("dbname") or ""
    if host.startswith("/"):  # a Unix socket directory
        return f"postgresql://{user}{port}/{dbname}?host={host}"
    return f"postgresql://{user}{host}{port}/{dbname}"


def _no_nul(instance: str, prepared: list[tuple]) -> None:
    """PostgreSQL text cannot hold NUL; refuse it as bad input (SQLite would store it)."""
    check_instance(instance)
    for one in prepared:
        for value in one[:5]:
            if isinstance(value, str) and "\x00" in value:
                raise ValueError("frame fields must not contain NUL characters")
    if "\x00" in instance:
        raise ValueError("instance must not contain NUL characters")


class PostgresFrameStore(FrameAppends):
    """The tether log in PostgreSQL; several servers may share one database (module docstring).

    Owns: a connection pool and a LISTEN connection, both opened by `running()` and closed
    when it exits. Needs: `async with store.running():` around its use.
    Raises: as `FrameStoreAPI`; `StoreUnavailable` when the database cannot be reached.
    """

    def __init__(
        self,
        url: str,
        *,
        retention_frames: int | None = DEFAULT_RETENTION_FRAMES,
        retention_seconds: float | None = None,
        prune_every: int = DEFAULT_PRUNE_EVERY,
        pool_size: int = 4,
        connect_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
        checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
        sign: Callable[[bytes], bytes] | None = None,
    ) -> None:
        check_retention(retention_frames, retention_seconds, prune_every)
        check_checkpoint_every(checkpoint_every)
        self.checkpoint_every = checkpoint_every
        self._sign = sign
        self._appends_since_checkpoint: dict[str, int] = {}
        psycopg.conninfo.conninfo_to_dict(url)  # a malformed URI fails here, not at first use
        self.url = url
        self.retention_frames = retention_frames
        self.retention_seconds = retention_seconds
        self.prune_every = prune_every
        self.pool_size = pool_size
        self.connect_timeout = connect_timeout
        self._clock = clock
        self._pool: psycopg_pool.ConnectionPool | None = None
        self._statements: LoopStatements | None = None  # single appends, on the Trio loop
        self._limiter = trio.CapacityLimiter(pool_size)
        self._closed = False
        self._appends_since_prune: dict[str, int] = {}
        FrameAppends.__init__(self)
        self.listening = False
        """Whether the LISTEN connection is up (cross-server wake-ups arrive)."""
        self._notice_hooks: list[AppendNoticeHook] = []
        self._heard: dict[str, int] = {}
        """The highest seq this store heard committed (its appends, NOTIFYs) of each instance it follows."""
        self._rewakes = 0
        """Bumped when notices may have been missed or named no seqs: every waiter reads again."""
        self._known: dict[str, dict[int, tuple[FrameFields, Frame | None, int]]] = {}
        """The filter fields of recent frames, by seq, of each instance followed, with the whole frame
        and its size when it is kept (this server's appends, and a notice that carries it: within
        `KNOWN_WHOLE_KEPT` and `KNOWN_WHOLE_BYTES`): every notice's (`read_whole_notice`) and this
        server's appends."""
        self._whole_bytes = 0
        """The sizes of the whole frames in `_known`, summed (at most `KNOWN_WHOLE_BYTES`)."""
        self._left: OrderedDict[str, None] = OrderedDict()
        """The instances no long poll waits on here now that are still followed (`_follows`), the
        one left last at the end; at most `KNOWN_AFTER_WAIT`."""
        self._appending: dict[str, int] = {}
        """How many single appends of each instance this store has in flight (`_one_frame`)."""

    def hear_appends(self, hook: AppendNoticeHook) -> None:
        """Tell `hook` of every append committed by any server (its notification) and, on each
        reconnect of the listener, that notices may have been missed (docs/SCALING.md, "The log tail")."""
        self._notice_hooks.append(hook)

    # -- lifecycle -----------------------------------------------------------------------

    def describe(self) -> str:
        """`postgresql://user@host/dbname` (no password)."""
        return safe_url(self.url)

    @property
    def closed(self) -> bool:
        """Whether `running()` has ended (or never connected)."""
        return self._closed or self._pool is None

    @property
    def shared(self) -> bool:
        """True: every server of the deployment appends to this log."""
        return True

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Connect (pool and listener), apply migrations and retention; close on exit.

        Raises: `StoreUnavailable` (one line) when the database cannot be reached in
        `connect_timeout` seconds; `RuntimeError` for a schema newer than this program.
        """
        try:  # one plain connection first: its error is the clearest, and the pool logs none
            await trio.to_thread.run_sync(self._probe)
        except psycopg.Error as exc:
            raise StoreUnavailable(f"cannot reach the PostgreSQL store {self.describe()}: {_first_line(exc)}") from None
        throttle_pool_log()
        pool = psycopg_pool.ConnectionPool(
            self.url, min_size=self.pool_size, max_size=self.pool_size, open=False,
            timeout=self.connect_timeout, name="oubliette-store",
            # Check each connection as it is handed out: after a database restart, broken ones
            # are replaced instead of failing the first calls.
            check=psycopg_pool.ConnectionPool.check_connection,
            kwargs={"connect_timeout": max(1, math.ceil(self.connect_timeout))},
        )
        try:
            await trio.to_thread.run_sync(lambda: pool.open(wait=True, timeout=self.connect_timeout))
        except psycopg_pool.PoolTimeout:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(pool.close)
            raise StoreUnavailable(
                f"cannot reach the PostgreSQL store {self.describe()}: no connection within {self.connect_timeout:g} s"
            ) from None
        self._pool = pool
        self._statements = LoopStatements(self.url, self.pool_size, self.connect_timeout, self.describe())
        self._closed = False
        try:
            await self._run(self._migrate)
            await self._run(self._prune_all)
            async with trio.open_nursery() as nursery:
                await nursery.start(self._listen)
                try:
                    yield
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._closed = True
            self.listening = False
            statements, self._statements = self._statements, None
            if statements is not None:
                statements.close()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: pool.close(timeout=5.0))

    def _probe(self) -> None:
        psycopg.connect(self.url, connect_timeout=max(1, math.ceil(self.connect_timeout))).close()

    async def _run(
        self, work: Callable[..., _T], *args: Any, read_only: bool = False, acquire_timeout: float | None = None,
    ) -> _T:
        """Run `work(conn, *args)` in a worker thread on a pooled connection, in one transaction.

        A read (`read_only`) that loses its connection is tried once more on another one: a
        connection the database dropped can pass the pool's check and fail just after. A write
        is not retried (it may have committed). `acquire_timeout`: how long to wait for a pooled
        connection (default `connect_timeout`); a short one lets a caller that must not hang on
        an outage (a long poll, the readiness probe) hear of it in that time."""
        pool = self._pool
        if pool is None or self._closed:
            raise RuntimeError("the frame store is closed")

        def call() -> _T:
            for attempt in (1, 2):
                try:
                    with pool.connection(timeout=acquire_timeout) as conn:
                        return work(conn, *args)
                except psycopg_pool.PoolTimeout as exc:  # (an OperationalError): no connection came; not retried
                    raise StoreUnavailable(
                        f"the PostgreSQL store {self.describe()} is unavailable: {_first_line(exc)}") from exc
                except psycopg.OperationalError as exc:
                    if read_only and attempt == 1:
                        continue
                    raise StoreUnavailable(
                        f"the PostgreSQL store {self.describe()} is unavailable: {_first_line(exc)}") from exc
            raise AssertionError("unreachable")

        return await trio.to_thread.run_sync(call, limiter=self._limiter)

    def _migrate(self, conn: psycopg.Connection) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS oubliette_schema "
                "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            applied = {r[0] for r in conn.execute("SELECT version FROM oubliette_schema")}
            current = max(applied, default=0)
            if current > SCHEMA_VERSION:
                raise RuntimeError(
                    f"frame store {self.describe()} has schema version {current}; this program knows "
                    f"version {SCHEMA_VERSION} — refusing to open it"
                )
            # Each migration not applied yet, in order: one numbered below the newest applied
            # (merged from a parallel branch after a later one ran) is applied too.
            for version, statements in sorted(MIGRATIONS):
                if version not in applied:
                    for statement in statements.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute("INSERT INTO oubliette_schema (version) VALUES (%s)", (version,))
                    log.info("frame store %s: applied schema migration %d", self.describe(), version)

    async def check_available(self, timeout: float) -> None:
        """`SELECT 1` answered within `timeout` seconds and the LISTEN connection up, else
        `StoreUnavailable` saying which (the readiness probe, `/readyz`)."""
        if not self.listening:
            raise StoreUnavailable(
                f"the PostgreSQL store {self.describe()} is unavailable: its LISTEN connection is down "
                "(reconnecting), so appends by other servers would not wake a wait")
        with trio.move_on_after(timeout) as scope:
            # Abandoned, not awaited, past the deadline: a probe must not hang on a stuck database.
            await trio.to_thread.run_sync(self._select_one, timeout, abandon_on_cancel=True, limiter=self._limiter)
        if scope.cancelled_caught:
            raise StoreUnavailable(f"the PostgreSQL store {self.describe()} did not answer within {timeout:g} s")

    def _select_one(self, timeout: float) -> None:
        pool = self._pool
        if pool is None or self._closed:
            raise StoreUnavailable(f"the PostgreSQL store {self.describe()} is closed")
        try:
            with pool.connection(timeout=timeout) as conn:
                conn.execute("SELECT 1")
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise StoreUnavailable(
                f"the PostgreSQL store {self.describe()} is unavailable: {_first_line(exc)}") from None

    # -- LISTEN --------------------------------------------------------------------------

    async def _listen(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep one LISTEN connection; wake an instance's waiters on each notification."""
        backoff = LISTEN_BACKOFF[0]
        first = True
        while True:
            conn: psycopg.Connection | None = None
            try:
                conn = await trio.to_thread.run_sync(self._listen_connection)
                if first:
                    task_status.started()
                    first = False
                else:
                    log.info("frame store %s: listening again", self.describe())
                self.listening = True
                backoff = LISTEN_BACKOFF[0]
                self._rewake_all()  # notifications sent while we were away are lost: re-query
                for hook in self._notice_hooks:
                    hook.missed()
                pgconn = conn.pgconn
                while True:
                    await trio.lowlevel.wait_readable(pgconn.socket)
                    pgconn.consume_input()
                    while (note := pgconn.notifies()) is not None:
                        self._on_notice(note.extra.decode("utf-8", "replace"))
            except (psycopg.Error, OSError) as exc:
                if first:
                    raise StoreUnavailable(
                        f"cannot LISTEN on the PostgreSQL store {self.describe()}: {_first_line(exc)}"
                    ) from exc
                if self.listening:
                    log.warning("frame store %s: lost the LISTEN connection (%s); reconnecting",
                                self.describe(), _first_line(exc))
                self.listening = False
                await self._replace_broken_connections()
                self._rewake_all()
                await trio.sleep(backoff)
                backoff = min(backoff * 2, LISTEN_BACKOFF[1])
            finally:
                if conn is not None:
                    conn.close()

    def _rewake_all(self) -> None:
        """Notices may have been lost: every waiter reads again, and what was heard is forgotten, so
        no long poll takes it for all that committed (`_known_after`)."""
        self._rewakes += 1
        self._heard.clear()
        self._known.clear()
        self._whole_bytes = 0
        self._wake_all()

    def _on_notice(self, payload: str) -> None:
        """One notice: the waiters of its instance learn the frames' fields from it (and the whole
        frames, when it carries them), and wake only if one of them may match a frame (each append
        wakes every server's listener: a wake of every waiter of the instance on each would be work
        for nothing); the hooks hear it."""
        instance, first, last, fields, rest = read_whole_notice(payload)
        if first is not None and fields is not None:
            wholes: list[Frame | None] = [None] * len(fields)
            if rest is not None and self._follows(instance):  # whole frames, only where kept
                wholes = [make_frame(first + i, ts, instance, ch, sid, typ, mid, rt, obj)
                          for i, ((ch, sid, typ, rt), (ts, mid, obj)) in enumerate(zip(fields, rest))]
            size = len(payload) // len(fields)  # a frame's share of the notice: what it holds, about
            self._note_known(instance, [(first + i, frame, wholes[i], size) for i, frame in enumerate(fields)])
            self._wake_for(instance, first, fields)
        else:
            self._heard_commit(instance, last)
            self._wake_instance(instance)
        for hook in self._notice_hooks:
            hook.appended(instance, first, last, fields)

    async def _replace_broken_connections(self) -> None:
        """The listener's connection broke, so the pool's likely did too (a database restart, cut
        connections): check the idle ones now and have the broken ones replaced, before the
        waiters re-query. Else each waiter meets them one by one, and the pool's back-off between
        failed checks (1, 2, 4 s) held a re-query for ~7 s after a cut, where a long poll now
        gives up after `FAIL_FAST_SECONDS`. Bounded: a check must not hang the listener."""
        pool = self._pool
        if pool is None:
            return
        with trio.move_on_after(self.connect_timeout):
            await trio.to_thread.run_sync(pool.check, abandon_on_cancel=True)

    def _listen_connection(self) -> psycopg.Connection:
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, math.ceil(self.connect_timeout)))
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    # -- instances -----------------------------------------------------------------------

    async def instances(self) -> list[str]:
        """Names of every instance that has ever had a frame appended, sorted."""
        def read(conn: psycopg.Connection) -> list[str]:
            return [r[0] for r in conn.execute('SELECT name FROM instances ORDER BY name COLLATE "C"')]
        return await self._run(read, read_only=True)

    async def session_records(
        self, channel: str, session_id: str, limit: int = MAX_RECORDED_INSTANCES, instance: str | None = None,
        owner: str | None = None,
    ) -> list[RecordedSession]:
        """The instances (at most `limit`, by name) whose log holds a `session_record` of the session
        (with `owner`: whose first owner is `owner`), with the owner and last declaration each records:
        one statement along the partial index `frames_session_records` (migration 6; with `owner`,
        `frames_session_owners`, migration 9), however many instances the log has."""
        params = {"sid": session_id, "ch": channel, "limit": limit, "inst": instance, "owner": owner}
        sql = SESSION_RECORDS_SQL if owner is None else OWNED_SESSION_RECORDS_SQL

        def read(conn: psycopg.Connection) -> list[RecordedSession]:
            rows = conn.execute(sql, params).fetchall()
            return [
                RecordedSession(name, owner, None if declared is None else json.loads(declared))
                for name, owner, declared in rows
            ]
        return await self._run(read, read_only=True)

    async def last_seq(self, instance: str) -> int:
        """The highest seq ever assigned for `instance` (0 if none)."""
        return (await self._run(self._instance_row, instance, read_only=True))[0]

    async def pruned_below(self, instance: str) -> int:
        """Every frame of `instance` with `seq <=` this has been deleted by retention (0 if none)."""
        return (await self._run(self._instance_row, instance, read_only=True))[1]

    @staticmethod
    def _instance_row(conn: psycopg.Connection, instance: str) -> tuple[int, int]:
        row = conn.execute("SELECT last_seq, pruned_below FROM instances WHERE name = %s", (instance,)).fetchone()
        return (0, 0) if row is None else (row[0], row[1])

    # -- append --------------------------------------------------------------------------

    async def _append_claimed(self, instance: str, request_id: str, prepared: list[tuple]) -> Frame | None:
        """The claim (a `resolutions` row, primary key `(instance, request_id)`) and the frame
        commit together, so exactly one server's outcome wins: `_APPEND_CLAIMED`, one statement
        on the Trio loop (it was a transaction of six statements in a worker thread)."""
        _no_nul(instance, prepared)
        await trio.lowlevel.checkpoint_if_cancelled()
        ts = format_ts(self._clock())
        try:
            rows = await self._one_frame(_APPEND_CLAIMED, instance, ts, prepared[0], request_id.encode())
        except psycopg.errors.UniqueViolation as exc:
            if _CLAIM_KEY in str(exc):
                return None  # another server's outcome took the claim first
            raise await self._turn_ended(instance, prepared) from None
        if not rows:
            return None  # the claim was stored before: nothing was written
        return (await self._appended(instance, prepared, int(rows[0][0] or 0), ts))[0]

    async def _one_frame(self, sql: bytes, instance: str, ts: str, prepared: tuple, *more: bytes) -> list[list[bytes | None]]:
        """`sql` with one frame's eleven parameters (`_APPEND_ONE`'s, its digest last) and `more`,
        on the Trio loop."""
        statements = self._statements
        if statements is None:
            raise RuntimeError("the frame store is closed")
        ch, sid, typ, mid, rt, text, obj, _ = prepared
        ends = ends_turn(typ, rt)
        # Counted in flight, so this server's waiters hearing its NOTIFY first wait for its seq here.
        self._appending[instance] = self._appending.get(instance, 0) + 1
        try:
            rows = await statements.rows(sql, [
                instance.encode(), ts.encode(), ch.encode(), sid.encode(), typ.encode(), mid.encode(),
                None if rt is None else rt.encode(), text.encode(), notice_frames([prepared], ts).encode(),
                None if ends is None else ends.encode(), _bytea(content_digest(instance, ts, ch, sid, typ, mid, rt, obj)),
                *more,
            ])
            return rows
        finally:
            left = self._appending.pop(instance) - 1
            if left:
                self._appending[instance] = left
            self._wake_instance(instance)

    async def _append(self, instance: str, prepared: list[tuple]) -> list[Frame]:
        _no_nul(instance, prepared)
        await trio.lowlevel.checkpoint_if_cancelled()
        if not prepared:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        n = len(prepared)
        ts = format_ts(self._clock())

        if n == 1 and self._statements is not None:
            try:
                rows = await self._one_frame(_APPEND_ONE, instance, ts, prepared[0])
            except psycopg.errors.UniqueViolation:
                raise await self._turn_ended(instance, prepared) from None
            return await self._appended(instance, prepared, int(rows[0][0] or 0), ts)

        def write(conn: psycopg.Connection) -> int:
            with conn.transaction():
                row = conn.execute(_BUMP_SEQ, (instance, n)).fetchone()
                assert row is not None
                last, head = row[0], bytes(row[1])
                first = last - n + 1
                hashes = []
                for i, (ch, sid, typ, mid, rt, _, obj, _) in enumerate(prepared):
                    head = link(head, first + i, content_digest(instance, ts, ch, sid, typ, mid, rt, obj))
                    hashes.append(head)
                conn.execute(_SET_HEAD, (head, instance))
                with conn.cursor() as cur:
                    cur.executemany(_INSERT_FRAME, [
                        (instance, first + i, ts, ch, sid, typ, mid, rt, text, ends_turn(typ, rt), hashes[i])
                        for i, (ch, sid, typ, mid, rt, text, _, _) in enumerate(prepared)
                    ])
                conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, notice_payload(
                    instance, first, last, tail=notice_frames(prepared, ts))))
            return first

        try:
            first = await self._run(write)
        except psycopg.errors.UniqueViolation:
            raise await self._turn_ended(instance, prepared) from None
        return await self._appended(instance, prepared, first, ts)

    async def _turn_ended(self, instance: str, prepared: list[tuple]) -> Exception:
        """What to raise for an append the unique index refused: `TurnEnded` with the stored end of
        the turn it would have ended again (the statement rolled back: no seq was spent)."""
        for msg_id in ended_turns(prepared):
            stored = await self._frame_by(_END_OF_TURN, instance, msg_id)
            if stored is not None:
                return TurnEnded(stored)
        return StoreUnavailable(f"the PostgreSQL store {self.describe()} refused the append (a unique index) "
                                "and holds no frame that explains it (retention deleted it meanwhile); send it again")

    async def _append_once(self, instance: str, prepared: tuple) -> tuple[Frame, bool]:
        """`_APPEND_ONCE` on the Trio loop; when it stored nothing (the id's frame was there) or
        lost a race on the unique index, the frame stored with the id is read and returned."""
        _no_nul(instance, [prepared])
        ch, sid, typ, mid, rt, text, obj, aid = prepared
        ends = ends_turn(typ, rt)
        for _attempt in range(3):  # again only if retention deleted the frame between the two reads
            statements = self._statements
            if statements is None:
                raise RuntimeError("the frame store is closed")
            ts = format_ts(self._clock())
            refused: psycopg.DatabaseError | None = None
            try:
                rows = await statements.rows(_APPEND_ONCE, [
                    instance.encode(), ts.encode(), ch.encode(), sid.encode(), typ.encode(), mid.encode(),
                    None if rt is None else rt.encode(), text.encode(), notice_frames([prepared], ts).encode(),
                    aid.encode(),
                    None if ends is None else ends.encode(),
                    _bytea(content_digest(instance, ts, ch, sid, typ, mid, rt, obj)),
                ])
            except psycopg.DatabaseError as exc:  # perhaps a racing server stored the id (or the turn's end) first
                rows, refused = [], exc
            if rows:
                return (await self._appended(instance, [prepared], int(rows[0][0] or 0), ts))[0], True
            found = await self.frame_of_append_id(instance, aid)
            if found is not None:
                return found, False
            if isinstance(refused, psycopg.errors.UniqueViolation) and ends is not None:
                ended = await self._turn_ended(instance, [prepared])
                if isinstance(ended, TurnEnded):
                    raise ended
            elif refused is not None:
                raise refused
        raise StoreUnavailable(f"the PostgreSQL store {self.describe()} could not append the frame of {aid!r}")

    async def frame_of_append_id(self, instance: str, append_id: str) -> Frame | None:
        """The frame of `instance` stored with `append_id`, or None (one read on the Trio loop)."""
        return await self._frame_by(_FRAME_OF_APPEND_ID, instance, append_id)

    async def _frame_by(self, sql: bytes, instance: str, key: str) -> Frame | None:
        """The frame of `instance` that `sql` (by a key, along a unique index) finds, or None."""
        statements = self._statements
        if statements is None:
            raise RuntimeError("the frame store is closed")
        rows = await statements.rows(sql, [instance.encode(), key.encode()], read_only=True)
        if not rows:
            return None
        text = bytes.decode
        seq, ts, ch, sid, typ, mid, rt, payload = rows[0]
        return make_frame(
            int(seq), text(ts), instance, text(ch), text(sid), text(typ), text(mid),  # type: ignore[arg-type]
            None if rt is None else text(rt), json.loads(payload),  # type: ignore[arg-type]
        )

    async def _appended(self, instance: str, prepared: list[tuple], first: int, ts: str) -> list[Frame]:
        """The frames just committed from `first` on; wakes this server's waiters, prunes now and then."""
        n = len(prepared)
        stored = [
            make_frame(first + i, ts, instance, ch, sid, typ, mid, rt, obj)
            for i, (ch, sid, typ, mid, rt, _, obj, _) in enumerate(prepared)
        ]
        self._note_known(instance, [(f.seq, (f.channel, f.session_id, f.type, f.reply_to), f, len(p[5]))
                                    for f, p in zip(stored, prepared)])
        self._wake_instance(instance)
        if self.checkpoint_every is not None:
            since = self._appends_since_checkpoint.get(instance, 0) + n
            if since >= self.checkpoint_every:
                since = 0
                try:
                    await self._run(self._checkpoint_head, instance, EVERY)
                except Exception:
                    log.exception("frame store: the checkpoint of instance %r failed", instance)
            self._appends_since_checkpoint[instance] = since
        count = self._appends_since_prune.get(instance, 0) + n
        if count >= self.prune_every:
            self._appends_since_prune[instance] = 0
            try:
                if await self._run(self._prune_instance, instance):
                    self._heard_commit(instance, None)  # before its notice is back: nothing below the cut is answered
            except Exception:
                # The append itself is committed; retention will be retried next time.
                log.exception("frame store: retention for instance %r failed", instance)
        else:
            self._appends_since_prune[instance] = count
        return stored

    # -- the hash chain (chain.py) --------------------------------------------------------

    def _write_checkpoint(self, conn: psycopg.Connection, instance: str, seq: int, reason: str) -> Checkpoint | None:
        """Store (signed, with a key) the checkpoint after frame `seq` of `instance` (in the caller's
        transaction, which holds the instance's row); None if that frame is not stored."""
        row = conn.execute("SELECT hash FROM frames WHERE instance = %s AND seq = %s", (instance, seq)).fetchone()
        if row is None:
            return None
        return self._store_checkpoint(conn, instance, seq, GENESIS if row[0] is None else bytes(row[0]), reason)

    def _store_checkpoint(self, conn: psycopg.Connection, instance: str, seq: int, head: bytes, reason: str) -> Checkpoint:
        checkpoint = Checkpoint(instance, seq, head, format_ts(self._clock()), reason)
        if self._sign is not None:
            checkpoint = attrs.evolve(checkpoint, signature=self._sign(checkpoint.message()))
        conn.execute(_INSERT_CHECKPOINT, (instance, seq, head, checkpoint.ts, reason, checkpoint.signature))
        return checkpoint

    def _checkpoint_head(self, conn: psycopg.Connection, instance: str, reason: str) -> Checkpoint | None:
        """A checkpoint of the instance's chain head (its row: the head and last seq agree)."""
        with conn.transaction():
            row = conn.execute("SELECT last_seq, last_hash FROM instances WHERE name = %s", (instance,)).fetchone()
            if row is None or row[0] == 0:
                return None
            return self._store_checkpoint(conn, instance, row[0], bytes(row[1]), reason)

    async def add_checkpoint(self, instance: str) -> Checkpoint | None:
        """Checkpoint the chain of `instance` at its head now (`audit checkpoint`), signed when the
        store has a key; None when the instance has no frame."""
        return await self._run(self._checkpoint_head, instance, DEMAND)

    async def checkpoints(self, instance: str) -> list[Checkpoint]:
        """Every checkpoint of `instance`, by seq."""
        def read(conn: psycopg.Connection) -> list[Checkpoint]:
            rows = conn.execute(
                "SELECT seq, hash, ts, reason, signature FROM checkpoints WHERE instance = %s ORDER BY seq", (instance,),
            ).fetchall()
            return [
                Checkpoint(instance, seq, bytes(h), ts, reason, None if sig is None else bytes(sig))
                for seq, h, ts, reason, sig in rows
            ]
        return await self._run(read, read_only=True)

    async def chained_frames(self, instance: str, after_seq: int, limit: int) -> list[ChainedFrame]:
        """The stored frames of `instance` after `after_seq` (at most `limit`, by seq) with their hashes."""
        def read(conn: psycopg.Connection) -> list[ChainedFrame]:
            rows = conn.execute(
                "SELECT seq, ts, channel, session_id, type, msg_id, reply_to, payload, hash FROM frames "
                "WHERE instance = %s AND seq > %s ORDER BY seq LIMIT %s", (instance, after_seq, limit),
            ).fetchall()
            return [
                ChainedFrame(make_frame(seq, ts, instance, ch, sid, typ, mid, rt, json.loads(payload)),
                             None if h is None else bytes(h))
                for seq, ts, ch, sid, typ, mid, rt, payload, h in rows
            ]
        return await self._run(read, read_only=True)

    async def chain_head(self, instance: str) -> bytes | None:
        """The chain head the instance's row keeps (None: unknown instance)."""
        def read(conn: psycopg.Connection) -> bytes | None:
            row = conn.execute("SELECT last_hash FROM instances WHERE name = %s", (instance,)).fetchone()
            return None if row is None else bytes(row[0])
        return await self._run(read, read_only=True)

    # -- query ---------------------------------------------------------------------------

    @staticmethod
    def _build(instance: str, q: FrameQuery) -> tuple[str, list[Any]]:
        """One statement, so one snapshot: the instance's `last_seq` and `pruned_below`, and the
        matching frames (none: one row of NULLs; unknown instance: no row)."""
        where = "f.instance = i.name AND f.seq > %s"
        params: list[Any] = [q.after_seq]
        for name, value in q.equal_filters():  # the rule `FrameQuery.matches` applies in memory
            where += f" AND f.{name} = %s"
            params.append(value)
        if q.types is not None:
            where += " AND f.type = ANY(%s)"
            params.append(list(q.types))
        params.append(q.limit)
        params.append(instance)
        sql = (
            "SELECT i.last_seq, i.pruned_below, f.seq, f.ts, f.channel, f.session_id, f.type, f.msg_id, "
            "f.reply_to, f.payload FROM instances i LEFT JOIN LATERAL ("
            f"SELECT * FROM frames f WHERE {where} ORDER BY f.seq LIMIT %s"
            ") f ON true WHERE i.name = %s ORDER BY f.seq"
        )
        return sql, params

    def _read(self, conn: psycopg.Connection, instance: str, q: FrameQuery) -> tuple[int, list[Frame]]:
        """`(last_seq, frames)` of one snapshot; `CursorPruned` if retention deleted frames after
        `q.after_seq` (in that same snapshot, so no gap is ever skipped)."""
        sql, params = self._build(instance, q)
        rows = conn.execute(sql, params).fetchall()
        if not rows:
            return 0, []
        last, pruned = rows[0][0], rows[0][1]
        if q.after_seq < pruned:
            raise CursorPruned(instance, q.after_seq, pruned + 1, empty=pruned >= last)
        loads = json.loads
        frames = [
            make_frame(seq, ts, instance, ch, sid, typ, mid, rt, loads(payload))
            for _, _, seq, ts, ch, sid, typ, mid, rt, payload in rows if seq is not None
        ]
        return last, frames

    async def query(self, instance: str, q: FrameQuery) -> list[Frame]:
        """Frames of `instance` matching `q`, by seq ascending, at most `q.limit`: one statement on
        the Trio loop (`_read_on_loop`), as a long poll's read (a server that takes an answer to
        another server's request reads the session's requests first: it was a pooled transaction).

        Raises `CursorPruned` if `q.after_seq` is below the retained log."""
        if not isinstance(q, FrameQuery):
            raise TypeError(f"q must be a FrameQuery, got {q.__class__.__name__}")
        return (await self._read_on_loop(instance, q, None))[1]

    async def frames_after(self, instance: str, after_seq: int, limit: int) -> list[Frame]:
        """The frames of `instance` after `after_seq` (at most `limit`), as `query` without filters,
        sent on the Trio loop (no worker thread: about half the time of a pooled read on a small
        machine): the read the log tail makes for each wake, on the path of every cross-server push.

        Raises `CursorPruned` as `query` does, `StoreUnavailable` when the database cannot answer."""
        if self._statements is None:
            return await self.query(instance, FrameQuery(after_seq=after_seq, limit=limit))
        rows = await self._statements.rows(
            _FRAMES_AFTER, [str(after_seq).encode(), str(limit).encode(), instance.encode()], read_only=True)
        return _snapshot(instance, after_seq, rows)[1]

    async def _read_on_loop(self, instance: str, q: FrameQuery, timeout: float | None) -> tuple[int, list[Frame]]:
        """`_read`'s statement sent on the Trio loop: one round trip on an idle connection, where a
        pooled read in a worker thread took four (the pool's check, BEGIN, the query, COMMIT)."""
        statements = self._statements
        if statements is not None:
            sql, params = self._build(instance, q)
            numbered = sql.split("%s")
            text = numbered[0] + "".join(f"${i}{rest}" for i, rest in enumerate(numbered[1:], 1))
            try:
                rows = await statements.rows(text.encode(), [_param(p) for p in params], read_only=True, timeout=timeout)
                return _snapshot(instance, q.after_seq, rows)
            except StoreUnavailable:
                pass  # connections cut (a restart): the pool's checked path, as before
        return await self._run(self._read, instance, q, read_only=True, acquire_timeout=timeout)

    # -- long poll -----------------------------------------------------------------------

    async def wait_for_frames(self, instance: str, q: FrameQuery, timeout: float) -> tuple[list[Frame], bool]:
        """Long poll: `query`; if nothing matches, wait up to `timeout` seconds for an append
        to the instance by any server (NOTIFY) and query again.  `(frames, timed_out)`.
        A long poll answers from memory, without reading, what this server knows whole
        (`_known_after`)."""
        check_timeout(timeout)
        if not isinstance(q, FrameQuery):
            raise TypeError(f"q must be a FrameQuery, got {q.__class__.__name__}")
        await trio.lowlevel.checkpoint_if_cancelled()
        deadline = trio.current_time() + timeout
        # A long poll fails fast in an outage (its client is told to retry) instead of holding
        # its request for the pool's `connect_timeout`, twice: it waits briefly for a connection.
        # (A lost listener alone is no outage: it wakes every waiter, which re-query and, if the
        # database answers, wait on until it is back, as before.)
        acquire = min(self.connect_timeout, FAIL_FAST_SECONDS) if timeout > 0 else None
        with self._waiting(instance, q) as parked:
            while True:
                # Take the event before querying: an append that commits during the query
                # sets it, and the wait below returns at once.
                event = parked.armed()
                rewakes = self._rewakes
                known = self._answer_known(instance, q) if timeout > 0 else None
                frames: list[Frame]
                if known is not None:
                    # Every seq after the caller's is known here (heard with its fields, or this
                    # server's append), and each that matches is known whole: nothing to read.
                    seen, frames = known
                else:
                    # One snapshot: every frame up to `seen` is visible in it (seq is commit-ordered).
                    seen, frames = await self._read_on_loop(instance, q, acquire)
                if frames or timeout == 0:
                    return frames, False
                if seen > q.after_seq:
                    q = attrs.evolve(q, after_seq=seen)
                if trio.current_time() >= deadline:
                    return [], True
                timed_out = await self._woken_by(event, deadline)
                # Read again only for frames that may match and are not known whole here: not for
                # seqs this snapshot held (the NOTIFY of an append this server already woke us for,
                # back through LISTEN), nor for frames known here (`_known`: this server's appends,
                # and every notice's) that do not match `q`; those that match and are known whole
                # are the answer.
                deferred = False
                while not timed_out and self._rewakes == rewakes:
                    skipped = self._skip_known(instance, q, seen, defer=not deferred)
                    if skipped is None:
                        break
                    if skipped[1]:
                        return skipped[1], False
                    deferred = deferred or skipped[0] == seen
                    seen = skipped[0]
                    q = attrs.evolve(q, after_seq=max(q.after_seq, seen))
                    event = parked.armed()
                    timed_out = await self._woken_by(event, deadline)

    def _answer_known(self, instance: str, q: FrameQuery) -> tuple[int, list[Frame]] | None:
        """Before a long poll's first read: `_known_after` its `after_seq`, while the listener is up;
        None: read. The caller's long poll after an answer, and the agent's wait for an outcome
        after its own request, start at a seq every later frame of which this server heard."""
        if not self.listening:
            return None
        return self._known_after(instance, q, q.after_seq, defer=False)

    def known_frames(self, instance: str, q: FrameQuery) -> list[Frame] | None:
        """The first frames `query` would return that this server knows whole without reading (a
        first part of them: frames committed since may not be heard yet), every frame between them
        known; None when it knows none so. The server that takes an answer to a request another
        server's agent made finds the request here when it heard its notice (`_known_after`)."""
        known = self._answer_known(instance, q)
        return None if known is None or not known[1] else known[1]

    def _skip_known(self, instance: str, q: FrameQuery, seen: int, *, defer: bool) -> tuple[int, list[Frame]] | None:
        """After a wake: `_known_after` (the wake was for nothing when it answers no frame)."""
        return self._known_after(instance, q, seen, defer=defer)

    def _known_after(self, instance: str, q: FrameQuery, seen: int, *, defer: bool) -> tuple[int, list[Frame]] | None:
        """What a waiter that read up to `seen` knows without reading: `(up to, frames)`, the frames
        after `seen` that match `q` (`FrameQuery.matches`, at most `q.limit`) and every seq up to
        `up to` known here (heard committed: this server's own appends, or a notice's), each that
        matches known whole; None when it must read (a seq not known before the first match, or a
        match known by its fields alone, or a cursor below a cut retention made here).
        `defer`: a seq not known here while this server appends to the instance may be that
        append's, its NOTIFY heard before its answer: wait for the append to end (`seen`, none)."""
        high = self._heard.get(instance)
        if high is None or high - seen > KNOWN_FRAMES_KEPT:
            return None
        own = self._known.get(instance, {})
        found: list[Frame] = []
        for seq in range(seen + 1, high + 1):
            entry = own.get(seq)
            if entry is None:
                if found:
                    return seq - 1, found  # every frame up to the unknown seq is known: a prefix
                return (seen, found) if defer and instance in self._appending else None
            if q.matches(*entry[0]):
                if entry[1] is None:
                    return (seq - 1, found) if found else None
                found.append(entry[1])
                if len(found) == q.limit:
                    return seq, found
        return max(seen, high), found

    def _heard_commit(self, instance: str, last: int | None) -> None:
        """Note that `instance`'s frames up to `last` are committed (None: unknown seqs, so
        every waiter reads again), for the waiters of `wait_for_frames` here."""
        if last is None:
            self._rewakes += 1
        if last is not None and self._follows(instance):  # bounded: the instances followed here
            self._heard[instance] = max(self._heard.get(instance, 0), last)
        else:  # (unknown seqs: what was heard no longer says what committed)
            self._forget_instance(instance)

    def _follows(self, instance: str) -> bool:
        """Whether this store keeps what it hears of `instance` (`_heard`, `_known`): a long poll waits
        on it here, or one did and it is among the last `KNOWN_AFTER_WAIT` left (`_left`)."""
        return instance in self._waiters or instance in self._left

    def _forget_instance(self, instance: str) -> None:
        """Drop what this store heard of `instance`: a long poll on it reads first."""
        self._heard.pop(instance, None)
        self._forget_known(self._known.pop(instance, {}).values())

    def _first_waiter(self, instance: str) -> None:
        self._left.pop(instance, None)

    def _last_waiter_left(self, instance: str) -> None:
        """Go on following `instance` for a while (`KNOWN_AFTER_WAIT`): the one followed longest
        without a waiter is forgotten."""
        self._left[instance] = None
        if len(self._left) > KNOWN_AFTER_WAIT:
            self._forget_instance(self._left.popitem(last=False)[0])

    def _note_known(self, instance: str, frames: list[tuple[int, FrameFields, Frame | None, int]]) -> None:
        """Keep `(seq, fields, whole frame or None, its size)` of committed frames of an instance
        followed (`_follows`: the last `KNOWN_FRAMES_KEPT`; whole, the last `KNOWN_WHOLE_KEPT` of them, each at
        most `MAX_NOTICE_FRAMES`, all instances' within `KNOWN_WHOLE_BYTES`), so its waiters skip
        those they do not match and take those they match from memory, then note them committed. A
        frame is kept as it was stored or heard (never hashed again: the chain is the database's)."""
        if self._follows(instance):
            own = self._known.setdefault(instance, {})
            for seq, fields, whole, size in frames:
                if whole is None or size > MAX_NOTICE_FRAMES or self._whole_bytes + size > KNOWN_WHOLE_BYTES:
                    whole, size = None, 0
                self._forget_known([own[seq]] if seq in own else [])
                own[seq] = (fields, whole, size)
                self._whole_bytes += size
            for seq in range(frames[0][0] - KNOWN_WHOLE_KEPT, frames[-1][0] - KNOWN_WHOLE_KEPT + 1):
                kept = own.get(seq)
                if kept is not None and kept[1] is not None:  # old enough to be read: its fields alone
                    self._forget_known([kept])
                    own[seq] = (kept[0], None, 0)
            if len(own) > 2 * KNOWN_FRAMES_KEPT:
                cut = frames[-1][0] - KNOWN_FRAMES_KEPT
                self._forget_known([kept for seq, kept in own.items() if seq <= cut])
                self._known[instance] = {seq: kept for seq, kept in own.items() if seq > cut}
        self._heard_commit(instance, frames[-1][0])

    def _forget_known(self, entries: Iterable[tuple[FrameFields, Frame | None, int]]) -> None:
        """Take the sizes of `entries`, dropped from `_known`, off what the whole frames hold."""
        self._whole_bytes -= sum(size for _, _, size in entries)

    # -- named cursors -------------------------------------------------------------------

    async def get_cursor(self, instance: str, name: str) -> int:
        """The durable cursor `name` of `instance` (0 if never set)."""
        def read(conn: psycopg.Connection) -> int:
            row = conn.execute("SELECT seq FROM cursors WHERE instance = %s AND name = %s", (instance, name)).fetchone()
            return 0 if row is None else row[0]
        return await self._run(read, read_only=True)

    async def set_cursor(self, instance: str, name: str, seq: int) -> None:
        """Set (and commit) the durable cursor `name` of `instance`."""
        check_cursor_args(instance, name, seq)
        await self._run(self._write_cursor, instance, name, seq, "EXCLUDED.seq")

    async def advance_cursor(self, instance: str, name: str, seq: int) -> bool:
        """Move the cursor forward to `seq` (never back), in one statement; True if it moved."""
        check_cursor_args(instance, name, seq)
        return await self._run(self._write_cursor, instance, name, seq, "GREATEST(cursors.seq, EXCLUDED.seq)") > 0

    @staticmethod
    def _write_cursor(conn: psycopg.Connection, instance: str, name: str, seq: int, new_seq: str) -> int:
        with conn.transaction():
            cur = conn.execute(
                "INSERT INTO cursors (instance, name, seq) VALUES (%s, %s, %s) "
                f"ON CONFLICT (instance, name) DO UPDATE SET seq = {new_seq} WHERE {new_seq} <> cursors.seq",
                (instance, name, seq),
            )
            return cur.rowcount

    # -- the deployment's secret ----------------------------------------------------------

    async def shared_secret(self, candidate: bytes) -> bytes:
        """The token secret every server of the deployment uses: `candidate` if none is stored
        yet (the first server to start stores its own), else the stored one."""
        def read(conn: psycopg.Connection) -> bytes:
            with conn.transaction():
                conn.execute(
                    "INSERT INTO oubliette_secrets (name, value) VALUES ('server', %s) ON CONFLICT (name) DO NOTHING",
                    (candidate.decode("ascii"),),
                )
                row = conn.execute("SELECT value FROM oubliette_secrets WHERE name = 'server'").fetchone()
            assert row is not None
            return str(row[0]).encode("ascii")
        return await self._run(read)

    # -- instance leases (docs/SCALING.md, "Instance leases") ---------------------------

    async def take_lease(self, instance: str, server: str, ttl: float) -> str | None:
        """Make `server` the holder of `instance`'s lease for `ttl` seconds, whoever held it: a
        guest that connects takes its instance over. The previous holder if it was another
        server whose lease was still live (it drops its guest when it sees the loss), else None."""
        def write(conn: psycopg.Connection) -> str | None:
            with conn.transaction():
                row = conn.execute(
                    "SELECT server, expires_at > now() FROM instance_leases WHERE instance = %s FOR UPDATE", (instance,),
                ).fetchone()
                conn.execute(
                    "INSERT INTO instance_leases (instance, server, expires_at) "
                    "VALUES (%s, %s, now() + make_interval(secs => %s)) "
                    "ON CONFLICT (instance) DO UPDATE SET server = EXCLUDED.server, expires_at = EXCLUDED.expires_at",
                    (instance, server, ttl),
                )
            return row[0] if row is not None and row[0] != server and row[1] else None
        return await self._run(write)

    async def renew_leases(self, server: str, instances: list[str], ttl: float) -> set[str]:
        """Extend `server`'s own lease and its leases of `instances` by `ttl` seconds, in one
        transaction; the instances it still holds. A lease another server took is not touched (and
        not returned); a missing one (released, or never written) is taken again."""
        def write(conn: psycopg.Connection) -> set[str]:
            with conn.transaction():
                conn.execute(
                    "INSERT INTO server_leases (server, expires_at) VALUES (%s, now() + make_interval(secs => %s)) "
                    "ON CONFLICT (server) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                    (server, ttl),
                )
                if not instances:
                    return set()
                rows = conn.execute(
                    "INSERT INTO instance_leases (instance, server, expires_at) "
                    "SELECT name, %s, now() + make_interval(secs => %s) FROM unnest(%s::text[]) AS name "
                    "ON CONFLICT (instance) DO UPDATE SET expires_at = EXCLUDED.expires_at "
                    "WHERE instance_leases.server = EXCLUDED.server RETURNING instance",
                    (server, ttl, instances),
                ).fetchall()
            return {r[0] for r in rows}
        return await self._run(write)

    async def release_lease(self, instance: str, server: str) -> None:
        """Drop `server`'s lease of `instance` (its guest left); another server's lease is kept."""
        def write(conn: psycopg.Connection) -> None:
            with conn.transaction():
                conn.execute("DELETE FROM instance_leases WHERE instance = %s AND server = %s", (instance, server))
        await self._run(write)

    async def lease_holder(self, instance: str, *, live: bool = False) -> str | None:
        """The server named in `instance`'s lease (with `live`, only if it has not expired), None
        when nobody holds it."""
        def read(conn: psycopg.Connection) -> str | None:
            row = conn.execute(
                "SELECT server, expires_at > now() FROM instance_leases WHERE instance = %s", (instance,),
            ).fetchone()
            return None if row is None or (live and not row[1]) else str(row[0])
        return await self._run(read, read_only=True)

    async def abandoned_requests(self, grace: float, limit: int = 100) -> list[Frame]:
        """`caller_tool_request` and `approval_request` frames with no outcome whose waiting server
        died: its lease (the request's `server`) expired, or `expires_at` passed more than `grace`
        seconds ago (a live waiter stores its timeout at the deadline). An outcome is a
        `resolutions` row or, as one server records an approval's decision, a frame of the
        request's outcome types (`approval_resolved` for an approval)."""
        def read(conn: psycopg.Connection) -> list[Frame]:
            rows = conn.execute(
                "SELECT r.instance, r.seq, r.ts, r.channel, r.session_id, r.type, r.msg_id, r.reply_to, r.payload "
                "FROM frames r WHERE r.type IN ('caller_tool_request', 'approval_request') "
                "AND ((r.payload::jsonb ->> 'expires_at')::timestamptz < now() - make_interval(secs => %s) "
                "  OR EXISTS (SELECT 1 FROM server_leases l WHERE l.server = r.payload::jsonb ->> 'server' "
                "    AND l.expires_at < now())) "
                "AND NOT EXISTS (SELECT 1 FROM resolutions s WHERE s.instance = r.instance "
                "  AND s.request_id = r.payload::jsonb ->> 'request_id') "
                "AND NOT EXISTS (SELECT 1 FROM frames o WHERE o.instance = r.instance AND o.session_id = r.session_id "
                "  AND o.channel = r.channel AND o.seq > r.seq "
                "  AND o.type IN ('caller_tool_result', 'caller_tool_cancelled', 'approval_resolved') "
                "  AND o.payload::jsonb ->> 'request_id' = r.payload::jsonb ->> 'request_id') "
                "ORDER BY r.instance, r.seq LIMIT %s",
                (grace, limit),
            ).fetchall()
            return [
                make_frame(seq, ts, inst, ch, sid, typ, mid, rt, json.loads(payload))
                for inst, seq, ts, ch, sid, typ, mid, rt, payload in rows
            ]
        return await self._run(read, read_only=True)

    # -- retention -----------------------------------------------------------------------

    async def prune(self) -> int:
        """Apply retention to every instance now; return how many frames were deleted."""
        deleted = await self._run(self._prune_all)
        self._rewake_all()  # (its notices are on their way: nothing below a cut is answered from memory meanwhile)
        return deleted

    def _prune_all(self, conn: psycopg.Connection) -> int:
        total = 0
        names = [r[0] for r in conn.execute("SELECT name FROM instances")]
        conn.commit()
        for instance in names:
            total += self._prune_instance(conn, instance)
            self._appends_since_prune[instance] = 0
        return total

    def _prune_instance(self, conn: psycopg.Connection, instance: str) -> int:
        if self.retention_frames is None and self.retention_seconds is None:
            return 0
        with conn.transaction():
            row = conn.execute(
                "SELECT last_seq, pruned_below FROM instances WHERE name = %s FOR UPDATE", (instance,)
            ).fetchone()
            if row is None:
                return 0
            last, pruned = row

            def first_young(after: int, oldest_ts: str) -> int | None:
                young = conn.execute(
                    "SELECT seq FROM frames WHERE instance = %s AND seq > %s AND ts >= %s ORDER BY seq LIMIT 1",
                    (instance, after, oldest_ts),
                ).fetchone()
                return None if young is None else young[0]

            cut = retention_cut(pruned, last, self.retention_frames, self.retention_seconds, self._clock(), first_young)
            if cut <= pruned:
                return 0
            # The chain goes on across the gap: a checkpoint holds the hash of the last frame deleted.
            self._write_checkpoint(conn, instance, cut, RETENTION)
            deleted = conn.execute("DELETE FROM frames WHERE instance = %s AND seq <= %s", (instance, cut)).rowcount
            conn.execute("DELETE FROM resolutions WHERE instance = %s AND seq <= %s", (instance, cut))
            conn.execute("UPDATE instances SET pruned_below = %s WHERE name = %s", (cut, instance))
            # The instance alone (an earlier server's notice): every server forgets the frames it
            # heard of it, so a long poll below the cut reads and meets `CursorPruned`.
            conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, instance))
        if deleted:
            log.debug("frame store: pruned %d frames of instance %r (seq <= %d)", deleted, instance, cut)
        return deleted


def _bytea(value: bytes) -> bytes:
    """`value` as a bytea parameter in text format (what `LoopStatements` sends)."""
    return b"\\x" + value.hex().encode()


def _param(value: Any) -> bytes:
    """A query parameter as PostgreSQL's text form (a list as a text array)."""
    if isinstance(value, list):
        return ("{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in value) + "}").encode()
    return str(value).encode()


def _snapshot(instance: str, after_seq: int, rows: list[list[bytes | None]]) -> tuple[int, list[Frame]]:
    """`(last_seq, frames)` of the text rows of `_FRAMES_AFTER` or `_build`'s statement; `CursorPruned`
    if retention deleted frames after `after_seq` (in that same snapshot)."""
    if not rows:
        return 0, []
    last, pruned = int(rows[0][0] or 0), int(rows[0][1] or 0)
    if after_seq < pruned:
        raise CursorPruned(instance, after_seq, pruned + 1, empty=pruned >= last)
    text = bytes.decode
    return last, [
        make_frame(int(seq), text(ts), instance, text(ch), text(sid), text(typ), text(mid),  # type: ignore[arg-type]
                   None if rt is None else text(rt), json.loads(payload))  # type: ignore[arg-type]
        for _, _, seq, ts, ch, sid, typ, mid, rt, payload in rows if seq is not None
    ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
