"""The frame store's one interface, and the records every implementation shares.

The tether log (docs/TETHER.md, "Frames") has two homes: SQLite in the data directory (the
default, `store/sqlite.py`) and PostgreSQL for several servers sharing instances (`store/postgres.py`).
The rest of the server sees only `FrameStoreAPI`: every method that touches the database is
async, so an implementation may hand its work to a thread without blocking the Trio loop.
The records here (`FrameQuery`, `CursorPruned`, the frame builder, the argument checks) are
defined once, so both stores refuse the same input with the same message.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, Callable, Protocol, runtime_checkable

import attrs
import trio

from oubliette_runtime.state_changes import StateChanges
from protocol import RelayError, errors
from protocol.frames import FRAME_VERSION, TURN_END_TYPES, Frame, SessionRef
from protocol.framing import compact_json
from protocol.messages import is_append_id
from protocol.timestamps import format_ts

__all__ = [
    "APPEND_KEYS",
    "DEFAULT_LIMIT",
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_PRUNE_EVERY",
    "DEFAULT_RETENTION_FRAMES",
    "DECLARATION_KEY",
    "MAX_LIMIT",
    "MAX_RECORDED_INSTANCES",
    "MAX_SEQ",
    "OWNER_KEY",
    "SESSION_RECORD",
    "REQUIRED_KEYS",
    "CursorPruned",
    "FrameAppends",
    "FrameQuery",
    "FrameStoreAPI",
    "AnswerNotRecorded",
    "AppendIdReused",
    "OUTAGE_RETRY",
    "RecordedSession",
    "StoreUnavailable",
    "TURN_ENDS_INDEX",
    "TurnEnded",
    "check_checkpoint_every",
    "check_cursor_args",
    "check_instance",
    "check_resend",
    "check_retention",
    "check_timeout",
    "ended_turns",
    "ends_turn",
    "first_turn_ends_sql",
    "is_int",
    "format_ts",
    "make_frame",
    "when_store_is_back",
    "prepare_frame",
    "prepare_frames",
]

MAX_LIMIT = 200
#: The largest seq SQLite can hold (a signed 64-bit INTEGER); numbers from outside are
#: range-checked against it before they reach a query, which would raise OverflowError.
MAX_SEQ = 2**63 - 1
DEFAULT_LIMIT = 50
DEFAULT_RETENTION_FRAMES = 100_000
DEFAULT_PRUNE_EVERY = 1000
#: Frames of an instance between two checkpoints of its hash chain (store/chain.py, docs/AUDIT.md).
DEFAULT_CHECKPOINT_EVERY = 10_000
APPEND_KEYS = frozenset({"channel", "session_id", "type", "payload", "msg_id", "reply_to"})
REQUIRED_KEYS = frozenset({"channel", "session_id", "type", "payload"})

#: The type of the server's record of a session, `{owner, caller_tools?}` (core/server_owned.py
#: says who writes it). Defined here, the store's layer, because the store finds a session's
#: records by an index of its own, partial on this type (`session_records`).
SESSION_RECORD = "session_record"
#: The key of the session owner's identity (`CallerConnection.identity`) in a `session_record` payload.
OWNER_KEY = "owner"
#: The key of a declaration (`{caller_id, tools}`) in a `session_record` payload.
DECLARATION_KEY = "caller_tools"
#: How many instances `session_records` reports at most for one session id: the work of one
#: unknown id a caller sends is one bounded query, whatever the number of instances.
MAX_RECORDED_INSTANCES = 100


# --------------------------------------------------------------------------------------------
# Records


def make_frame(seq: int, ts: str, instance: str, channel: str, session_id: str, type: str, msg_id: str,
               reply_to: str | None, payload: dict[str, Any]) -> Frame:
    """The protocol's frame model for one stored row (the one converter every store uses)."""
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


#: The `FrameQuery` filters a frame's field must equal, when given (`FrameQuery.equal_filters`).
EQUAL_FILTERS = ("session_id", "channel", "reply_to")


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
        if not is_int(self.limit):
            raise TypeError(f"limit must be an integer, got {self.limit!r}")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {self.limit}")
        if not is_int(self.after_seq):
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

    def equal_filters(self) -> list[tuple[str, str]]:
        """`(field, value)` of each filter given that a frame's field must equal (`session_id`,
        `channel`, `reply_to`): what a store's statement writes as `field = value`."""
        return [(name, value) for name in EQUAL_FILTERS if (value := getattr(self, name)) is not None]

    def matches(self, channel: str, session_id: str, type: str, reply_to: str | None) -> bool:
        """Whether a frame with these fields is one this query asks for, seq and limit apart: the rule
        a store's statement applies (`equal_filters`, a NULL `reply_to` equal to no value, and the
        type one of `types`), so a frame known in memory is matched as a read would match it."""
        return ((self.channel is None or self.channel == channel)
                and (self.session_id is None or self.session_id == session_id)
                and (self.reply_to is None or self.reply_to == reply_to)
                and (self.types is None or type in self.types))


