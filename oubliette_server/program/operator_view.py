"""An operator's view of a deployment: `oubliette-server status` and `tail` (docs/OBSERVABILITY.md).

Both read the frame log from their own process, beside the running server(s), and write
nothing: with SQLite through `FrameStore.reader` (WAL lets a reader run beside the writer; the
server's data directory is not locked), with PostgreSQL as one more client of the database
(`retention` off, so the observer prunes nothing). The queries here return plain data
(`StatusReport`, frames); the formatting functions turn it into a table or JSON lines.

What each fact is read from, so that it is true whichever server wrote it:

- instances: every instance with frames (`FrameStoreAPI.instances`), and their last seq;
- where a guest is connected: with PostgreSQL, the instance's live lease (`cluster/leases.py`),
  which names the server holding it; with SQLite the log says nothing of connections, so the
  running server is asked (`GET /v1/health` on `--http`, or on the first HTTP listener its
  `serving.json` names, serving_file.py), else it is reported as unknown, never guessed from
  old frames;
- sessions: one pass over each instance's retained frames: frame count, last activity (the
  newest frame's time), the owner and declared caller tools from the server's own
  `session_record` frames (server_owned.py), which every server writes, on SQLite as on
  PostgreSQL (a session opened before they were written, or a tether session, has none);
- pending requests: a `caller_tool_request` with no `caller_tool_result`/`caller_tool_cancelled`,
  an `approval_request` with no `approval_resolved`, with their age and `expires_at` as the
  request frame states it.

`tail` follows one instance's frames as `kubectl logs -f` does: `wait_for_frames` in a loop.
With PostgreSQL a wait is woken by the store's LISTEN at once; with SQLite nothing in this
process appends, so each wait lasts `poll_interval` and then reads again: a bounded poll,
the only way one process learns of another's SQLite commits. An instance with no frames that
is not configured gets one stderr line saying so (`unknown_instance_notice`), and is followed
all the same: an instance exists from its first guest's frame on, with nothing to configure.

What a sandbox, a caller or an HTTP client wrote reaches the operator's terminal only escaped
(oubliette_runtime/peer_text.py): every character that is not printable — C0 and C1 controls (an 8-bit
CSI, U+009B, drives a terminal as ESC [ does), the bidi overrides and isolates — is written as an
escape, in the table and `tail` lines as in `--json` (docs/SECURITY.md, "Peer strings in log
lines and on the terminal"); a frame type is shown at most `MAX_FRAME_TYPE_CHARS` long.
"""

from __future__ import annotations

import datetime
import http.client
import json
import socket
import sys
from typing import Any, AsyncIterator, Protocol, Sequence, cast

import attrs
import trio

from oubliette_runtime.peer_text import bounded, escape, json_text
from protocol import Frame
from protocol.frames import MAX_FRAME_TYPE_CHARS

from ..core.server_owned import DECLARATION_KEY, OWNER_KEY, SESSION_RECORD
from ..store.api import MAX_LIMIT, CursorPruned, FrameQuery, FrameStoreAPI

#: Request frame types, each with the types of frames that end it.
REQUESTS = {
    "caller_tool_request": ("caller_tool_result", "caller_tool_cancelled"),
    "approval_request": ("approval_resolved",),
}
OUTCOMES = {outcome: request for request, outcomes in REQUESTS.items() for outcome in outcomes}
#: How long `tail` waits on a SQLite store before it reads again (seconds).
DEFAULT_POLL_INTERVAL = 0.5
#: How long a summary of a payload in a `tail` line may be (characters).
SUMMARY_CHARS = 100


@attrs.frozen
class GuestView:
    """Where an instance's guest is connected, and how that is known (`lease`, `health`, `unknown`)."""

    connected: bool | None
    server: str | None
    source: str


@attrs.frozen
class PendingView:
    """A request still waiting for its outcome."""

    kind: str
    request_id: str
    tool: str | None
    seq: int
    requested_at: str
    age_seconds: float
    expires_at: str | None
    server: str | None


@attrs.frozen
class SessionView:
    """One conversation of an instance, as its frames tell it."""

    channel: str
    id: str
    frames: int
    last_seq: int
    last_activity: str
    owner: str | None
    owner_recorded: bool
    caller_id: str | None
    caller_tools: list[str]
    pending: list[PendingView]


@attrs.frozen
class InstanceView:
    """One instance: its log's end, its guest and its sessions."""

    name: str
    last_seq: int
    guest: GuestView
    sessions: list[SessionView]


