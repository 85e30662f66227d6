"""`oubliette-server status` and `tail` against running servers (docs/OBSERVABILITY.md).

Everything is a real program: the server, the guest runtime with tests/support/loop_agent.py, a caller
over Streamable HTTP, and the two commands themselves, run as subprocesses beside the server
while it writes its store (SQLite), or beside two servers on one real PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio

from harness import PYTHON, Deployment, HttpServer, RawRelay
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.api import FrameQuery, StoreUnavailable
from tether_http import poll
from loop_caller import INSTANCE, LOOP_AGENT, LoopCaller, script, tool

QUIET = "box2"
"""An instance with no guest: the tail tests append to it through the tether."""
WAIT = 60.0


async def run(deployment: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """`oubliette-server ARGS` on the deployment's store; fails the test on a non-zero status."""
    where = ["--store", deployment.store] if deployment.store else ["--data-dir", str(deployment.data_dir)]
    with trio.fail_after(WAIT):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_server", *args, *where], capture_stdout=True, capture_stderr=True, check=False,
        )
    assert done.returncode == 0, done.stderr
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


async def server_id(server: HttpServer) -> str:
    async with server.unix_rest() as rest:
        return str((await rest.get("/v1/health")).json()["server"]["id"])


async def post(server: HttpServer, instance: str, session: str, type_: str, text: str) -> int:
    """Store one frame through the server's tether; its seq."""
    channel, _, sid = session.partition(":")
    async with server.rest() as rest:
        response = await rest.post(f"/v1/instances/{instance}/tether", json={
            "v": 1, "session": {"channel": channel, "id": sid}, "type": type_, "payload": {"text": text}})
    assert response.status_code == 201, response.text
    return int(response.json()["ingress_seq"])