@attrs.define(frozen=True)
class RecordedSession:
    """What one instance's log records of a session (`FrameStoreAPI.session_records`): the owner
    identity of its first `session_record` that names one, and the declaration of its last one
    that carries one (None when none does)."""

    instance: str
    owner: str | None
    declared: dict[str, Any] | None


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON numbers from outside are checked with it)."""
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


class StoreDamaged(Exception):
    """The store's file cannot be read as a database at start (damaged, or not a database at all).

    Its message is the operator's one line: which file, what SQLite said, what to do."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"the frame store {path} is damaged or is not an SQLite database ({reason}); "
            "restore it from a backup, or move it away to start with an empty log"
        )
        self.path = path


class StoreUnavailable(RelayError):
    """The store's database cannot be reached (PostgreSQL down, pool exhausted past its timeout)
    or cannot write (SQLite: a full disk, a lock another process holds past the busy timeout).

    Raised instead of the driver's own errors, as a `RelayError` (INTERNAL_ERROR) so every door
    gives its peer this one clear message: a caller's tool error, a sandbox's error response,
    HTTP 503. The store recovers by itself when the database returns."""

    def __init__(self, message: str) -> None:
        super().__init__(errors.INTERNAL_ERROR, message)

    def __str__(self) -> str:
        return self.message

    @property
    def advice(self) -> str:
        """The message with what a client should do about it (a long poll's 503, a wait's tool error)."""
        return f"{self.message}; retry in a few seconds (the server reconnects to its store by itself)"

    def __reduce__(self) -> Any:  # keep pickling (and copying) working
        return (StoreUnavailable, (self.message,))


class AnswerNotRecorded(StoreUnavailable):
    """A caller's answer (`caller_tool_response`, `approval_response`, a progress report) whose
    frame the store could not write: it was not delivered either, and the request it answers is
    still pending, so the caller sends the same answer again once the store is back.

    An answer reaches the agent only after its frame is stored (docs/SECURITY.md, "Store first,
    then answer"); this is what the caller hears when the storing failed."""

    def __init__(self, what: str, request_id: str, cause: StoreUnavailable, *, until: str = "", again: str) -> None:
        deadline = f" until {until}" if until else ""
        super().__init__(
            f"{what} for '{request_id}' was not recorded, so it was not delivered ({cause.message}); "
            f"'{request_id}' is still pending{deadline}: send {again} again"
        )

    def __reduce__(self) -> Any:  # keep pickling (and copying) working
        return (_rebuild_not_recorded, (self.message,))


class TurnEnded(RelayError):
    """A turn end (`TURN_END_TYPES`) for a message whose turn has ended already: nothing was stored.

    A message's turn ends once (docs/SECURITY.md, "One turn end per message"): every frame that
    ends a turn fills the `ends_turn` column with the message's msg_id, and a unique index on
    (instance, `ends_turn`) makes the database refuse a second one, whichever path or server
    wrote it. `end` is the frame that ended the turn. An `INVALID_REQUEST` `RelayError`, so a door
    tells its peer as it is; the server's own paths (orphans, failed starts) take it as done."""

    def __init__(self, end: Frame) -> None:
        super().__init__(
            errors.INVALID_REQUEST,
            f"the turn of message {end.reply_to!r} has ended already (seq {end.seq}, {end.type}): a turn ends "
            "once; nothing was stored",
        )
        self.end = end

    def __reduce__(self) -> Any:  # keep pickling (and copying) working
        return (TurnEnded, (self.end,))


def _rebuild_not_recorded(message: str) -> AnswerNotRecorded:
    exc = AnswerNotRecorded.__new__(AnswerNotRecorded)
    StoreUnavailable.__init__(exc, message)
    return exc


class AppendIdReused(RelayError):
    """An `append_once` whose `append_id` the instance's log holds for another frame (a session,
    type, `reply_to` or payload that differs): not a resend, so it is refused (INVALID_PARAMS,
    naming the id) rather than answered with the stored frame, which would acknowledge a frame
    that was never stored (docs/TETHER.md, "Exactly-once appends")."""

    def __init__(self, append_id: str, fields: list[str], seq: int) -> None:
        super().__init__(
            errors.INVALID_PARAMS,
            f"append_id {append_id!r} was used for another frame (seq {seq}; its {', '.join(fields)} differ): "
            "a resend must be the same frame; choose a new append_id for a new frame",
            {"append_id": append_id, "differs": fields},
        )

    def __reduce__(self) -> Any:  # keep pickling (and copying) working
        return (_rebuild_reused, (self.message, self.data))