@attrs.frozen
class StatusReport:
    """What `oubliette-server status` prints."""

    store: str
    shared: bool
    instances: list[InstanceView]

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON data (`status --json`)."""
        return attrs.asdict(self)


class Liveness(Protocol):
    """Where an instance's guest is connected (a strategy chosen by the store kind)."""

    async def guest(self, instance: str) -> GuestView:
        """The instance's guest connection as this source knows it."""
        ...


class LeaseStore(Protocol):
    """The PostgreSQL store's lease lookup (`postgres.PostgresFrameStore.lease_holder`)."""

    async def lease_holder(self, instance: str, *, live: bool = False) -> str | None:
        """The server named in the instance's lease (live only, with `live`)."""
        ...


@attrs.frozen
class LeaseLiveness:
    """PostgreSQL: the instance's live lease names the server its guest is connected to."""

    store: LeaseStore

    async def guest(self, instance: str) -> GuestView:
        """Connected where the unexpired lease says; not connected without one."""
        holder = await self.store.lease_holder(instance, live=True)
        return GuestView(connected=holder is not None, server=holder, source="lease")


@attrs.frozen
class HealthLiveness:
    """SQLite with the running server's answer to `GET /v1/health` (its connected instances)."""

    server: str | None
    connected: frozenset[str]

    async def guest(self, instance: str) -> GuestView:
        """Connected if the server listed the instance (a guest or a client of it is connected there)."""
        await trio.lowlevel.checkpoint()
        here = instance in self.connected
        return GuestView(connected=here, server=self.server if here else None, source="health")


class UnknownLiveness:
    """SQLite with no server to ask: the log does not say who is connected, so neither does status."""

    async def guest(self, instance: str) -> GuestView:
        """Unknown."""
        await trio.lowlevel.checkpoint()
        return GuestView(connected=None, server=None, source="unknown")


#: The GUEST column when no server could be asked.
UNKNOWN_GUEST = "unknown (no server to ask: none running on this data dir, no --http)"
#: How long status waits for the running server's `/v1/health` answer (seconds).
HEALTH_TIMEOUT = 5.0


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def ask_health(bind: str, token: str, timeout: float = HEALTH_TIMEOUT) -> HealthLiveness:
    """Ask the server listening at `bind` (`HOST:PORT` or `unix:PATH`, as `--http` takes it) which
    instances are connected to it (`GET /v1/health`, with the HTTP admin `token` on TCP).

    Raises: `OSError` when it cannot be reached or answers anything but 200 JSON (one line).
    """
    if bind.startswith("unix:"):
        connection: http.client.HTTPConnection = _UnixHTTPConnection(bind[len("unix:"):], timeout)
    else:
        host, _, port = bind.rpartition(":")
        connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        connection.request("GET", "/v1/health", headers={"Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise OSError(f"cannot ask the server at {bind} for its connected instances: {exc}") from None
    finally:
        connection.close()
    try:
        answer = json.loads(body) if response.status == 200 else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("connected_instances"), list):
        raise OSError(f"the server at {bind} answered /v1/health with HTTP {response.status}, not its status")
    server = answer.get("server")
    server_id = server.get("id") if isinstance(server, dict) and isinstance(server.get("id"), str) else None
    return HealthLiveness(server=server_id, connected=frozenset(str(i) for i in answer["connected_instances"]))


async def all_frames(store: FrameStoreAPI, instance: str, query: FrameQuery) -> AsyncIterator[Frame]:
    """Every retained frame of `instance` matching `query` from its `after_seq` on, page by page
    (a start retention pruned meanwhile skips to what is kept)."""
    query = attrs.evolve(query, limit=MAX_LIMIT)
    while True:
        try:
            page = await store.query(instance, query)
        except CursorPruned as exc:
            query = attrs.evolve(query, after_seq=exc.first_seq - 1)
            continue
        for frame in page:
            yield frame
        if len(page) < MAX_LIMIT:
            return
        query = attrs.evolve(query, after_seq=page[-1].seq)


@attrs.define
class _SessionScan:
    channel: str
    id: str
    frames: int = 0
    last_seq: int = 0
    last_activity: str = ""
    owner: str | None = None
    recorded: bool = False
    declaration: dict[str, Any] | None = None
    requested_by: str | None = None
    open: dict[str, Frame] = attrs.Factory(dict)

    def see(self, frame: Frame) -> None:
        self.frames += 1
        self.last_seq, self.last_activity = frame.seq, frame.ts
        payload = frame.payload
        if frame.type == SESSION_RECORD:
            self.recorded = True
            if self.owner is None and isinstance(payload.get(OWNER_KEY), str):
                self.owner = payload[OWNER_KEY]  # the first recorded owner counts (cluster/log_bus.py)
            if isinstance(payload.get(DECLARATION_KEY), dict):
                self.declaration = payload[DECLARATION_KEY]
        request_id = payload.get("request_id")
        if not isinstance(request_id, str):
            return
        if frame.type in REQUESTS:
            self.open[request_id] = frame
            if isinstance(payload.get("caller_id"), str):
                self.requested_by = payload["caller_id"]
        elif frame.type in OUTCOMES:
            opened = self.open.get(request_id)
            if opened is not None and opened.type == OUTCOMES[frame.type]:
                del self.open[request_id]

    def view(self, now: datetime.datetime) -> SessionView:
        declared = self.declaration or {}
        tools = [t.get("name") for t in declared.get("tools", []) if isinstance(t, dict)]
        return SessionView(
            channel=self.channel, id=self.id, frames=self.frames, last_seq=self.last_seq,
            last_activity=self.last_activity, owner=self.owner, owner_recorded=self.recorded,
            # The declaring caller, or (nothing recorded: an older log) the one its relayed requests name.
            caller_id=declared["caller_id"] if isinstance(declared.get("caller_id"), str) else self.requested_by,
            caller_tools=[t for t in tools if isinstance(t, str)],
            pending=[_pending(frame, now) for frame in self.open.values()],
        )


def _pending(frame: Frame, now: datetime.datetime) -> PendingView:
    payload = frame.payload
    tool = payload.get("tool") if frame.type == "caller_tool_request" else payload.get("tool_name")
    expires = payload.get("expires_at")
    server = payload.get("server")
    return PendingView(
        kind="caller_tool" if frame.type == "caller_tool_request" else "approval",
        request_id=payload["request_id"], tool=tool if isinstance(tool, str) else None, seq=frame.seq,
        requested_at=frame.ts, age_seconds=round(max(0.0, (now - parse_ts(frame.ts)).total_seconds()), 3),
        expires_at=expires if isinstance(expires, str) else None, server=server if isinstance(server, str) else None,
    )


def parse_ts(ts: str) -> datetime.datetime:
    """A frame's `ts` (ISO-8601 UTC with `Z`) as an aware datetime."""
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))