class Tail:
    """A running `oubliette-server tail`: its stdout lines as they come."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.buffer = b""
        self.stderr = b""

    async def stderr_line(self, number: int) -> str:
        """Its `number`th stderr line (from 1), once written."""
        assert self.process.stderr is not None
        with trio.fail_after(WAIT):
            while self.stderr.count(b"\n") < number:
                chunk = await self.process.stderr.receive_some(4096)
                assert chunk, f"tail exited before its stderr line {number}: {self.stderr.decode()}"
                self.stderr += chunk
        return self.stderr.decode().splitlines()[number - 1]

    async def started(self) -> int:
        """Wait for its "following … after seq N" line; N."""
        line = await self.stderr_line(1)
        assert line.startswith("following "), line
        return int(line.split("after seq ")[1].split()[0])

    async def lines(self, count: int) -> list[str]:
        """The next `count` lines of its stdout."""
        assert self.process.stdout is not None
        with trio.fail_after(WAIT):
            while self.buffer.count(b"\n") < count:
                chunk = await self.process.stdout.receive_some(65536)
                assert chunk, "tail exited"
                self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n", count)
        return [line.decode() for line in lines]

    async def interrupt(self) -> tuple[int, str]:
        """Ctrl-C: its exit status and what it wrote on stderr meanwhile."""
        self.process.send_signal(signal.SIGINT)
        assert self.process.stderr is not None
        with trio.fail_after(WAIT):
            while chunk := await self.process.stderr.receive_some(4096):
                self.stderr += chunk
            return await self.process.wait(), self.stderr.decode()


@asynccontextmanager
async def tail(deployment: Deployment, *args: str) -> AsyncIterator[Tail]:
    where = ["--store", deployment.store] if deployment.store else ["--data-dir", str(deployment.data_dir)]
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_server", "tail", *args, *where, "--poll-interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        yield Tail(process)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def stored(server: HttpServer, session_id: str, *types: str) -> None:
    """Wait until the log has a frame of each of `types` in `session_id`: the server's long poll
    answers as each is committed (where status reads it too)."""
    missing, after = set(types), 0
    async with server.rest() as rest:
        with trio.fail_after(WAIT):
            while missing:
                page = await poll(rest, INSTANCE, {
                    "session_id": session_id, "types": ",".join(types), "after_seq": after, "wait_ms": 30_000})
                missing -= {f["type"] for f in page["frames"]}
                after = page["next_seq"]


def instance_of(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(i for i in report["instances"] if i["name"] == name)


# -- SQLite: one server, the commands beside it -------------------------------------------------------


async def test_status_shows_guest_session_and_pending_requests_of_a_running_server() -> None:
    """A guest connected, a session whose caller declared tools, and one caller tool request and one
    approval left pending: `status --json` lists them with their fields, the table names them."""
    deployment = Deployment()
    try:
        async with deployment.http_server("--config", str(deployment.config_file(INSTANCE, QUIET))) as server, \
                deployment.guest(INSTANCE, LOOP_AGENT):
            await server.wait_connected(INSTANCE)
            async with server.caller(events=False) as (client, _):
                caller = LoopCaller(client)
                stop = await caller.message(
                    "s1", script([("myapp_notify", {"n": 1}), ("myapp_delete", {"n": 2})]),
                    [tool("notify"), tool("delete", requires_approval=True)], wait=60,
                )
                assert stop.get("stop_reason") in ("requires_action", "requires_approval"), stop
                await stored(server, "s1", "caller_tool_request", "approval_request")
                await post(server, QUIET, "tg:1", "note", "an instance with frames and no guest")

                done = await run(deployment, "status", "--json", "--http", f"unix:{server.unix_socket}")
                report = json.loads(done.stdout)
                assert report["store"].startswith("sqlite:") and report["shared"] is False
                box1 = instance_of(report, INSTANCE)
                assert box1["guest"] == {"connected": True, "server": await server_id(server), "source": "health"}
                assert instance_of(report, QUIET)["guest"]["connected"] is False
                assert instance_of(report, QUIET)["sessions"][0]["id"] == "1"
                session = next(s for s in box1["sessions"] if s["id"] == "s1")
                assert session["channel"] == "mcp" and session["frames"] >= 3 and session["last_activity"].endswith("Z")
                # Recorded on SQLite too: the caller's identity (a connection's, here) and its declaration.
                assert session["owner"].startswith("connection:") and session["owner_recorded"] is True, session
                assert session["caller_id"] == "myapp" and session["caller_tools"] == ["notify", "delete"], session
                pending = {p["kind"]: p for p in session["pending"]}
                assert set(pending) == {"caller_tool", "approval"}, session["pending"]
                assert pending["caller_tool"]["tool"] == "notify" and pending["approval"]["tool"] == "myapp_delete"  # as the agent named it
                for entry in pending.values():
                    assert entry["request_id"] and entry["expires_at"] > entry["requested_at"]
                    assert entry["age_seconds"] >= 0

                table = (await run(deployment, "status", "--http", f"unix:{server.unix_socket}")).stdout
                assert f"connected to {await server_id(server)}" in table
                assert "mcp:s1" in table and pending["caller_tool"]["request_id"] in table
                assert pending["approval"]["request_id"] in table and session["owner"] in table
                found = (await run(deployment, "status")).stdout  # no --http: the server's serving.json names it
                assert f"connected to {await server_id(server)}" in found
    finally:
        deployment.cleanup()


async def test_status_finds_the_listener_of_a_server_started_with_only_http_port_0() -> None:
    """A server started with `--http 127.0.0.1:0` alone (no config, no Unix listener) leaves
    `serving.json` in its data dir (mode 0600: pid, server id, the addresses bound), and `status
    --data-dir` alone asks that listener who is connected. A clean stop removes the file; the file a
    killed server left is not trusted (its pid is gone): status says unknown, it asks nobody."""
    deployment = Deployment()
    serving = deployment.data_dir / "serving.json"
    try:
        async with deployment.http_server(unix_http=False) as server:
            async with server.rest() as rest:
                identity = (await rest.get("/v1/health")).json()["server"]["id"]
            assert serving.stat().st_mode & 0o777 == 0o600
            assert json.loads(serving.read_text()) == {
                "pid": server.process.pid, "server": identity, "relay": server.ready["relay"],
                "http": server.ready["http"], "metrics": [], "instances": []}
            async with RawRelay.connect(deployment) as relay:  # a client of box1 connected, and a frame of box1
                assert "result" in await relay.hello(INSTANCE, deployment.token(INSTANCE))
                await post(server, INSTANCE, "tg:1", "note", "a frame")
                report = json.loads((await run(deployment, "status", "--json")).stdout)
            assert instance_of(report, INSTANCE)["guest"] == {"connected": True, "server": identity, "source": "health"}
        assert not serving.exists()  # stopped by SIGTERM: removed

        async with deployment.http_server(unix_http=False) as server:
            server.process.kill()
            await server.process.wait()
        assert json.loads(serving.read_text())["pid"] == server.process.pid  # left behind by the killed server
        done = await run(deployment, "status")
        assert "unknown (no server to ask: none running on this data dir, no --http)" in done.stdout, done.stdout
    finally:
        deployment.cleanup()


async def test_status_refuses_a_serving_file_whose_listener_is_another_servers() -> None:
    """A `serving.json` naming a live pid and a listener that answers as another server (a reused
    pid, a moved port) is not believed: status says so in one line naming the file, exit 1."""
    other, forged = Deployment(), Deployment()
    try:
        forged.data_dir.mkdir(parents=True)
        with FrameStore(forged.data_dir / "frames.sqlite3") as store:
            await store.append(INSTANCE, channel="tg", session_id="1", type="note", payload={})
        async with other.http_server() as server:
            (forged.data_dir / "serving.json").write_text(json.dumps({
                "pid": os.getpid(), "server": "gone:1:abcdef", "relay": forged.relay,
                "http": [f"http://unix:{server.unix_socket}"], "metrics": [], "instances": []}))
            with trio.fail_after(WAIT):
                done = await trio.run_process([PYTHON, "-m", "oubliette_server", "status", "--data-dir", str(forged.data_dir)],
                                              capture_stdout=True, capture_stderr=True, check=False)
            answered_as = await server_id(server)
        assert done.returncode == 1, done.stderr
        assert done.stderr.decode() == (
            f"oubliette-server: error: the server at unix:{server.unix_socket} is {answered_as}, not gone:1:abcdef "
            f"that {forged.data_dir / 'serving.json'} names (a stale file?); pass --http\n")
    finally:
        other.cleanup()
        forged.cleanup()


async def test_tail_says_when_an_instance_has_no_frames_and_is_not_configured() -> None:
    """`tail nosuch` says in one stderr line that the instance has no frames and is not configured,
    naming the known ones, then keeps following: a client of nosuch connects, a frame is stored,
    tail prints it. A configured instance without frames (configured on the running server: tail
    reads its serving.json, no --config) gets no such line."""
    deployment = Deployment()
    try:
        async with deployment.http_server("--config", str(deployment.config_file(QUIET))) as server:
            async with tail(deployment, "nosuch") as unknown, tail(deployment, QUIET) as configured:
                assert await unknown.started() == 0
                assert await unknown.stderr_line(2) == (
                    "oubliette-server tail: instance 'nosuch' has no frames and is not configured (known: box2); "
                    "still following it, in case its first guest has yet to connect")
                assert await configured.started() == 0
                async with RawRelay.connect(deployment) as relay:
                    assert "result" in await relay.hello("nosuch", deployment.token("nosuch"))
                    seq = await post(server, "nosuch", "tg:1", "note", "first")
                (line,) = await unknown.lines(1)
                assert int(line.split()[0]) == seq and "first" in line
                status, stderr = await configured.interrupt()
                assert status == 130 and "has no frames" not in stderr, stderr
                assert (await unknown.interrupt())[0] == 130
    finally:
        deployment.cleanup()


async def test_tail_follows_resumes_filters_and_ends_quietly_on_ctrl_c() -> None:
    """`tail` prints frames stored after it started (one line each, or JSON), resumes after a seq,
    keeps only the asked types and session, and Ctrl-C ends it with 130 and no traceback."""
    deployment = Deployment()
    try:
        async with deployment.http_server("--config", str(deployment.config_file(QUIET))) as server:
            first = await post(server, QUIET, "tg:1", "user.message", "before")
            async with tail(deployment, QUIET) as follower, \
                    tail(deployment, QUIET, "--json", "--types", "note", "--session", "tg:2") as filtered:
                assert await follower.started() == first
                assert await filtered.started() == first
                seqs = [await post(server, QUIET, session, type_, text) for session, type_, text in (
                    ("tg:1", "user.message", "hello"), ("tg:2", "note", "kept"), ("tg:1", "note", "other session"),
                )]
                lines = await follower.lines(3)
                assert [int(line.split()[0]) for line in lines] == seqs
                seq, ts, session, type_, summary = lines[0].split(" ", 4)
                assert session == "tg:1" and type_ == "user.message" and ts.endswith("Z")
                assert json.loads(summary) == {"text": "hello"}
                (only,) = await filtered.lines(1)
                frame = json.loads(only)
                assert frame["seq"] == seqs[1] and frame["type"] == "note" and frame["payload"] == {"text": "kept"}
                status, stderr = await follower.interrupt()
                assert status == 130 and "Traceback" not in stderr, stderr
                assert (await filtered.interrupt())[0] == 130
            async with tail(deployment, QUIET, "--after-seq", str(first)) as resumed:
                assert await resumed.started() == first
                assert [int(line.split()[0]) for line in await resumed.lines(3)] == seqs
                assert (await resumed.interrupt())[0] == 130
    finally:
        deployment.cleanup()


# -- PostgreSQL: two servers on one database ------------------------------------------------------------


async def test_status_and_tail_across_two_servers_on_postgres(pg_url: str) -> None:
    """With servers A and B on one database and the guest of box1 on B, status read through A names
    B as the guest's server and as the one waiting on the pending requests of B's caller (with its
    owner and declared tools); tail, one more client of the database, follows frames stored through both."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE, QUIET))) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE, QUIET))) as server_b, \
                b.guest(INSTANCE, LOOP_AGENT):
            await server_b.wait_connected(INSTANCE)
            async with server_b.caller(events=False) as (client, _):  # a caller of B leaves two requests pending
                stop = await LoopCaller(client).message(
                    "s1", script([("myapp_notify", {"n": 1}), ("myapp_delete", {"n": 2})]),
                    [tool("notify"), tool("delete", requires_approval=True)], wait=60,
                )
                assert stop.get("stop_reason") in ("requires_action", "requires_approval"), stop
                with trio.fail_after(WAIT):
                    while True:  # the lease is taken just after the guest's hello; both requests stored
                        report = json.loads((await run(a, "status", "--json", "--config", str(a.root / "oubliette.toml"))).stdout)
                        box1 = instance_of(report, INSTANCE)
                        session = next((s for s in box1["sessions"] if s["id"] == "s1"), {"pending": []})
                        if box1["guest"]["connected"] and len(session["pending"]) == 2:
                            break
                        await trio.sleep(0.1)  # B takes the lease after the hello with no line nor notice to wait on
                table = (await run(a, "status", "--config", str(a.root / "oubliette.toml"))).stdout
            assert report["shared"] is True
            assert instance_of(report, INSTANCE)["guest"] == {
                "connected": True, "server": await server_id(server_b), "source": "lease"}
            assert (await server_id(server_a)) != (await server_id(server_b))
            assert "connected to " + await server_id(server_b) in table and "not connected" in table  # box2
            # Read through A: B's caller owns the session, and B is the server waiting on each request.
            assert session["owner_recorded"] is True and session["caller_tools"] == ["notify", "delete"], session
            pending = {p["kind"]: p for p in session["pending"]}
            assert pending["caller_tool"]["tool"] == "notify" and pending["approval"]["tool"] == "myapp_delete"
            for entry in pending.values():
                assert entry["server"] == await server_id(server_b), entry
                assert entry["expires_at"] > entry["requested_at"] and entry["age_seconds"] >= 0
                assert entry["request_id"] in table

            async with tail(a, QUIET, "--types", "note") as follower:
                await follower.started()
                seqs = [await post(server_a, QUIET, "tg:1", "note", "via A"),
                        await post(server_b, QUIET, "tg:1", "note", "via B")]
                lines = await follower.lines(2)
                assert [int(line.split()[0]) for line in lines] == seqs
                assert "via A" in lines[0] and "via B" in lines[1]
                status, stderr = await follower.interrupt()
                assert status == 130 and "Traceback" not in stderr, stderr
    finally:
        a.cleanup()
        b.cleanup()