def _rebuild_reused(message: str, data: Any) -> AppendIdReused:
    exc = AppendIdReused.__new__(AppendIdReused)
    RelayError.__init__(exc, errors.INVALID_PARAMS, message, data)
    return exc


#: Canonical JSON (sorted keys): two values are the same when their texts are equal (a frame's
#: payload resent, an approval answered again). Not `==`: Python takes 1, 1.0 and true for one
#: value, which JSON does not.
canonical_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode


def check_resend(
    stored: Frame, append_id: str, channel: str, session_id: str, type: str, payload: dict[str, Any],
    reply_to: str | None,
) -> None:
    """`AppendIdReused` unless `stored` (the frame of `append_id`) is the frame being appended again:
    the same session, type, `reply_to` and payload (canonical JSON). Its `msg_id` is not compared:
    the server chose it for the stored frame (a guest never sends one)."""
    differs = [
        name for name, same in (
            ("session", (stored.session.channel, stored.session.id) == (channel, session_id)),
            ("type", stored.type == type),
            ("reply_to", stored.reply_to == reply_to),
            ("payload", canonical_json(stored.payload) == canonical_json(payload)),
        ) if not same
    ]
    if differs:
        raise AppendIdReused(append_id, differs, stored.seq)


#: The first pause before a store operation that met `StoreUnavailable` is tried again (a wait
#: on the log reads again after it; `when_store_is_back` doubles it up to `OUTAGE_RETRY_MAX`).
OUTAGE_RETRY = 1.0
OUTAGE_RETRY_MAX = 30.0


async def when_store_is_back(attempt: Callable[[], Any]) -> Any:
    """Run `attempt()` (awaitable) again after a pause each time it raises `StoreUnavailable`
    (1 s, doubling to 30 s), until it succeeds: for an outcome that must reach the log once the
    store recovers (an end the server decided while it was down). Cancellation: stops trying."""
    delay = OUTAGE_RETRY
    while True:
        await trio.sleep(delay)
        try:
            return await attempt()
        except StoreUnavailable:
            delay = min(delay * 2, OUTAGE_RETRY_MAX)


# --------------------------------------------------------------------------------------------
# One turn end per message: the rule both stores keep in their `ends_turn` column

_TURN_ENDS = frozenset(TURN_END_TYPES)
#: The unique index on (instance, `ends_turn`) of both stores: a second end of one turn breaks it.
TURN_ENDS_INDEX = "frames_turn_ends"
_TURN_END_SQL = ", ".join(f"'{t}'" for t in TURN_END_TYPES)


def ends_turn(type: str, reply_to: str | None) -> str | None:
    """The msg_id of the message whose turn a frame of `type` replying to `reply_to` ends, or None:
    what the store writes in the frame's `ends_turn` column, unique per instance."""
    return reply_to if reply_to is not None and type in _TURN_ENDS else None


def ended_turns(prepared: list[Prepared]) -> list[str]:
    """The msg_ids whose turns these frames end (usually none); `ValueError` for two ends of one
    turn in one append (the database would refuse the whole append)."""
    ends = [msg_id for _, _, typ, _, rt, _, _, _ in prepared if (msg_id := ends_turn(typ, rt)) is not None]
    if len(set(ends)) != len(ends):
        raise ValueError("one append holds two ends of one turn; a turn ends once")
    return ends


def first_turn_ends_sql(key: str) -> str:
    """The backfill of an older log (`key`: the frames' instance column): `ends_turn` set on the
    first end of each message's turn only, so the unique index can be built over a log that
    already holds a second end (stored before the index existed; readers take the first)."""
    return (
        f"UPDATE frames SET ends_turn = reply_to WHERE type IN ({_TURN_END_SQL}) AND reply_to IS NOT NULL "
        f"AND NOT EXISTS (SELECT 1 FROM frames e WHERE e.{key} = frames.{key} AND e.reply_to = frames.reply_to "
        f"AND e.type IN ({_TURN_END_SQL}) AND e.seq < frames.seq)"
    )


# --------------------------------------------------------------------------------------------
# Argument checks shared by the stores


#: `(channel, session_id, type, msg_id, reply_to, payload_json, payload_copy, append_id)`.
Prepared = tuple[str, str, str, str, "str | None", str, dict, "str | None"]