async def read_status(
    store: FrameStoreAPI, liveness: Liveness, *, instances: Sequence[str] = (),
    now: datetime.datetime | None = None,
) -> StatusReport:
    """The status of every instance with frames (and of `instances`, e.g. configured ones).

    Reads each instance's whole retained log once (bounded by retention): sessions are not
    indexed apart from their frames. Raises: `StoreUnavailable` as the store does.
    """
    names = sorted({*await store.instances(), *instances})
    views = []
    for name in names:
        scans: dict[tuple[str, str], _SessionScan] = {}
        last = await store.last_seq(name)
        start = await store.pruned_below(name)
        async for frame in all_frames(store, name, FrameQuery(after_seq=start)):
            key = (frame.session.channel, frame.session.id)
            scan = scans.get(key)
            if scan is None:
                scan = scans[key] = _SessionScan(*key)
            scan.see(frame)
            last = max(last, frame.seq)
        moment = now or datetime.datetime.now(datetime.timezone.utc)
        sessions = sorted((s.view(moment) for s in scans.values()), key=lambda s: s.last_seq, reverse=True)
        views.append(InstanceView(name=name, last_seq=last, guest=await liveness.guest(name), sessions=sessions))
    return StatusReport(store=store.describe(), shared=store.shared, instances=views)


def format_status(report: StatusReport) -> str:
    """The report as tables an operator reads: instances, sessions, pending requests."""
    lines = [f"store: {report.store}", "", _table(
        ("INSTANCE", "LAST SEQ", "GUEST", "SESSIONS", "PENDING"),
        [(i.name, str(i.last_seq), _guest_text(i.guest), str(len(i.sessions)),
          str(sum(len(s.pending) for s in i.sessions))) for i in report.instances],
    )]
    sessions = [(i.name, s) for i in report.instances for s in i.sessions]
    if sessions:
        lines += ["", _table(
            ("INSTANCE", "SESSION", "FRAMES", "LAST ACTIVITY", "OWNER", "CALLER TOOLS"),
            [(name, f"{s.channel}:{s.id}", str(s.frames), s.last_activity,
              s.owner or "-",
              _tools_text(s)) for name, s in sessions],
        )]
    pending = [(name, s, p) for name, s in sessions for p in s.pending]
    if pending:
        lines += ["", _table(
            ("INSTANCE", "SESSION", "KIND", "REQUEST", "TOOL", "AGE", "EXPIRES AT"),
            [(name, f"{s.channel}:{s.id}", p.kind, p.request_id, p.tool or "-", f"{p.age_seconds:.0f}s",
              p.expires_at or "-") for name, s, p in pending],
        )]
    return "\n".join(lines)


