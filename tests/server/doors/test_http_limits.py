"""What an HTTP client can make the server do to its log and its answers (docs/SECURITY.md):
a client that leaves mid-body logs no error, a failing store answers the JSON error shape, a
damaged SQLite file at start is one line, and every request leaves one access-log line that
never holds a token. (The slow-body flood is in tests/e2e/test_faults.py.)"""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from harness import Deployment
from task_steps import counted_steps

from oubliette_server.doors.connection_limits import ConnectionWatch, FloodLog, GuardedStream, descriptor_shares


async def _raw_request(url: str, data: bytes) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(data)
    return stream


async def test_a_client_that_leaves_mid_body_logs_no_error(deployment: Deployment) -> None:
    """Before: two ERROR tracebacks (`ClientDisconnect`) per such request, a free way to flood the log."""
    deployment.config_file("box1")
    async with deployment.http_server("--config", str(deployment.root / "oubliette.toml"), "--log-level", "INFO") as server:
        for _ in range(3):
            stream = await _raw_request(server.url, (
                f"POST /v1/instances/box1/tether HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {server.token}\r\n"
                "content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"type\": "
            ).encode())
            await stream.aclose()
        await server.wait_stderr("oubliette.access", "POST /v1/instances/box1/tether -", count=3)
        async with server.rest() as rest:
            assert (await rest.get("/v1/health")).status_code == 200
        await server.wait_stderr("oubliette.access", "GET /v1/health 200")
    log = server.stderr.decode(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log


async def test_a_failing_store_answers_the_json_error(deployment: Deployment, caplog: pytest.LogCaptureFixture) -> None:
    """A full disk (or a damaged page) makes SQLite raise mid-request: the answer is a JSON 500 that
    says so, not Starlette's plain text, and the log has one ERROR line, without a traceback."""

    async def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("database or disk is full")

    async with deployment.embedded_http_server("box1") as server:
        server.app.store.append = disk_full
        server.app.store.query = server.app.store.wait_for_frames = disk_full
        async with server.rest() as rest:
            with caplog.at_level(logging.INFO):
                sent = await rest.post("/v1/instances/box1/tether", json={
                    "type": "user.message", "session": {"channel": "api", "id": "s1"}, "payload": {"text": "hi"},
                })
                read = await rest.get("/v1/instances/box1/tether/poll")
    for response in (sent, read):
        assert response.status_code == 500, response.text
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["name"] == "internal_error" and "database or disk is full" in error["message"], error
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and all(r.exc_info is None for r in errors), [r.getMessage() for r in errors]
    assert "the frame store failed: database or disk is full" in errors[0].getMessage()


def _damage(path: Path, how: str) -> None:
    if how == "not a database":
        path.write_bytes(b"\x13\x37" * 10_000)
        return
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE filler(x)")
    db.executemany("INSERT INTO filler VALUES (?)", [("x" * 500,) for _ in range(2000)])
    db.commit()
    db.close()
    with open(path, "r+b") as handle:  # the first page, after the 100-byte header: the schema
        handle.seek(100)
        handle.write(b"\xff" * 3000)


@pytest.mark.parametrize("how", ["not a database", "a damaged page"])
def test_a_damaged_sqlite_file_at_start_is_one_line(tmp_path: Path, how: str) -> None:
    """Before: a 27-line traceback. Now one line naming the file, exit status 1."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    store = data / "frames.sqlite3"
    _damage(store, how)
    done = subprocess.run(
        [sys.executable, "-m", "oubliette_server", "--data-dir", str(data), "--relay", f"unix:{tmp_path / 'r.sock'}",
         "--no-stdio", "--http", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("oubliette-server: error: the frame store ") and str(store) in lines[0], lines
    assert "damaged" in lines[0]


async def test_every_request_leaves_one_access_line_and_no_token(deployment: Deployment) -> None:
    """Method, path, status, duration; a refusal with its reason (bad or missing token, foreign
    Host); never the token, good or bad."""
    wrong = "not-the-token-" + "x" * 20
    async with deployment.http_server("--log-level", "INFO") as server:
        async with server.rest() as rest:
            assert (await rest.get("/v1/health", params={"secret": "query-not-logged"})).status_code == 200
        async with server.rest(token=wrong) as rest:
            assert (await rest.get("/v1/health")).status_code == 401
        async with server.rest(token=None) as rest:
            assert (await rest.post("/v1/instances/box1/tether", json={})).status_code == 401
            assert (await rest.get("/nowhere", headers={"authorization": f"Bearer {server.token}"})).status_code == 404
            foreign = await rest.post("/mcp", json={}, headers={
                "authorization": f"Bearer {server.token}", "host": "evil.example:80",
                "accept": "application/json, text/event-stream",
            })
            assert foreign.status_code == 421, foreign.text
        lines = await server.wait_stderr("oubliette.access", count=5)
    assert len(lines) == 5, lines
    ok, bad, missing, unknown, host = lines
    assert " INFO oubliette.access: 127.0.0.1:" in ok and "GET /v1/health 200 " in ok and ok.endswith(" ms"), ok
    assert "GET /v1/health 401 " in bad and bad.endswith("- this bearer token is not valid for this resource"), bad
    assert "POST /v1/instances/box1/tether 401 " in missing and missing.endswith("- missing bearer token"), missing
    assert "GET /nowhere 404 " in unknown and "no such endpoint" in unknown, unknown
    assert "POST /mcp 421 " in host and '- /mcp does not accept the Host header "evil.example:80"' in host, host
    log = server.stderr.decode(errors="replace")
    assert server.token not in log and wrong not in log and "query-not-logged" not in log


async def test_json_access_lines_carry_the_request_fields(deployment: Deployment) -> None:
    """`--log-format json`: each request's line has its facts as keys (peer, method, path, status,
    duration, refusal reason) for a log shipper, as the relay's lines do; still never the token."""
    wrong = "not-the-token-" + "x" * 20
    async with deployment.http_server("--log-level", "INFO", "--log-format", "json") as server:
        async with server.rest() as rest:
            assert (await rest.get("/v1/health", params={"secret": "query-not-logged"})).status_code == 200
        async with server.rest(token=wrong) as rest:
            assert (await rest.get("/v1/health")).status_code == 401
        lines = [json.loads(line) for line in await server.wait_stderr('"oubliette.access"', '"method"', count=2)]
    ok, refused = lines
    assert ok["peer"].startswith("127.0.0.1:") and (ok["method"], ok["path"], ok["status"]) == ("GET", "/v1/health", 200)
    assert ok["reason"] is None and 0 <= ok["duration_s"] < 60 and ok["level"] == "INFO", ok
    assert (refused["status"], refused["reason"]) == (401, "this bearer token is not valid for this resource"), refused
    assert refused["message"].endswith(" ms - this bearer token is not valid for this resource"), refused
    log = server.stderr.decode(errors="replace")
    assert server.token not in log and wrong not in log and "query-not-logged" not in log