# Payload values whose JSON text decodes to an equal value of the same type (see prepare_frame).
_FLAT_TYPES = frozenset({str, int, float, bool, type(None)})


def prepare_frame(
    channel: Any, session_id: Any, type: Any, payload: Any, msg_id: Any, reply_to: Any, append_id: Any = None,
) -> Prepared:
    """Check one frame's fields and encode its payload: a `Prepared` tuple; `ValueError`/`TypeError`
    name the bad field."""
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
    if append_id is not None and not is_append_id(append_id):
        raise ValueError(f"append_id must be 1-64 of A-Z a-z 0-9 _ - or None, got {append_id!r}")
    # allow_nan=False: NaN/Infinity are not JSON.  The returned frame holds exactly what a later
    # query returns (and is not shared with the caller): the decoded text, or, for a flat payload
    # (string keys, values of exactly str/int/float/bool/None), a plain copy, which decodes
    # to an equal dict of the same types at a fraction of the cost (most frames are flat).
    text = compact_json(payload)
    for key, value in payload.items():
        if key.__class__ is not str or value.__class__ not in _FLAT_TYPES:
            return channel, session_id, type, msg_id, reply_to, text, json.loads(text), append_id
    return channel, session_id, type, msg_id, reply_to, text, dict(payload), append_id


def prepare_frames(frames: list[dict]) -> list[Prepared]:
    """`prepare_frame` for each dict of `append_many` (its keys are `append`'s keyword arguments)."""
    prepared = []
    for i, f in enumerate(frames):
        if not isinstance(f, dict):
            raise TypeError(f"frames[{i}] must be a dict, got {f.__class__.__name__}")
        unknown = f.keys() - APPEND_KEYS
        if unknown:
            raise TypeError(f"frames[{i}] has unknown keys {sorted(unknown)}")
        missing = REQUIRED_KEYS - f.keys()
        if missing:
            raise TypeError(f"frames[{i}] is missing {sorted(missing)}")
        prepared.append(
            prepare_frame(f["channel"], f["session_id"], f["type"], f["payload"], f.get("msg_id"), f.get("reply_to"))
        )
    return prepared


def retention_cut(
    pruned: int, last: int, retention_frames: int | None, retention_seconds: float | None, now: float,
    first_young: Callable[[int, str], "int | None"],
) -> int:
    """The seq retention deletes up to (inclusive), both stores' one rule: keep the last
    `retention_frames` frames, and only frames not older than `retention_seconds`.

    `first_young(after_seq, oldest_ts)` is the store's lookup of the first frame after
    `after_seq` stamped at or after `oldest_ts` (None: there is none). Nothing to delete: `pruned`.
    """
    cut = pruned
    if retention_frames is not None:
        cut = max(cut, last - retention_frames)
    if retention_seconds is not None:
        young = first_young(cut, format_ts(now - retention_seconds))
        cut = last if young is None else max(cut, young - 1)
    return cut


def check_instance(instance: Any) -> None:
    """`ValueError` unless `instance` is a non-empty string."""
    if not isinstance(instance, str) or not instance:
        raise ValueError(f"instance must be a non-empty string, got {instance!r}")


def check_retention(retention_frames: Any, retention_seconds: Any, prune_every: Any) -> None:
    """`ValueError` naming the first bad retention setting (both stores take the same ones)."""
    if retention_frames is not None and (not is_int(retention_frames) or retention_frames < 1):
        raise ValueError(f"retention_frames must be a positive integer or None, got {retention_frames!r}")
    if retention_seconds is not None and not (
        isinstance(retention_seconds, (int, float)) and retention_seconds > 0 and math.isfinite(retention_seconds)
    ):
        raise ValueError(f"retention_seconds must be a positive number or None, got {retention_seconds!r}")
    if not is_int(prune_every) or prune_every < 1:
        raise ValueError(f"prune_every must be a positive integer, got {prune_every!r}")