# -- the SQLite reader alone ---------------------------------------------------------------------------


async def test_sqlite_reader_sees_another_writers_commits_and_writes_nothing(tmp_path: Any) -> None:
    """`FrameStore.reader` (status, tail) reads frames another store object commits after it
    opened, waits on nobody (a long poll lasts its timeout, then reads again) and cannot write."""
    path = tmp_path / "frames.sqlite3"
    with FrameStore(path) as writer:
        await writer.append(INSTANCE, channel="tg", session_id="1", type="note", payload={"n": 1})
        reader = FrameStore.reader(path)
        try:
            assert [f.seq for f in await reader.query(INSTANCE, FrameQuery())] == [1]
            await writer.append(INSTANCE, channel="tg", session_id="1", type="note", payload={"n": 2})
            assert await reader.last_seq(INSTANCE) == 2
            frames, timed_out = await reader.wait_for_frames(INSTANCE, FrameQuery(after_seq=1), 0.05)
            assert [f.payload for f in frames] == [{"n": 2}] and not timed_out
            with pytest.raises(StoreUnavailable, match="readonly"):
                await reader.append(INSTANCE, channel="tg", session_id="1", type="note", payload={})
        finally:
            reader.close()
    with pytest.raises(OSError, match="no frame store"):
        FrameStore.reader(tmp_path / "absent.sqlite3")
    assert not (tmp_path / "absent.sqlite3").exists()


