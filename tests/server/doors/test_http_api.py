"""The HTTP API (docs/TETHER.md, "HTTP API"): tether ingress, poll and SSE stream; auth; /mcp Host checks.

Most tests run `oubliette-server` as a subprocess with a TCP and a Unix socket listener
(`deployment.http_server()`) and talk to it with httpx2. The tests about long-poll waiters
(woken by an append; gone when the client disconnects) embed the server in the test's Trio
loop (`deployment.embedded_http_server()`) so they can see the frame store's waiters.
"""

from __future__ import annotations

import calendar
import json
import os
import stat
import time
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from harness import Deployment
from tether_http import POLL, STREAM, TETHER, SseEvents, frame_body, poll, post, sse

pytestmark = pytest.mark.in_process


def assert_error(response: Any, status: int, name: str | None = None, *needles: str) -> dict[str, Any]:
    """A clear JSON error: `{"error": {"code", "name", "message"}}` with the given status."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"code", "name", "message"}, error
    assert isinstance(error["code"], int) and isinstance(error["name"], str)
    assert isinstance(error["message"], str) and error["message"]
    if name is not None:
        assert error["name"] == name, error
    for needle in needles:
        assert needle in error["message"], error
    return error


# -- ingress and poll ------------------------------------------------------------------------


@pytest.mark.real_programs
async def test_ingress_returns_the_stored_frame(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        before = time.time()
        response = await rest.post(TETHER.format("box1"), json={
            "v": 1, "type": "user.message", "session": {"channel": "telegram", "id": "12345"},
            "payload": {"text": "hello", "from": {"user": 7}}, "msg_id": "tg-42",
        })
        assert response.status_code == 201, response.text
        body = response.json()
        assert set(body) == {"msg_id", "session_id", "ingress_seq", "frame"}
        assert body["msg_id"] == "tg-42" and body["session_id"] == "12345" and body["ingress_seq"] == 1
        frame = body["frame"]
        assert frame == {
            "v": 1, "seq": 1, "ts": frame["ts"], "instance": "box1",
            "session": {"channel": "telegram", "id": "12345"}, "type": "user.message",
            "msg_id": "tg-42", "payload": {"text": "hello", "from": {"user": 7}},
        }
        ts = calendar.timegm(time.strptime(frame["ts"][:19], "%Y-%m-%dT%H:%M:%S"))
        assert abs(ts - before) < 60, frame["ts"]
        assert frame["ts"].endswith("Z")

        # No msg_id: one is made; no payload: {}; reply_to is kept.
        second = await post(rest, "box1", {"type": "assistant.delta", "session": {"channel": "telegram", "id": "12345"},
                                          "reply_to": "tg-42"})
        assert second["ingress_seq"] == 2
        assert second["msg_id"] and second["msg_id"] != "tg-42"
        assert second["frame"]["payload"] == {} and second["frame"]["reply_to"] == "tg-42"
        assert second["frame"]["msg_id"] == second["msg_id"]

        # What poll returns is what ingress returned.
        assert (await poll(rest, "box1"))["frames"] == [frame, second["frame"]]


# Frames for the filter tests: (channel, session, type, msg_id, reply_to).
FILTER_LOG = [
    ("telegram", "a", "user.message", "tg-1", None),
    ("telegram", "a", "status.presence", "p-1", "tg-1"),
    ("host", "a", "user.message", "host-1", None),
    ("telegram", "a", "assistant.delta", "d-1", "tg-1"),
    ("host", "a", "assistant.delta", "d-2", "host-1"),
    ("host", "b", "assistant.delta", "d-3", "host-9"),
    ("telegram", "a", "assistant.done", "done-1", "tg-1"),
    ("host", "a", "assistant.done", "done-2", "host-1"),
    ("host", "b", "session.error", "err-3", "host-9"),
    ("host", "a", "assistant.delta", "d-4", "tg-1"),
]


def matches(frame: dict[str, Any], params: dict[str, Any]) -> bool:
    types = params.get("types")
    return (
        frame["seq"] > params.get("after_seq", 0)
        and params.get("channel", frame["session"]["channel"]) == frame["session"]["channel"]
        and params.get("session_id", frame["session"]["id"]) == frame["session"]["id"]
        and (types is None or frame["type"] in types)
        and params.get("reply_to_msg_id", frame.get("reply_to")) == frame.get("reply_to")
    )


FILTER_CASES = [
    {},
    {"channel": "host"},
    {"channel": "telegram"},
    {"session_id": "a"},
    {"channel": "host", "session_id": "a"},
    {"channel": "host", "session_id": "b"},
    {"types": ["assistant.delta"]},
    {"types": ["assistant.delta", "assistant.done"]},
    {"channel": "host", "types": ["assistant.done", "session.error"]},
    {"channel": "host", "session_id": "a", "types": ["assistant.delta"]},
    {"reply_to_msg_id": "tg-1"},
    {"reply_to_msg_id": "tg-1", "channel": "telegram"},
    {"reply_to_msg_id": "host-1", "types": ["assistant.done"]},
    {"after_seq": 4},
    {"after_seq": 4, "channel": "telegram"},
    {"after_seq": 10},
    {"after_seq": 3, "limit": 2},
    {"limit": 1, "channel": "host"},
    {"channel": "nobody"},
]


async def test_a_second_turn_end_posted_to_the_tether_is_refused(deployment: Deployment) -> None:
    """A producer posting turn ends: the first replying to a message is stored, a second (either
    type) is HTTP 400 naming the end that stands, nothing stored (docs/SECURITY.md, "One turn end
    per message"); an end replying to another message is stored."""
    session = {"channel": "host", "id": "t"}
    async with deployment.http_server("--config", str(deployment.config_file("box1"))) as server, server.rest() as rest:
        first, second = [
            (await post(rest, "box1", {"type": "user.message", "session": session, "payload": {"text": t}}))["msg_id"]
            for t in ("one", "two")]
        done = await post(rest, "box1", {"type": "assistant.done", "session": session, "payload": {}, "reply_to": first})
        for type in ("assistant.done", "session.error"):
            refused = await rest.post(TETHER.format("box1"), json={
                "type": type, "session": session, "payload": {}, "reply_to": first})
            assert_error(refused, 400, "invalid_request", "has ended already", f"seq {done['ingress_seq']}")
        await post(rest, "box1", {"type": "session.error", "session": session, "payload": {}, "reply_to": second})
        frames = (await poll(rest, "box1", {"after_seq": 0, "types": "assistant.done,session.error"}))["frames"]
    assert [(f["type"], f["reply_to"]) for f in frames] == [("assistant.done", first), ("session.error", second)], frames


async def test_poll_filters(deployment: Deployment) -> None:
    """channel, session_id, types (comma-separated or repeated), reply_to_msg_id, after_seq, limit."""
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        log = []
        for channel, session, type_, msg_id, reply_to in FILTER_LOG:
            extra = {"msg_id": msg_id} if reply_to is None else {"msg_id": msg_id, "reply_to": reply_to}
            log.append((await post(rest, "box1", frame_body(channel, session, type_, msg_id, **extra)))["frame"])
        assert [f["seq"] for f in log] == list(range(1, 11))

        for case in FILTER_CASES:
            expected = [f for f in log if matches(f, case)][: case.get("limit", 50)]
            next_seq = expected[-1]["seq"] if expected else case.get("after_seq", 0)
            encodings = [{k: v for k, v in case.items() if k != "types"}]
            if "types" in case:
                base = encodings.pop()
                encodings = [
                    {**base, "types": ",".join(case["types"])},  # comma-separated
                    [*base.items(), *(("types", t) for t in case["types"])],  # repeated
                ]
            for params in encodings:
                result = await poll(rest, "box1", params)
                assert result == {"frames": expected, "next_seq": next_seq, "timed_out": False}, (case, params)

        # The same over the Unix socket listener (no token).
        async with server.unix_rest() as unix:
            assert (await poll(unix, "box1", {"channel": "host", "session_id": "a"}))["frames"] == [
                f for f in log if matches(f, {"channel": "host", "session_id": "a"})
            ]


async def test_poll_long_polls_and_times_out(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        started = time.monotonic()
        result = await poll(rest, "box1", {"wait_ms": 300, "channel": "host"})
        elapsed = time.monotonic() - started
        assert result == {"frames": [], "next_seq": 0, "timed_out": True}
        assert 0.25 <= elapsed < 10, elapsed

        async with trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}

            async def long_poll() -> None:
                started = time.monotonic()
                outcome["result"] = await poll(rest, "box1", {"wait_ms": 20000, "channel": "host", "types": "assistant.done"})
                outcome["elapsed"] = time.monotonic() - started
                finished.set()

            finished = trio.Event()
            nursery.start_soon(long_poll)
            # Frames that do not match the filter do not end the poll.
            await post(rest, "box1", frame_body("telegram", "s", "assistant.done", "not this one"))
            await post(rest, "box1", frame_body("host", "s", "assistant.delta", "nor this one"))
            done = await post(rest, "box1", frame_body("host", "s", "assistant.done", "this one"))
            with trio.fail_after(10):
                await finished.wait()
        assert outcome["result"]["frames"] == [done["frame"]]
        assert outcome["result"]["timed_out"] is False
        assert outcome["elapsed"] < 5, outcome["elapsed"]


# -- SSE -------------------------------------------------------------------------------------


async def test_sse_stream_resumes_with_last_event_id(deployment: Deployment) -> None:
    """Each event's id is its seq; frames appended while connected arrive; Last-Event-ID resumes exactly."""
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest, server.rest() as writer:
        first = [(await post(writer, "box1", frame_body("host", "s", text=f"f{n}")))["frame"] for n in range(3)]
        async with sse(rest, "box1") as events:
            seen = [await events.next() for _ in range(3)]
            assert [e["id"] for e in seen] == [str(f["seq"]) for f in first]
            assert all(e["event"] == "frame" for e in seen)
            assert [e["data"] for e in seen] == first
            # Appended while connected: they arrive, in order.
            live = [(await post(writer, "box1", frame_body("host", "s", text=f"live{n}")))["frame"] for n in range(2)]
            seen = [await events.next() for _ in range(2)]
            assert [e["data"] for e in seen] == live
            assert [e["id"] for e in seen] == [str(f["seq"]) for f in live]
            last_id = seen[-1]["id"]

        # Disconnected: these are missed, then read on reconnect. Nothing lost, nothing repeated.
        missed = [(await post(writer, "box1", frame_body("host", "s", text=f"missed{n}")))["frame"] for n in range(2)]
        async with sse(rest, "box1", headers={"Last-Event-ID": last_id}) as events:
            resumed = [await events.next() for _ in range(2)]
            assert [e["data"] for e in resumed] == missed
            newer = (await post(writer, "box1", frame_body("host", "s", text="newer")))["frame"]
            assert (await events.next())["data"] == newer, "the next event is the new frame, not a repeat"
        assert [f["seq"] for f in first + live + missed + [newer]] == list(range(1, 9))

        # after_seq in the query works as a starting point too.
        async with sse(rest, "box1", params={"after_seq": 7}) as events:
            assert (await events.next())["data"] == newer


async def test_sse_stream_filters(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest, server.rest() as writer:
        async with sse(rest, "box1", params={"channel": "host", "session_id": "default", "types": "assistant.done"}) as events:
            await post(writer, "box1", frame_body("telegram", "default", "assistant.done"))
            await post(writer, "box1", frame_body("host", "other", "assistant.done"))
            await post(writer, "box1", frame_body("host", "default", "assistant.delta"))
            wanted = (await post(writer, "box1", frame_body("host", "default", "assistant.done", "yes")))["frame"]
            event = await events.next()
            assert event["data"] == wanted and event["id"] == str(wanted["seq"]) == "4"


async def test_sse_stream_bad_input(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        assert_error(await rest.get(STREAM.format("box1"), headers={"Last-Event-ID": "abc"}), 400, "invalid_params", "Last-Event-ID")
        assert_error(await rest.get(STREAM.format("box1"), headers={"Last-Event-ID": "-1"}), 400, "invalid_params")
        assert_error(await rest.get(STREAM.format("box1"), params={"after_seq": "x"}), 400, "invalid_params", "after_seq")
        assert_error(await rest.get(STREAM.format("nobox")), 404, "not_found", "nobox")
        async with server.rest(token=None) as anonymous:
            assert_error(await anonymous.get(STREAM.format("box1")), 401, "unauthorized")


# -- bad input -------------------------------------------------------------------------------


# In process, the 413 answer leaves Starlette's `Request.stream()` generator unclosed (a ResourceWarning
# the warning filter turns into an error): the server's body reader should close it. Until it does,
# this test runs the real program.
@pytest.mark.real_programs
async def test_bad_input_is_a_clear_error_and_stores_nothing(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        good = frame_body("host", "default", "assistant.delta", "kept")
        stored = [(await post(rest, "box1", good))["frame"]]
        url = TETHER.format("box1")

        # Unknown and invalid instances.
        assert_error(await rest.post(TETHER.format("nobox"), json=good), 404, "not_found", "unknown instance 'nobox'")
        assert_error(await rest.get(POLL.format("nobox")), 404, "not_found", "nobox")
        for bad_id in ("bad id", "-box", "x" * 65, "box$1"):
            assert_error(await rest.post(TETHER.format(bad_id), json=good), 400, "invalid_params", "invalid instance id")
            assert_error(await rest.get(POLL.format(bad_id)), 400, "invalid_params", "invalid instance id")

        # Query parameters of poll.
        for params, needle in (
            ({"after_seq": "-1"}, "after_seq"), ({"after_seq": "abc"}, "after_seq"), ({"after_seq": "1.5"}, "after_seq"),
            ({"limit": "0"}, "limit"), ({"limit": "201"}, "limit"), ({"limit": "many"}, "limit"),
            ({"wait_ms": "-1"}, "wait_ms"), ({"wait_ms": "30001"}, "wait_ms"), ({"wait_ms": "soon"}, "wait_ms"),
        ):
            assert_error(await rest.get(POLL.format("box1"), params=params), 400, "invalid_params", needle)

        # Bodies that are not JSON, or not frames.
        assert_error(await rest.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "parse_error")
        assert_error(await rest.post(url, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400, "parse_error")
        assert_error(await rest.post(url, content=b""), 400, "parse_error")
        not_frames = [
            [good],
            "user.message",
            {"session": {"channel": "host", "id": "default"}, "payload": {}},  # no type
            {"type": "user.message", "payload": {"text": "x"}},  # no session
            {"type": "user.message", "session": {"channel": "host"}},  # no session id
            {"type": "user.message", "session": {"id": "default"}},  # no channel
            {"type": 7, "session": {"channel": "host", "id": "default"}},
            {"type": "user.message", "session": "host:default"},
            {"type": "user.message", "session": {"channel": "host", "id": 12345}},
            {"type": "user.message", "session": {"channel": "host", "id": "default"}, "payload": "text"},
            {"type": "user.message", "session": {"channel": "host", "id": "default"}, "payload": {}, "v": 2},
            {"type": "user.message", "session": {"channel": "host", "id": "default"}, "msg_id": 5},
            {"type": "user.message", "session": {"channel": "host", "id": "default"}, "reply_to": ""},
            {"type": "user.message", "session": {"channel": "a channel", "id": "default"}},
            {"type": "Not A Type", "session": {"channel": "host", "id": "default"}},
        ]
        for body in not_frames:
            assert_error(await rest.post(url, json=body), 400, "invalid_params", "invalid frame")

        # Types only the server makes.
        for server_type in ("caller_tool_request", "caller_tool_result", "caller_tool_cancelled",
                            "approval_request", "approval_resolved"):
            body = frame_body("host", "default", server_type)
            assert_error(await rest.post(url, json=body), 400, "invalid_params", server_type, "server")

        # An oversized body.
        huge = {"type": "user.message", "session": {"channel": "host", "id": "default"},
                "payload": {"text": "x" * (1024 * 1024 + 1024)}}
        assert_error(await rest.post(url, content=json.dumps(huge).encode(), headers={"content-type": "application/json"}),
                     413, "invalid_request", "larger than 1048576 bytes")

        # Nothing of the above was stored, and the unknown instance is still unknown.
        assert (await poll(rest, "box1", {"limit": 200}))["frames"] == stored
        assert (await rest.get(POLL.format("nobox"))).status_code == 404
        # The server is fine: a good frame is stored with the next seq.
        assert (await post(rest, "box1", good))["ingress_seq"] == stored[-1]["seq"] + 1


async def test_bearer_tokens(deployment: Deployment) -> None:
    """The server's token for everything; an instance's token only for its own routes; 401 otherwise."""
    config = deployment.config_file("box1", "box2")
    async with deployment.http_server("--config", str(config)) as server:
        box1_token = deployment.token("box1")
        body = frame_body("host", "default", "assistant.delta", "x")

        async with server.rest() as admin:
            stored = [(await post(admin, "box1", body))["frame"]]
            assert (await admin.get("/v1/health")).status_code == 200

        for token in (None, "not-a-token", box1_token[:-1] + ("0" if box1_token[-1] != "0" else "1")):
            async with server.rest(token=token) as rest:
                for response in (
                    await rest.post(TETHER.format("box1"), json=body),
                    await rest.get(POLL.format("box1")),
                    await rest.get("/v1/health"),
                    await rest.post("/mcp", json={}),
                ):
                    error = assert_error(response, 401, "unauthorized")
                    assert response.headers["www-authenticate"].startswith("Bearer"), response.headers
                    expected = "missing bearer token" if token is None else "not valid"
                    assert expected in error["message"], error

        # Not a bearer scheme: the same as none.
        async with httpx2.AsyncClient(base_url=server.url, headers={"Authorization": f"Basic {box1_token}"}) as rest:
            assert_error(await rest.get(POLL.format("box1")), 401, "unauthorized", "missing bearer token")

        async with server.rest(token=box1_token) as own:
            stored.append((await post(own, "box1", body))["frame"])
            assert (await poll(own, "box1"))["frames"] == stored
            async with own.stream("GET", STREAM.format("box1")) as response:
                assert response.status_code == 200
                assert (await SseEvents(response).next())["data"] == stored[0]
            for response in (
                await own.post(TETHER.format("box2"), json=body),
                await own.get(POLL.format("box2")),
                await own.get(STREAM.format("box2")),
                await own.get("/v1/health"),
                await own.post("/mcp", json={}),
            ):
                assert_error(response, 401, "unauthorized", "not valid")
                assert response.headers["www-authenticate"].startswith("Bearer")

        async with server.rest() as admin:
            assert (await poll(admin, "box1", {"limit": 200}))["frames"] == stored
            assert (await poll(admin, "box2"))["frames"] == [], "box1's token stored nothing for box2"


async def test_unix_socket_listener_needs_no_token_and_is_private(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server:
        mode = os.stat(server.unix_socket).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600, oct(stat.S_IMODE(mode))
        async with server.unix_rest() as unix:
            assert "authorization" not in unix.headers
            health = await unix.get("/v1/health")
            assert health.status_code == 200 and health.json()["ok"] is True
            stored = await post(unix, "box1", frame_body("telegram", "1", "user.message", "over the socket"))
            assert (await poll(unix, "box1"))["frames"] == [stored["frame"]]


async def test_socket_files_are_private_without_changing_the_process_umask(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay's and the HTTP listener's Unix sockets are 0600 without `os.umask`: the umask is
    the whole process's, and other tasks (and the store's threads) create files meanwhile."""
    from oubliette_server.program.app import OublietteServer
    from oubliette_server.program.config import ServerConfig

    def no_umask(mask: int) -> int:
        raise AssertionError(f"os.umask({mask:#o}) changes the mode of every file the process creates")

    http_socket = deployment.root / "http.sock"
    config = ServerConfig(data_dir=deployment.data_dir, relay=deployment.relay, http=[f"unix:{http_socket}"])
    app = OublietteServer(config)
    monkeypatch.setattr(os, "umask", no_umask)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(app.serve)  # the relay and the HTTP listener `config.http` names
            for path in (deployment.socket, http_socket):
                mode = os.stat(path).st_mode
                assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, (path, oct(mode))
            nursery.cancel_scope.cancel()


# -- /mcp Host header ----------------------------------------------------------------------

INITIALIZE = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}},
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def initialize_result(response: Any) -> dict[str, Any]:
    """The JSON-RPC result of an initialize answered as JSON or as one SSE event."""
    if response.headers["content-type"].startswith("application/json"):
        return response.json()["result"]
    data = [line[len("data:"):].strip() for line in response.text.splitlines() if line.startswith("data:")]
    return json.loads(data[0])["result"]


async def test_mcp_rejects_a_foreign_host_header(deployment: Deployment) -> None:
    """DNS-rebinding protection: the SDK answers 421 Misdirected Request for a Host not allowed."""
    async with deployment.http_server() as server, server.rest() as rest:
        rejected = await rest.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "evil.example:8080"})
        assert rejected.status_code == 421, (rejected.status_code, rejected.text)
        # it says which option accepts that Host, in the documented JSON error shape
        assert rejected.json()["error"]["message"] == (
            '/mcp does not accept the Host header "evil.example:8080" (it accepts 127.0.0.1, localhost and [::1], with any port or none); '
            "to accept it, start the server with --allowed-host evil.example:8080 (or [server] allowed_hosts in the config file)"
        )
        plain = await rest.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "evil.example"})
        assert plain.status_code == 421
        accepted = await rest.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS)
        assert accepted.status_code == 200, accepted.text
        assert initialize_result(accepted)["serverInfo"]["name"] == "oubliette-server"


@pytest.mark.real_programs  # the 413 leaves Starlette's body stream unclosed in process, as above
async def test_an_oversized_mcp_body_is_a_json_rpc_error_naming_the_limit(deployment: Deployment) -> None:
    """A 20 MB body on /mcp: 413 with a JSON-RPC error that says the limit, not plain text."""
    from oubliette_server.doors.http_api import MCP_MAX_BODY_BYTES

    huge = {**INITIALIZE, "params": {**INITIALIZE["params"], "padding": "x" * (20 * 1024 * 1024)}}
    async with deployment.http_server() as server, server.rest() as rest:
        refused = await rest.post("/mcp", content=json.dumps(huge).encode(), headers=MCP_HEADERS)
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"] == {"code": -32600, "message": (
            f"Request body too large: /mcp takes at most {MCP_MAX_BODY_BYTES} bytes in one request "
            "(a value inside it is also held to the size limits of docs/SECURITY.md)"
        )}
        accepted = await rest.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS)
        assert accepted.status_code == 200, accepted.text


async def test_mcp_accepts_loopback_hosts_without_a_port(deployment: Deployment) -> None:
    """A client on the Unix listener, or on TCP without a port, sends a bare `Host: localhost`
    (or 127.0.0.1, [::1]): the names the refusal says it accepts, accepted with no port too."""
    async with deployment.http_server() as server, server.rest() as rest, server.unix_rest() as unix:
        for client in (rest, unix):
            for host in ("localhost", "127.0.0.1", "[::1]"):
                accepted = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": host})
                assert accepted.status_code == 200, (host, accepted.status_code, accepted.text)
        # on TCP, any other name is still refused (on the Unix listener no Host is checked)
        foreign = await rest.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "evil.example"})
        assert foreign.status_code == 421, foreign.text


async def test_allowed_host_flag_lets_a_host_through(deployment: Deployment) -> None:
    async with deployment.http_server("--allowed-host", "evil.example:*") as server, server.rest() as rest:
        accepted = await rest.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "evil.example:8080"})
        assert accepted.status_code == 200, (accepted.status_code, accepted.text)
        assert initialize_result(accepted)["serverInfo"]["name"] == "oubliette-server"
        other = await rest.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "other.example:8080"})
        assert other.status_code == 421


# -- a long poll whose client goes away ----------------------------------------------------


@pytest.mark.real_programs
async def test_abandoned_long_poll_leaves_the_server_working(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server:
        async with server.rest() as rest:
            with trio.move_on_after(1.0) as waited:
                await rest.get(POLL.format("box1"), params={"wait_ms": 20000, "channel": "host"})
            assert waited.cancelled_caught, "the poll was still waiting when the client gave up"
        async with server.rest() as rest:
            # A frame the abandoned poll would have returned: nothing may go wrong answering nobody.
            stored = await post(rest, "box1", frame_body("host", "default", "assistant.delta", "late"))
            started = time.monotonic()
            result = await poll(rest, "box1", {"channel": "host"})
            assert time.monotonic() - started < 5
            assert result["frames"] == [stored["frame"]]
            # Long polls still wake on append.
            async with trio.open_nursery() as nursery:
                outcome: dict[str, Any] = {}

                async def long_poll() -> None:
                    outcome["result"] = await poll(rest, "box1", {"wait_ms": 20000, "after_seq": stored["ingress_seq"]})
                    finished.set()

                finished = trio.Event()
                nursery.start_soon(long_poll)
                newer = await post(rest, "box1", frame_body("host", "default", "assistant.delta", "newer"))
                with trio.fail_after(10):
                    await finished.wait()
            assert outcome["result"]["frames"] == [newer["frame"]]
        stderr = server.stderr.decode(errors="replace")
        assert "Traceback" not in stderr and " ERROR " not in stderr, stderr


@pytest.mark.parametrize("endpoint", ["poll", "stream"])
async def test_client_going_away_ends_the_servers_wait(deployment: Deployment, endpoint: str) -> None:
    """A long poll (or SSE stream) whose client disconnects stops waiting at once, not at wait_ms.

    The server is embedded in the test's Trio loop, so the frame store's waiters are visible."""
    async with deployment.embedded_http_server("box1") as server:
        path = (POLL if endpoint == "poll" else STREAM).format("box1")
        async with trio.open_nursery() as nursery:
            client_scope = trio.CancelScope()

            async def abandoned_request() -> None:
                with client_scope:
                    async with server.rest() as client:
                        if endpoint == "poll":
                            await client.get(path, params={"wait_ms": 20000})
                        else:
                            async with client.stream("GET", path) as response:
                                async for _ in response.aiter_lines():
                                    pass

            nursery.start_soon(abandoned_request)
            await server.wait_waiters("box1", 1, timeout=10)
            client_scope.cancel()  # closes the client's connection
        gone_at = time.monotonic()
        await server.wait_waiters("box1", 0, timeout=5)
        assert time.monotonic() - gone_at < 5

        # The server goes on answering, at once, and long polls still wake.
        async with server.rest() as client:
            started = time.monotonic()
            assert (await poll(client, "box1"))["frames"] == []
            assert time.monotonic() - started < 5
            async with trio.open_nursery() as nursery:
                outcome: dict[str, Any] = {}

                async def long_poll() -> None:
                    outcome["result"] = await poll(client, "box1", {"wait_ms": 20000})

                nursery.start_soon(long_poll)
                await server.wait_waiters("box1", 1, timeout=10)
                stored = await post(client, "box1", frame_body("host", "default", "assistant.delta", "hi"))
            assert outcome["result"]["frames"] == [stored["frame"]]
            assert outcome["result"]["timed_out"] is False
            assert server.app.store.waiter_count() == 0


async def test_long_poll_wakes_when_a_frame_is_appended(deployment: Deployment) -> None:
    """Seen from inside: the poll is waiting in the store, a matching append wakes it, well before wait_ms."""
    async with deployment.embedded_http_server("box1") as server, server.rest() as rest:
        async with trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}

            async def long_poll() -> None:
                started = time.monotonic()
                outcome["result"] = await poll(rest, "box1", {"wait_ms": 20000, "channel": "host"})
                outcome["elapsed"] = time.monotonic() - started

            nursery.start_soon(long_poll)
            await server.wait_waiters("box1", 1, timeout=10)
            # A frame of another channel wakes the waiter, which re-queries and goes on waiting.
            await post(rest, "box1", frame_body("telegram", "default", "assistant.delta", "not for host"))
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert "result" not in outcome
            assert server.app.store.waiter_count("box1") == 1
            appended_at = time.monotonic()
            stored = await post(rest, "box1", frame_body("host", "default", "assistant.delta", "for host"))
        assert outcome["result"] == {"frames": [stored["frame"]], "next_seq": stored["ingress_seq"], "timed_out": False}
        assert time.monotonic() - appended_at < 5
        assert outcome["elapsed"] < 15


async def test_unknown_paths_answer_the_json_error_shape(deployment: Deployment) -> None:
    async with deployment.http_server() as server:
        async with server.rest() as admin:
            for path in ("/nowhere", "/v1/instances/box1/other", "/v1"):
                response = await admin.get(path)
                assert response.status_code == 404, (path, response.text)
                assert response.headers["content-type"].startswith("application/json")
                error = response.json()["error"]
                assert error["code"] == -32005 and error["name"] == "not_found"
                assert path in error["message"]
            assert (await admin.get("/v1/health")).status_code == 200
        async with server.rest(token=None) as anonymous:
            assert (await anonymous.get("/nowhere")).status_code == 401  # auth first: paths are not probed


#: How long the slow client below waits between a request's head and its body: long enough that
#: a server answering without the body has answered (and, before the fix, closed) by then.
SLOW_CLIENT_PAUSE = 0.3


async def h11_response(stream: trio.SocketStream, conn: Any) -> tuple[int, dict[bytes, bytes]]:
    """Read one whole response with `conn` (an h11 client connection); its status and headers."""
    import h11

    head: Any = None
    with trio.fail_after(20):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.ConnectionClosed):
                raise AssertionError("the server closed the connection before a whole response")
            if isinstance(event, h11.Response):
                head = event
            if isinstance(event, h11.EndOfMessage):
                return head.status_code, {k.lower(): v for k, v in head.headers}


@pytest.mark.parametrize("refused_by", ["an unknown instance", "a wrong token"])
async def test_a_request_refused_before_its_late_body_leaves_the_connection_usable(deployment: Deployment, refused_by: str) -> None:
    """A POST refused without reading its body, whose body comes after a pause: the response
    comes once the body is in, and the same keep-alive connection answers the next request
    (before, the server closed it after a response that did not say so)."""
    import h11
    from urllib.parse import urlsplit

    async with deployment.http_server() as server:
        where = urlsplit(server.url)
        assert where.hostname is not None and where.port is not None
        stream = await trio.open_tcp_stream(where.hostname, where.port)
        async with stream:
            conn = h11.Connection(our_role=h11.CLIENT)
            body = json.dumps(frame_body("host", "default", "assistant.delta", "late")).encode()
            path = TETHER.format("nobox" if refused_by == "an unknown instance" else "box1")
            token = server.token if refused_by == "an unknown instance" else "not-a-token"
            await stream.send_all(conn.send(h11.Request(method="POST", target=path, headers=[
                ("Host", where.netloc), ("Authorization", f"Bearer {token}"),
                ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            ])))
            await trio.sleep(SLOW_CLIENT_PAUSE)
            await stream.send_all(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status, headers = await h11_response(stream, conn)
            assert status == (404 if refused_by == "an unknown instance" else 401)
            assert headers.get(b"connection") != b"close"
            conn.start_next_cycle()
            await stream.send_all(conn.send(h11.Request(method="GET", target="/v1/health", headers=[
                ("Host", where.netloc), ("Authorization", f"Bearer {server.token}"),
            ])) + conn.send(h11.EndOfMessage()))
            assert (await h11_response(stream, conn))[0] == 200


async def test_a_refusal_waits_only_so_long_for_a_body_that_never_comes(deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that announces a body and never sends it gets its refusal after `DRAIN_SECONDS`,
    with `connection: close`, and the server goes on serving."""
    import h11
    from urllib.parse import urlsplit

    from oubliette_server.doors import http_api

    monkeypatch.setattr(http_api, "DRAIN_SECONDS", 0.2)
    async with deployment.http_server() as server, server.rest() as rest:
        where = urlsplit(server.url)
        assert where.hostname is not None and where.port is not None
        stream = await trio.open_tcp_stream(where.hostname, where.port)
        async with stream:
            conn = h11.Connection(our_role=h11.CLIENT)
            await stream.send_all(conn.send(h11.Request(method="POST", target=TETHER.format("nobox"), headers=[
                ("Host", where.netloc), ("Authorization", "Bearer not-the-token"),  # refused before the body
                ("Content-Type", "application/json"), ("Content-Length", "1000"),
            ])))
            status, headers = await h11_response(stream, conn)
            assert (status, headers.get(b"connection")) == (401, b"close")
        assert (await rest.get("/v1/health")).status_code == 200


# -- graceful stop --------------------------------------------------------------------------


async def test_a_graceful_stop_waits_for_requests_that_change_something_not_for_gets() -> None:
    """`CountRequests` counts a POST while it is answered; a GET (an SSE stream, a long poll) is
    never counted, or every stop with a reader connected would wait its whole grace."""
    from oubliette_server.core.in_flight import InFlight
    from oubliette_server.doors.http_api import CountRequests

    release = trio.Event()

    async def answering(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release.wait()

    in_flight = InFlight()
    counted = CountRequests(answering, in_flight)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(counted, {"type": "http", "method": "GET"}, None, None)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(1):
            await in_flight.wait_none()  # the GET is not waited for
        nursery.start_soon(counted, {"type": "http", "method": "POST"}, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert in_flight.count == 1, f"CountRequests: {in_flight.count} requests counted, one POST in flight"
        release.set()
        with trio.fail_after(1):
            await in_flight.wait_none()


async def test_mcp_on_the_unix_socket_listener_takes_any_host_header(deployment: Deployment) -> None:
    """No browser reaches a socket file, so DNS rebinding cannot: a Unix-socket client's URL
    (`http://localhost/mcp`, `http://oubliette/mcp`) names no host, and `/mcp` answers it."""
    http_socket = deployment.root / "http.sock"
    async with deployment.embedded(http=[f"unix:{http_socket}"]), httpx2.AsyncClient(
        transport=httpx2.AsyncHTTPTransport(uds=str(http_socket)), timeout=20,
    ) as over_unix:
        for url in ("http://localhost/mcp", "http://oubliette/mcp", "http://evil.example:8080/mcp"):
            answered = await over_unix.post(url, json=INITIALIZE, headers=MCP_HEADERS)
            assert answered.status_code == 200, (url, answered.status_code, answered.text)
            assert initialize_result(answered)["serverInfo"]["name"] == "oubliette-server"