def check_checkpoint_every(checkpoint_every: Any) -> None:
    """`ValueError` unless `checkpoint_every` is a positive integer or None (no periodic checkpoints)."""
    if checkpoint_every is not None and (not is_int(checkpoint_every) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be a positive integer or None, got {checkpoint_every!r}")


def check_cursor_args(instance: Any, name: Any, seq: Any) -> None:
    """`ValueError` unless a named cursor's instance, name and seq can be stored."""
    if not isinstance(instance, str) or not instance or not isinstance(name, str) or not name:
        raise ValueError("instance and cursor name must be non-empty strings")
    if not is_int(seq) or seq < 0:
        raise ValueError(f"cursor seq must be an integer >= 0, got {seq!r}")
    if seq > MAX_SEQ:
        raise ValueError(f"cursor seq must be <= {MAX_SEQ} (2^63 - 1), got {seq}")


def check_timeout(timeout: Any) -> None:
    """`ValueError` unless `timeout` is a number of seconds >= 0 (a long poll's wait)."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")


# --------------------------------------------------------------------------------------------
# The interface


class ParkedPoll:
    """A long poll waiting on an instance (`LongPollWaiters._waiting`): its query, whose filters say
    which frames it wants; where its store keeps it, the last seq it has looked past; and the event
    that wakes it (`armed`)."""

    __slots__ = ("q", "seen", "woken")

    def __init__(self, q: FrameQuery, seen: int | None) -> None:
        self.q = q
        self.seen = seen
        self.woken = trio.Event()

    def armed(self) -> trio.Event:
        """The event the next wake sets: taken before the poll looks at the log, so that an append
        committed during the look sets it, and the wait after the look returns at once."""
        if self.woken.is_set():
            self.woken = trio.Event()
        return self.woken


class LongPollWaiters:
    """The wake-ups of this process's long polls (both stores): each waiting poll is `_waiting`,
    a `ParkedPoll` with its query and its own `trio.Event`.

    An append whose frames' fields the store knows wakes only the polls that may want one of them
    (`_wake_for`; one that does not is moved past them where its store keeps what it has seen);
    otherwise, or when a store's fault or a lost notice leaves it unknown what was committed, it
    wakes every poll of the instance (`_wake_instance`) or of the store (`_wake_all`). An instance
    nobody waits on holds nothing. `waiters_changed` is signalled as each waiter comes and goes
    (what a test waits on to know a poll is parked).
    """

    def __init__(self) -> None:
        self._waiters: dict[str, list[ParkedPoll]] = {}
        """The long polls waiting on each instance (a list: most instances have one, and a list of
        one is the smallest collection; 19,000 sandboxes' deliveries wait here, docs/SCALING.md)."""
        self.waiters_changed = StateChanges()
        self._woken_all = 0
        """How many times every waiter was woken (`_wake_all`): a waiter that sees it move reads the log."""

    @staticmethod
    async def _woken_by(event: trio.Event, deadline: float) -> bool:
        """Wait for `event` until `deadline`; whether the deadline passed first. Without a deadline
        it takes no cancel scope: each idle guest's delivery waits here as long as it is connected,
        and a scope is ~0.7 KB of 19,000 sandboxes' memory (docs/SCALING.md)."""
        if deadline == math.inf:
            await event.wait()
            return False
        with trio.move_on_at(deadline) as scope:
            await event.wait()
        return scope.cancelled_caught

    def _wake_instance(self, instance: str) -> None:
        for parked in self._waiters.get(instance, ()):
            parked.woken.set()

    def _wake_for(self, instance: str, first: int, fields: list[FrameFields]) -> None:
        """Frames `first`.. of `instance` are committed (their filter fields): wake each of its
        waiters that may want one. One that wants none of them and had looked up to just before
        them is moved past them (`seen`), so that its next look starts after them."""
        for parked in self._waiters.get(instance, ()):
            if any(parked.q.matches(*frame) for frame in fields):
                parked.woken.set()
            elif parked.seen == first - 1:
                parked.seen = first + len(fields) - 1

    def _wake_all(self) -> None:
        self._woken_all += 1
        for instance in self._waiters:
            self._wake_instance(instance)

    @contextmanager
    def _waiting(self, instance: str, q: FrameQuery, seen: int | None = None) -> Iterator[ParkedPoll]:
        """A long poll parked on `instance` for frames matching `q` (its filters: not its
        `after_seq`), having looked up to `seen` (None: its store does not keep it)."""
        parked = ParkedPoll(q, seen)
        if instance not in self._waiters:
            self._first_waiter(instance)
        self._waiters.setdefault(instance, []).append(parked)
        self.waiters_changed.changed()
        try:
            yield parked
        finally:
            polls = self._waiters[instance]
            polls.remove(parked)
            if not polls:
                del self._waiters[instance]
                self._last_waiter_left(instance)
            self.waiters_changed.changed()

    def _first_waiter(self, instance: str) -> None:
        """A long poll waits on `instance`, where none did (a store that keeps what it heard of it)."""

    def _last_waiter_left(self, instance: str) -> None:
        """The last long poll waiting on `instance` returned."""

    def waiter_count(self, instance: str | None = None) -> int:
        """How many tasks of this process are in `wait_for_frames` for `instance` (or for all)."""
        if instance is None:
            return sum(map(len, self._waiters.values()))
        return len(self._waiters.get(instance, ()))


class FrameAppends(LongPollWaiters):
    """The append methods both stores share: arguments checked and prepared once, here.

    A store implements `_append(instance, prepared)` (every frame or none, consecutive seqs,
    one commit), `_append_claimed(instance, request_id, prepared)` (the frame, or None when
    the request's outcome was recorded before: where the claim lives is the store's own) and
    `_append_once(instance, prepared)` (the frame of the prepared `append_id`, stored now or before).
    Each stores `ends_turn` (the column of `ends_turn(type, reply_to)`) and raises `TurnEnded` with
    the stored end when its unique index refuses a frame.
    """

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
        append_id: str | None = None,
    ) -> Frame:
        """Append one frame with the next seq of `instance` (`msg_id` defaults to "m-" and 32
        random hex digits) and wake the instance's waiters; committed when this returns; if it
        raises, nothing was stored. With `append_id`, as `append_once`: the frame stored with
        that id before, if there is one. A second end of a message's turn raises `TurnEnded`."""
        if append_id is not None:
            return (await self.append_once(
                instance, append_id, channel=channel, session_id=session_id, type=type, payload=payload,
                msg_id=msg_id, reply_to=reply_to,
            ))[0]
        prepared = [prepare_frame(channel, session_id, type, payload, msg_id, reply_to)]
        return (await self._append(instance, prepared))[0]

    async def append_once(
        self,
        instance: str,
        append_id: str,
        *,
        channel: str,
        session_id: str,
        type: str,
        payload: dict,
        msg_id: str | None = None,
        reply_to: str | None = None,
    ) -> tuple[Frame, bool]:
        """Append one frame unless `instance` already has the frame of `append_id` (a resend):
        `(frame, True)` when this call stored it, `(the frame stored before, False)` when not
        (nothing is stored, nobody is woken). The check and the append are one step, also
        between servers sharing the store: of two appends racing with one id, one stores.

        Raises: `AppendIdReused` when the frame stored with the id is another frame (`check_resend`)."""
        if append_id is None:
            raise ValueError("append_once needs an append_id")
        prepared = prepare_frame(channel, session_id, type, payload, msg_id, reply_to, append_id)
        frame, stored = await self._append_once(instance, prepared)
        if not stored:
            check_resend(frame, append_id, channel, session_id, type, prepared[6], reply_to)
        return frame, stored

    async def append_many(self, instance: str, frames: list[dict]) -> list[Frame]:
        """Append several frames in one transaction (consecutive seqs, one commit, one wake-up);
        each dict holds `append`'s keyword arguments."""
        return await self._append(instance, prepare_frames(frames))

    async def append_outcome(
        self,
        instance: str,
        request_id: str,
        *,
        channel: str,
        session_id: str,
        type: str,
        payload: dict,
        msg_id: str | None = None,
        reply_to: str | None = None,
    ) -> Frame | None:
        """Append request `request_id`'s one outcome frame, or nothing if one was recorded before
        (by any server sharing the store): the frame when this call won, None when it lost."""
        if not isinstance(request_id, str) or not request_id or "\x00" in request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prepared = [prepare_frame(channel, session_id, type, payload, msg_id, reply_to)]
        return await self._append_claimed(instance, request_id, prepared)

    async def _append(self, instance: str, prepared: list[Prepared]) -> list[Frame]:
        raise NotImplementedError

    async def _append_claimed(self, instance: str, request_id: str, prepared: list[Prepared]) -> Frame | None:
        raise NotImplementedError

    async def _append_once(self, instance: str, prepared: Prepared) -> tuple[Frame, bool]:
        raise NotImplementedError


@runtime_checkable
class FrameStoreAPI(Protocol):
    """What the server needs of a frame store (SQLite `store.FrameStore`, PostgreSQL
    `postgres.PostgresFrameStore`); `tests/server/store/test_conformance.py` holds both to it.

    Guarantees (docs/TETHER.md): `seq` per instance is gapless, strictly increasing in commit
    order and never reset (not by retention, not by a restart); a frame is committed when
    `append` returns; `wait_for_frames` wakes on any append to the instance, also one made
    by another store object on the same database.

    Owns: its database connections; `running()` holds whatever runs in the background (the
    PostgreSQL listener) and closes the store on exit.
    Raises: `CursorPruned` from `query`/`wait_for_frames`; `ValueError`/`TypeError` for bad
    arguments (nothing stored); `StoreUnavailable` when the database cannot be reached.
    """

    def describe(self) -> str:
        """The store's kind and location without secrets (for /v1/health and logs)."""
        ...

    def running(self) -> AbstractAsyncContextManager[None]:
        """Run the store's background work for the body of an `async with`; close it after."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the store is closed."""
        ...

    @property
    def shared(self) -> bool:
        """Whether other servers may append to the same log (PostgreSQL) or this one is alone (SQLite)."""
        ...

    async def append(
        self, instance: str, *, channel: str, session_id: str, type: str, payload: dict,
        msg_id: str | None = None, reply_to: str | None = None, append_id: str | None = None,
    ) -> Frame:
        """Append one frame with the next seq of `instance`; committed when it returns (with
        `append_id`: the frame stored with it before, if any, as `append_once`).

        A frame that ends a turn (`TURN_END_TYPES`, replying to a message) is stored only if that
        turn has no end yet: the frames table has a unique index on (instance, `ends_turn`), so of
        two ends of one turn, by any path or server, one is stored and the other raises `TurnEnded`
        (carrying the stored end), nothing stored and no seq spent (docs/SECURITY.md, "One turn end
        per message")."""
        ...

    async def append_once(
        self, instance: str, append_id: str, *, channel: str, session_id: str, type: str, payload: dict,
        msg_id: str | None = None, reply_to: str | None = None,
    ) -> tuple[Frame, bool]:
        """Append one frame unless `instance` has the frame of `append_id` already: `(frame, True)`
        when this call stored it, `(the stored frame, False)` when it was stored before.

        A resent guest append stores once (docs/TETHER.md, "Exactly-once appends"): the frames
        table has a unique index on (instance, append_id), and the check, the seq and the insert
        are one step (SQLite: the single writer; PostgreSQL: one statement, the unique index
        deciding between servers racing). A resend is the same frame: an id stored with another
        session, type, `reply_to` or payload raises `AppendIdReused` (`check_resend`)."""
        ...

    async def frame_of_append_id(self, instance: str, append_id: str) -> Frame | None:
        """The frame of `instance` stored with `append_id` (`append_once`), or None."""
        ...

    async def append_many(self, instance: str, frames: list[dict]) -> list[Frame]:
        """Append several frames in one transaction (consecutive seqs, one wake-up)."""
        ...

    async def append_outcome(
        self, instance: str, request_id: str, *, channel: str, session_id: str, type: str, payload: dict,
        msg_id: str | None = None, reply_to: str | None = None,
    ) -> Frame | None:
        """Append the one outcome frame of request `request_id` of `instance`, or nothing if an
        outcome was already recorded: the frame when this call won, None when it lost.

        The claim and the frame are one transaction (PostgreSQL: a row of `resolutions`, whose
        primary key decides between servers racing; SQLite: the claim is in this process, the
        only one on its log), so a request is resolved once whichever server answers it."""
        ...

    async def query(self, instance: str, q: FrameQuery) -> list[Frame]:
        """Frames of `instance` matching `q`, by seq ascending, at most `q.limit`."""
        ...

    async def wait_for_frames(self, instance: str, q: FrameQuery, timeout: float) -> tuple[list[Frame], bool]:
        """Long poll: `query`, waiting up to `timeout` seconds for a match; `(frames, timed_out)`."""
        ...

    async def last_seq(self, instance: str) -> int:
        """The highest seq ever assigned for `instance` (0 if none)."""
        ...

    async def pruned_below(self, instance: str) -> int:
        """Every frame of `instance` with `seq <=` this was deleted by retention (0 if none)."""
        ...

    async def instances(self) -> list[str]:
        """Names of every instance that has ever had a frame appended, sorted."""
        ...

    async def session_records(
        self, channel: str, session_id: str, limit: int = MAX_RECORDED_INSTANCES, instance: str | None = None,
        owner: str | None = None,
    ) -> list[RecordedSession]:
        """The instances whose log holds a `session_record` of (`channel`, `session_id`), at most
        `limit` of them (only `instance`, when given; with `owner`, only those whose first owner is
        `owner`), each with the owner and last declaration it records: one query, served by an index
        on the records alone, however many instances the store has. The one home of the rule "the
        first owner recorded, the last declaration". `owner` finds a caller's own sessions however
        many instances other callers recorded the same id in (a session id is a name, not a secret)."""
        ...

    async def get_cursor(self, instance: str, name: str) -> int:
        """The durable cursor `name` of `instance` (0 if never set)."""
        ...

    async def set_cursor(self, instance: str, name: str, seq: int) -> None:
        """Set (and commit) the durable cursor `name` of `instance`."""
        ...

    async def advance_cursor(self, instance: str, name: str, seq: int) -> bool:
        """Move the cursor forward to `seq` in one statement (never back); True if it moved."""
        ...

    async def prune(self) -> int:
        """Apply retention to every instance now; how many frames were deleted."""
        ...

    def waiter_count(self, instance: str | None = None) -> int:
        """How many tasks of this process wait in `wait_for_frames` for `instance` (or for all)."""
        ...

    @property
    def waiters_changed(self) -> StateChanges:
        """Signalled as `waiter_count` changes (`LongPollWaiters`)."""
        ...

    async def shared_secret(self, candidate: bytes) -> bytes | None:
        """The deployment's token secret kept in the store, `candidate` stored if it has none
        (the first server wins); None if this store keeps no secret (SQLite: the data dir does)."""
        ...

    async def check_available(self, timeout: float) -> None:
        """Raise `StoreUnavailable` (saying why) unless the database answers within `timeout`
        seconds and, for a shared store, its cross-server wake-ups arrive (the readiness probe)."""
        ...


# --------------------------------------------------------------------------------------------
# What only a store shared by several servers can do (PostgreSQL): separate interfaces, asked for


@runtime_checkable
class LeaseStore(Protocol):
    """The store's lease methods (`postgres.PostgresFrameStore`), for cluster/leases.py."""

    async def take_lease(self, instance: str, server: str, ttl: float) -> str | None:
        """Take `instance`'s lease; the previous live holder if another server."""
        ...

    async def renew_leases(self, server: str, instances: list[str], ttl: float) -> set[str]:
        """Renew `server`'s own lease and its leases of `instances`; the instances it still holds."""
        ...

    async def release_lease(self, instance: str, server: str) -> None:
        """Drop `server`'s lease of `instance`."""
        ...

    async def lease_holder(self, instance: str, *, live: bool = False) -> str | None:
        """The server named in `instance`'s lease (with `live`, unexpired only), or None."""
        ...


@runtime_checkable
class AbandonedStore(Protocol):
    """What the sweep of abandoned requests asks of the store (`postgres.PostgresFrameStore`)."""

    async def abandoned_requests(self, grace: float, limit: int = 100) -> list[Frame]:
        """Requests without an outcome whose server's lease expired, or whose `expires_at` passed more than `grace` seconds ago."""
        ...


#: What a notice of an append tells of each frame (`store.postgres.notice_fields`): the fields a
#: reader filters on, `(channel, session_id, type, reply_to)`.
FrameFields = tuple[str, str, str, "str | None"]


class AppendNoticeHook(Protocol):
    """Who hears of every append to a shared log, by any server (`store.postgres`'s LISTEN): the log tail."""

    def appended(self, instance: str, first: int | None, last: int | None, fields: list[FrameFields] | None = None) -> None:
        """Frames `first`..`last` of `instance` were committed (None, None: a notice without seqs);
        `fields`: each one's filter fields, when the notice names them."""
        ...

    def missed(self) -> None:
        """Notices may have been lost (the listener reconnected): read again from where you were."""
        ...


@runtime_checkable
class AppendNotices(Protocol):
    """A shared store's notices of appends and the read that follows each (`store.postgres.PostgresFrameStore`),
    for the log tail."""

    def hear_appends(self, hook: AppendNoticeHook) -> None:
        """Tell `hook` of every append any server commits, and of notices lost, from now on."""
        ...

    async def frames_after(self, instance: str, after_seq: int, limit: int) -> list[Frame]:
        """The frames of `instance` after `after_seq`, at most `limit`; `CursorPruned` as `query`."""
        ...

    def known_frames(self, instance: str, q: FrameQuery) -> list[Frame] | None:
        """The first frames `query` would return that this server knows whole without reading (its
        appends, notices heard), every frame between them known; None when it knows none so."""
        ...


@runtime_checkable
class SharedStoreAPI(FrameStoreAPI, LeaseStore, AbandonedStore, AppendNotices, Protocol):
    """A frame store several servers share: the log, the instance leases, the abandoned-requests
    sweep and the notices of appends."""


def shared_store(store: FrameStoreAPI) -> SharedStoreAPI | None:
    """`store` with its shared-store capabilities, or None when this server is alone on its log.

    Raises: `TypeError` for a store that says it is shared but lacks a capability (a bug in the store).
    """
    if not store.shared:
        return None
    if not isinstance(store, SharedStoreAPI):
        raise TypeError(f"{store.describe()} is shared but lacks the lease or sweep methods of SharedStoreAPI")
    return store