async def test_read_status_reads_owner_declaration_and_open_requests_from_frames() -> None:
    """The queries alone: owner (first recorded) and last declaration from `session_record`, a request
    open until its outcome frame, its age from the frame's time and `expires_at` as stored."""
    import datetime

    from oubliette_server.program.operator_view import UnknownLiveness, format_status, parse_ts, read_status

    store = FrameStore.in_memory()
    add = store.append
    await add(INSTANCE, channel="mcp", session_id="s1", type="session_record", payload={"owner": "key:alice"})
    await add(INSTANCE, channel="mcp", session_id="s1", type="session_record", payload={
        "owner": "key:bob", "caller_tools": {"caller_id": "myapp", "tools": [{"name": "notify"}, {"name": "rm"}]}})
    for rid, tool_name in (("ctr-1", "notify"), ("ctr-2", "rm")):
        await add(INSTANCE, channel="mcp", session_id="s1", type="caller_tool_request", payload={
            "request_id": rid, "tool": tool_name, "arguments": {}, "expires_at": "2030-01-01T00:00:00.000Z"})
    await add(INSTANCE, channel="mcp", session_id="s1", type="caller_tool_result", payload={"request_id": "ctr-1"})
    await add(INSTANCE, channel="mcp", session_id="s1", type="approval_resolved", payload={"request_id": "ctr-2"})
    request = (await store.query(INSTANCE, FrameQuery(types=["caller_tool_request"])))[-1]
    now = parse_ts(request.ts) + datetime.timedelta(seconds=3)

    report = await read_status(store, UnknownLiveness(), instances=["box9"], now=now)
    assert [i.name for i in report.instances] == [INSTANCE, "box9"]
    (session,) = report.instances[0].sessions
    assert (session.owner, session.owner_recorded, session.caller_id, session.caller_tools) == (
        "key:alice", True, "myapp", ["notify", "rm"])
    (pending,) = session.pending  # ctr-1 has its result; an approval's outcome does not end a caller tool request
    assert (pending.kind, pending.request_id, pending.tool, pending.age_seconds, pending.expires_at) == (
        "caller_tool", "ctr-2", "rm", 3.0, "2030-01-01T00:00:00.000Z")
    assert report.instances[1].sessions == [] and report.instances[1].last_seq == 0
    table = format_status(report)
    assert "key:alice" in table and "myapp: notify, rm" in table and "ctr-2" in table and "3s" in table
    store.close()