async def test_the_flood_log_says_a_burst_in_one_line_per_interval(autojump_clock: MockClock) -> None:
    """A thousand events in a moment are one WARNING; more within the interval wait for the next line."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.flood")
    logger.addHandler(Collect())
    flood = FloodLog(logger, "HTTP", interval=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(flood.serve)
        for _ in range(1000):
            flood.count("connections refused at the cap of 40")
        await trio.sleep(1)
        assert records == ["HTTP under pressure (one line per 10 s at most): 1000 connections refused at the cap of 40"]
        flood.count("connections refused at the cap of 40")
        flood.count("requests cut off at the 3 s body deadline", 5)
        await trio.sleep(5)
        assert len(records) == 1
        await trio.sleep(6)
        assert records[1].endswith("1 connections refused at the cap of 40, 5 requests cut off at the 3 s body deadline")
        nursery.cancel_scope.cancel()


def test_the_default_caps_share_the_descriptors_and_keep_a_reserve() -> None:
    """A quarter of the descriptor limit (at least 64) stays out of both doors' reach; HTTP and
    the relay each get half of the rest (at least 1), so a flood of one leaves the other its own."""
    assert [(s.http, s.relay, s.reserve) for s in map(descriptor_shares, (1024, 256, 100, 10))] == [
        (384, 384, 256), (96, 96, 64), (18, 18, 64), (1, 1, 8),
    ]


async def test_a_guarded_stream_writes_one_at_a_time_within_its_deadline() -> None:
    """hypercorn ends a connection with `send_eof` outside its write lock: it waits for the write in
    progress here instead of raising `BusyResourceError`; and a peer that reads nothing makes a
    write fail (`BrokenResourceError`, the client gone) at the deadline instead of hanging."""
    ours, theirs = trio.socket.socketpair()
    guarded = GuardedStream(trio.SocketStream(ours), write_timeout=0.5)
    peer = trio.SocketStream(theirs)
    big = b"x" * 4_000_000  # far more than the socket buffers hold
    received = bytearray()
    async with trio.open_nursery() as nursery:

        async def read_all() -> None:
            while chunk := await peer.receive_some(1 << 16):
                received.extend(chunk)

        async def write_then_eof_at_once() -> None:
            async with trio.open_nursery() as inner:
                inner.start_soon(guarded.send_all, big)
                await trio.sleep(0)
                inner.start_soon(guarded.send_eof)

        nursery.start_soon(write_then_eof_at_once)
        nursery.start_soon(read_all)
    assert len(received) == len(big)
    await guarded.aclose()
    await peer.aclose()

    ours, theirs = trio.socket.socketpair()
    guarded = GuardedStream(trio.SocketStream(ours), write_timeout=0.5)
    with trio.fail_after(5):
        with pytest.raises(trio.BrokenResourceError, match="read nothing for 0.5 s"):
            await guarded.send_all(big)  # nobody reads `theirs`
    theirs.close()
    await guarded.aclose()


async def test_a_guarded_stream_writes_what_the_socket_takes_in_the_step_it_is_in() -> None:
    """An answer the socket's buffer takes whole is written in the sending task's step
    (`write_at_once`: no scheduler round trip, no deadline armed); what it cannot take is written
    under the deadline, in order."""
    ours, theirs = trio.socket.socketpair()
    guarded = GuardedStream(trio.SocketStream(ours), write_timeout=5)
    peer = trio.SocketStream(theirs)
    with counted_steps() as steps:
        await guarded.send_all(b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\n{}")
    assert steps.count == 0
    assert await peer.receive_some(1 << 16) == b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\n{}"
    big = bytes(range(256)) * 16_000  # more than the socket buffers hold
    received = bytearray()
    async with trio.open_nursery() as nursery:

        async def read_all() -> None:
            while len(received) < len(big):
                received.extend(await peer.receive_some(1 << 16))

        nursery.start_soon(read_all)
        await guarded.send_all(big)
    assert received == big
    await guarded.aclose()
    await peer.aclose()


async def test_a_guarded_stream_sends_now_only_what_keeps_the_writes_in_order() -> None:
    """`send_now` (a write without a checkpoint, as `GuardedTCPServer` tries each of hypercorn's) keeps
    a held write for the next, sends what the socket takes at once and returns the rest, which
    `send_all` then sends in order; while a send is in progress it sends nothing and returns it all."""
    ours, theirs = trio.socket.socketpair()
    guarded = GuardedStream(trio.SocketStream(ours), write_timeout=5)
    peer = trio.SocketStream(theirs)
    guarded.hold_next_send()
    assert guarded.send_now(b"head ") == b""
    assert guarded.send_now(b"body") == b""
    assert await peer.receive_some(1 << 16) == b"head body"
    big = bytes(range(256)) * 16_000  # more than the socket buffers hold
    rest = guarded.send_now(big)
    assert 0 < len(rest) < len(big)
    received = bytearray()
    async with trio.open_nursery() as nursery:

        async def read_all() -> None:
            while len(received) < len(big) + len(b"after"):
                received.extend(await peer.receive_some(1 << 16))

        nursery.start_soon(guarded.send_all, rest)  # the socket is full: it waits, holding the write
        await trio.testing.wait_all_tasks_blocked()
        assert guarded.send_now(b"after") == b"after", "a send is in progress: nothing now"
        nursery.start_soon(read_all)
        await guarded.send_all(b"after")
    assert received == big + b"after"
    await guarded.aclose()
    await peer.aclose()


class _RecordedWrites:
    """A socket stream that records each write that reaches the socket (an empty one makes no system call)."""

    socket = None

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.ended = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Record `data` as one write, if there is any."""
        await trio.lowlevel.checkpoint()
        if data:
            self.writes.append(bytes(data))

    async def send_eof(self) -> None:
        """Record the half-close."""
        self.ended = True


async def test_a_guarded_stream_sends_a_held_write_with_the_next_one() -> None:
    """`hold_next_send` keeps the next write's bytes until the one after it, which carries both:
    a response's head and body (or the last chunk and the end) are one system call, not two. An
    empty send (the end of a sized body) or `send_eof` sends what is held; the hold is for one write."""
    inner = _RecordedWrites()
    guarded = GuardedStream(inner, write_timeout=0.5)  # type: ignore[arg-type]
    guarded.hold_next_send()
    await guarded.send_all(b"head ")
    assert inner.writes == []
    await guarded.send_all(b"body")
    await guarded.send_all(b"next")
    assert inner.writes == [b"head body", b"next"]
    guarded.hold_next_send()
    await guarded.send_all(b"")  # nothing to hold: the hold waits for bytes
    await guarded.send_all(memoryview(b"last chunk"))
    await guarded.send_all(b"")
    assert inner.writes[2:] == [b"last chunk"]
    guarded.hold_next_send()
    await guarded.send_all(b"cut short")
    await guarded.send_eof()
    assert inner.writes[3:] == [b"cut short"] and inner.ended


class _Connection:
    """What `ConnectionWatch` uses of its connection: the close it starts at the keep-alive deadline."""

    def __init__(self) -> None:
        self.closed_at: list[float] = []

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()
        self.closed_at.append(trio.current_time())


async def test_the_keep_alive_timer_closes_a_connection_idle_for_its_seconds(autojump_clock: MockClock) -> None:
    """An idle connection is closed `seconds` after it went idle, never while a request is being
    answered (`busy`), counted again from each idle spell (`idle`); the one task ends when the
    connection's reading does (`close`)."""
    connection = _Connection()
    timer = ConnectionWatch(connection, 5.0)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        timer.start(nursery)  # the connection is open, idle
        await trio.sleep(4)
        timer.busy()  # a request: a long poll of 60 s
        await trio.sleep(60)
        assert connection.closed_at == []
        timer.idle()  # answered at 64 s: idle again
        await trio.sleep(10)
        assert connection.closed_at == [start + 69]
        timer.close()
    busy = _Connection()
    timer = ConnectionWatch(busy, 5.0)
    async with trio.open_nursery() as nursery:
        timer.start(nursery)
        timer.busy()
        await trio.sleep(100)
        timer.close()  # the client left mid-request: the task ends, nothing else is closed
    assert busy.closed_at == []


async def test_the_connection_watch_pings_a_watched_request_and_cancels_its_call_when_the_connection_ends(
    autojump_clock: MockClock,
) -> None:
    """A request the connection's task watches (`watching`) is pinged `interval` after it began and
    after each ping, an interval after its last event (`quiet`), never once its block has ended;
    while it is watched the connection takes no other (`free`) and has no keep-alive deadline; the
    connection's reading ending (`close`) cancels its call at once and closes nothing."""
    connection = _Connection()
    watch = ConnectionWatch(connection, 5.0)
    pings: list[float] = []

    async def ping() -> None:
        await trio.lowlevel.checkpoint()
        pings.append(trio.current_time())

    assert not watch.free()  # no task yet: the connection starts it when it opens
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        watch.start(nursery)  # open, idle
        assert watch.free()
        await trio.sleep(1)
        watch.busy()  # a request came
        with watch.watching(ping, 15.0) as watched:
            assert not watch.free()
            with watched.call:
                await trio.sleep(40)  # the call
            assert not watched.call.cancelled_caught
            watched.quiet()  # an event at 41 s
            await trio.sleep(20)
        assert pings == [start + 16, start + 31, start + 56]
        await trio.sleep(100)
        assert pings == [start + 16, start + 31, start + 56]  # none after the block
        assert connection.closed_at == []
        watch.idle()  # answered: idle again
        watch.busy()
        with watch.watching(ping, 15.0) as watched:
            with watched.call:
                nursery.start_soon(_close_later, watch, 3.0)
                await trio.sleep(60)  # a long poll whose client leaves at 3 s
            assert watched.call.cancelled_caught
            left = trio.current_time()
        assert not watch.free()  # the connection is done
    assert left == start + 161 + 3
    assert connection.closed_at == []


async def _close_later(watch: ConnectionWatch, seconds: float) -> None:
    await trio.sleep(seconds)
    watch.close()


async def test_a_failed_ping_is_logged_and_cancels_the_watched_call(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """A ping that raises (on the connection's task) ends the watched call and is logged once;
    the connection's task goes on (the keep-alive still closes the idle connection)."""
    connection = _Connection()
    watch = ConnectionWatch(connection, 5.0)

    async def ping() -> None:
        raise RuntimeError("the write failed")

    async with trio.open_nursery() as nursery:
        watch.start(nursery)
        watch.busy()
        with caplog.at_level(logging.ERROR), watch.watching(ping, 15.0) as watched:
            with watched.call:
                await trio.sleep(60)
            assert watched.call.cancelled_caught and trio.current_time() == 15.0
        watch.idle()
        assert [r.getMessage() for r in caplog.records] == ["the keepalive ping of an HTTP request failed; its call is cancelled"]
    assert connection.closed_at == [20.0]


async def _read_to_close(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection (bounded: the test fails, not hangs)."""
    got = bytearray()
    async with stream:
        with trio.fail_after(10):
            while chunk := await stream.receive_some(1 << 16):
                got.extend(chunk)
    return bytes(got)


async def test_the_server_closes_idle_keep_alive_connections_and_not_a_busy_one(deployment: Deployment) -> None:
    """`http_keep_alive_timeout` on a real server (its timer is `ConnectionWatch`, not hypercorn's): a
    connection that sends nothing, and one idle after its answer, are closed; a request that takes
    longer than the timeout (a long poll of 1.5 s against 0.5 s) is answered on its connection."""
    async with deployment.embedded(http=["127.0.0.1:0"], instances={"box1": {}}, http_keep_alive_timeout=0.5) as embedded:
        server = embedded.http_server(deployment)
        assert await _read_to_close(await _raw_request(server.url, b"")) == b""
        answered = await _read_to_close(await _raw_request(server.url, b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n"))
        assert answered.startswith(b"HTTP/1.1 200 ") and answered.count(b"HTTP/1.1") == 1, answered
        async with server.rest() as http:
            meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {},
                    "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}
            owner = {"owner_key": "keep-alive-caller-0123456789", "instance": "box1", "session_id": "s1"}

            async def call(name: str, arguments: dict[str, Any]) -> Any:
                body = {"jsonrpc": "2.0", "id": name, "method": "tools/call",
                        "params": {"name": name, "arguments": {**owner, **arguments}, "_meta": meta}}
                response = await http.post("/mcp", json=body, headers={
                    "content-type": "application/json", "accept": "application/json, text/event-stream",
                    "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": name})
                assert response.status_code == 200, response.text
                result = response.json()["result"]
                assert result["isError"] is False, result
                return result["structuredContent"]

            await call("session_message", {"message": "hi", "context": {"caller_id": "app"}})
            polled = await call("session_events", {"types": ["caller_tool_request"], "wait_ms": 1500})
            assert polled["frames"] == [], polled