def _guest_text(guest: GuestView) -> str:
    if guest.connected is None:
        return UNKNOWN_GUEST
    if not guest.connected:
        return "not connected"
    return f"connected to {guest.server}" if guest.server else "connected"


def _tools_text(session: SessionView) -> str:
    if not session.caller_tools:
        return "-"
    return f"{session.caller_id}: {', '.join(session.caller_tools)}" if session.caller_id else ", ".join(session.caller_tools)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    rows = [tuple(escape(cell) for cell in row) for row in rows]  # what peers named, escaped
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)
    )


# -- tail ---------------------------------------------------------------------------------------


async def follow(
    store: FrameStoreAPI, instance: str, query: FrameQuery, *, poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> AsyncIterator[Frame]:
    """Every frame of `instance` matching `query` after its `after_seq`, then each new one as it
    is stored, until cancelled. PostgreSQL wakes the wait by LISTEN; SQLite is read again every
    `poll_interval` seconds (see the module docstring). A start below what retention kept
    resumes at the oldest kept frame."""
    query = attrs.evolve(query, limit=MAX_LIMIT)
    while True:
        try:
            frames, _ = await store.wait_for_frames(instance, query, poll_interval)
        except CursorPruned as exc:
            query = attrs.evolve(query, after_seq=exc.first_seq - 1)
            continue
        for frame in frames:
            yield frame
        if frames:
            query = attrs.evolve(query, after_seq=frames[-1].seq)


def summarize(payload: dict[str, Any], limit: int = SUMMARY_CHARS) -> str:
    """A payload in one short line: its compact JSON (unprintable characters as JSON escapes), cut at `limit` characters."""
    text = json_text(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_frame(frame: Frame) -> str:
    """One `tail` line: seq, time, session, type, a short payload summary, each escaped (a frame
    stored before types had a length limit is shown cut)."""
    return (f"{frame.seq} {frame.ts} {escape(frame.session.key)} {bounded(frame.type, MAX_FRAME_TYPE_CHARS)} "
            f"{summarize(frame.payload)}")


def frame_json(frame: Frame) -> str:
    """One `tail --json` line: the frame as stored, one JSON object (unprintable characters as JSON escapes)."""
    return json_text(json.dumps(frame.to_wire(), ensure_ascii=False, separators=(",", ":")))


# -- the two commands -----------------------------------------------------------------------------


async def print_status(
    store: FrameStoreAPI, liveness: Liveness | None, *, as_json: bool, instances: Sequence[str] = (),
    write: Any = print,
) -> None:
    """`oubliette-server status`: open `store`, read the report (every instance with frames, and
    `instances`), write it as a table or one JSON document. `liveness` None: the shared store's
    leases, else unknown."""
    async with store.running():
        if liveness is None:
            liveness = LeaseLiveness(cast(LeaseStore, store)) if store.shared else UnknownLiveness()
        report = await read_status(store, liveness, instances=instances)
    write(json_text(json.dumps(report.to_json(), indent=2, ensure_ascii=False)) if as_json else format_status(report))


async def unknown_instance_notice(store: FrameStoreAPI, instance: str, configured: Sequence[str]) -> str | None:
    """The line `tail` writes when `instance` has no frames and is not configured (a typo, or an
    instance whose first guest has yet to connect), naming the instances that exist; else None."""
    if instance in configured or await store.last_seq(instance) > 0:
        return None
    known = sorted({*await store.instances(), *configured})
    return (f"oubliette-server tail: instance '{instance}' has no frames and is not configured "
            f"(known: {escape(', '.join(known)) if known else 'none'}); still following it, "
            "in case its first guest has yet to connect")


async def print_frames(
    store: FrameStoreAPI, instance: str, query: FrameQuery, *, from_end: bool, as_json: bool,
    poll_interval: float = DEFAULT_POLL_INTERVAL, configured: Sequence[str] = (), write: Any = print,
) -> None:
    """`oubliette-server tail`: write each frame matching `query` as one line, until cancelled;
    `from_end`: only frames stored from now on (the query's `after_seq` is the log's end now).
    An instance with no frames that is not in `configured` is said so on stderr, then followed."""
    async with store.running():
        if from_end:
            query = attrs.evolve(query, after_seq=await store.last_seq(instance))
        # On stderr, so a script (or a test) knows from which seq on nothing is missed.
        sys.stderr.write(f"following {instance} after seq {query.after_seq} (Ctrl-C ends it)\n")
        notice = await unknown_instance_notice(store, instance, configured)
        if notice is not None:
            sys.stderr.write(notice + "\n")
        sys.stderr.flush()
        async for frame in follow(store, instance, query, poll_interval=poll_interval):
            write(frame_json(frame) if as_json else format_frame(frame), flush=True)