# -- what peers wrote, on the operator's terminal ---------------------------------------------------

#: An 8-bit CSI (U+009B: a terminal reads `\x9b2J` as "clear the screen"), ESC, C1 controls, the bidi
#: overrides and isolates, a line separator: what a sandbox could write to drive or spoof the terminal.
HOSTILE = "\x9b2J\x1b]0;pwned\x07\x85\u202a\u202e\u2066\u2069\u2028exe.txt"


def unprintable(text: str) -> set[str]:
    return {char for char in text if not char.isprintable()}


async def test_tail_and_status_escape_what_peers_wrote() -> None:
    """Frames a sandbox or a caller shaped (a payload, an owner, caller tool names, and a 5,000-character
    type stored before types had a limit) reach every operator output escaped: `tail` lines and
    `--json`, the `status` table and `--json`; the JSON still reads back as what was stored."""
    from oubliette_server.program.operator_view import UnknownLiveness, format_frame, frame_json, print_status
    from protocol.frames import MAX_FRAME_TYPE_CHARS

    async def hostile_store() -> FrameStore:
        store = FrameStore.in_memory()
        await store.append(INSTANCE, channel="mcp", session_id="s1", type="session_record", payload={
            "owner": "key:" + HOSTILE, "caller_tools": {"caller_id": "myapp", "tools": [{"name": "rm" + HOSTILE}]}})
        await store.append(INSTANCE, channel="mcp", session_id="s1", type="caller_tool_request", payload={
            "request_id": "ctr-" + HOSTILE, "tool": "rm" + HOSTILE, "arguments": {}})
        await store.append(INSTANCE, channel="mcp", session_id="s1", type="t" + HOSTILE + "t" * 5000, payload={"text": HOSTILE})
        return store

    store = await hostile_store()
    frames = await store.query(INSTANCE, FrameQuery(limit=10))
    store.close()
    for frame in frames:
        line = format_frame(frame)
        assert unprintable(line) == set(), line
        assert "9b2J" in line and "\\u202e" in line  # \x9b in the type, \u009b in the JSON summary
        document = frame_json(frame)
        assert unprintable(document) == set() and json.loads(document) == frame.to_wire()
    assert len(format_frame(frames[-1])) < MAX_FRAME_TYPE_CHARS + 250  # the type cut, the summary short
    written: list[str] = []
    for as_json in (False, True):
        await print_status(await hostile_store(), UnknownLiveness(), as_json=as_json, write=written.append)
    table, document = written
    assert unprintable(table) - {"\n"} == set() and "key:\\x9b2J" in table and "rm\\x9b2J" in table
    assert unprintable(document) - {"\n"} == set()
    assert instance_of(json.loads(document), INSTANCE)["sessions"][0]["owner"] == "key:" + HOSTILE


async def test_tail_escapes_what_a_sandbox_wrote_through_http_ingress() -> None:
    """The real `tail`, text and `--json`, following frames a sandbox posted to HTTP ingress with its
    instance token: C1 controls and bidi overrides arrive escaped, never raw, on the terminal."""
    deployment = Deployment()
    try:
        async with deployment.http_server("--config", str(deployment.config_file(QUIET))) as server:
            async with tail(deployment, QUIET) as text, tail(deployment, QUIET, "--json") as as_json:
                await text.started()
                await as_json.started()
                async with server.rest(deployment.token(QUIET)) as rest:
                    response = await rest.post(f"/v1/instances/{QUIET}/tether", json={
                        "v": 1, "session": {"channel": "tg", "id": "1"}, "type": "note", "payload": {"text": HOSTILE}})
                assert response.status_code == 201, response.text
                (line,) = await text.lines(1)
                (document,) = await as_json.lines(1)
                assert unprintable(line) == set() and "\\u009b2J" in line and "\\u202e" in line, line
                assert unprintable(document) == set() and json.loads(document)["payload"] == {"text": HOSTILE}
                assert (await text.interrupt())[0] == 130 and (await as_json.interrupt())[0] == 130
    finally:
        deployment.cleanup()
