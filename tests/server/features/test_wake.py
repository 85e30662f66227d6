"""Wake on message (docs/TETHER.md, "Wake on message"): a message for an instance whose guest is down starts it.

The server gets a TOML config file (`--config`) that gives instance "box1" a start
command. Here the start command is a small wrapper script that appends one JSON line
(its pid and the environment the server gave it) to a "starts" log, then exec's the guest
runtime (`oubliette-client run -- AGENT`), so the logged pid is the guest runtime's. The
agent appends one JSON line per turn to a "turns" log. Every wait is on a frame (long
poll) or a server log line, bounded by `fail_after`; none is a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio

from harness import PYTHON, Deployment, HttpServer, RawRelay, structured, text_of

TURN_TIMEOUT = 60.0
from protocol.frames import TURN_END_TYPES

# argv: STARTS_LOG TURNS_LOG AGENT_SCRIPT. Logs how it was started, then becomes the guest runtime.
START_WRAPPER = """
import json, os, sys
starts, turns, agent = sys.argv[1:4]
with open(starts, "a") as handle:
    handle.write(json.dumps({
        "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items() if k in ("OUBLIETTE_INSTANCE", "OUBLIETTE_TOKEN", "OUBLIETTE_RELAY")},
    }) + "\\n")
os.execv(sys.executable, [sys.executable, "-m", "oubliette_client", "run", "--log-level", "WARNING", "--",
                          sys.executable, agent, turns])
"""

# argv: TURNS_LOG. One JSON line per turn; answers with the message.
TURN_AGENT = """
import json, os, sys
text = sys.stdin.read()
with open(sys.argv[1], "a") as handle:
    handle.write(json.dumps({
        "session": os.environ.get("OUBLIETTE_SESSION"), "msg_id": os.environ.get("OUBLIETTE_MSG_ID"), "text": text,
    }) + "\\n")
print("answer: " + text, flush=True)
"""

# argv: STARTS_LOG. A start command that fails at once.
FAILING_START = """
import json, os, sys
with open(sys.argv[1], "a") as handle:
    handle.write(json.dumps({"pid": os.getpid()}) + "\\n")
sys.stderr.write("failing start command: cannot start this instance\\n")
sys.exit(3)
"""


class WakeSetup:
    """The scripts and logs of one test, in the deployment's directory."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.dir = deployment.root / "wake"
        self.dir.mkdir()
        self.starts = self.dir / "starts.jsonl"
        self.turns = self.dir / "turns.jsonl"

    def script(self, name: str, source: str) -> Path:
        path = self.dir / f"{name}.py"
        path.write_text(source)
        return path

    def guest_start_command(self) -> list[str]:
        wrapper = self.script("start_guest", START_WRAPPER)
        agent = self.script("agent", TURN_AGENT)
        return [PYTHON, str(wrapper), str(self.starts), str(self.turns), str(agent)]

    def start_lines(self) -> list[dict[str, Any]]:
        return read_jsonl(self.starts)

    def turn_lines(self) -> list[dict[str, Any]]:
        return read_jsonl(self.turns)

    def kill_guests(self) -> None:
        """End every guest runtime this test started (the server stops them on SIGTERM; this is a safety net)."""
        for line in self.start_lines():
            try:
                os.kill(line["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@asynccontextmanager
async def wake_server(deployment: Deployment, setup: WakeSetup, *extra: str) -> AsyncIterator[HttpServer]:
    config = deployment.config_file("box1", start={"box1": setup.guest_start_command()})
    async with deployment.http_server("--config", str(config), *extra) as server:
        try:
            yield server
        finally:
            setup.kill_guests()


async def tether_send(rest: Any, session_id: str, text: str) -> str:
    """The tether's tether_send over HTTP: POST a host user.message; its msg_id."""
    return await post_message(rest, "host", session_id, text)


async def post_message(rest: Any, channel: str, session_id: str, text: str) -> str:
    response = await rest.post("/v1/instances/box1/tether", json={
        "v": 1, "type": "user.message", "session": {"channel": channel, "id": session_id}, "payload": {"text": text},
    })
    assert response.status_code == 201, response.text
    return response.json()["msg_id"]


async def wait_answers(rest: Any, msg_ids: list[str], timeout: float = TURN_TIMEOUT) -> dict[str, dict[str, Any]]:
    """Long-poll the instance's log until a turn end replies to each of `msg_ids`; reply_to -> frame."""
    answers: dict[str, dict[str, Any]] = {}
    cursor = 0
    with trio.fail_after(timeout):
        while not set(msg_ids) <= set(answers):
            response = await rest.get("/v1/instances/box1/tether/poll", params={
                "after_seq": cursor, "types": ",".join(TURN_END_TYPES), "wait_ms": 10_000, "limit": 200,
            })
            assert response.status_code == 200, response.text
            batch = response.json()
            for frame in batch["frames"]:
                assert frame["reply_to"] not in answers, f"two turn ends for one message: {frame}"
                answers[frame["reply_to"]] = frame
            cursor = batch["next_seq"]
    return answers


def assert_answered_once(answers: dict[str, dict[str, Any]], sent: dict[str, tuple[str, str]]) -> None:
    """Each sent message (msg_id -> (session key, text)) ended with assistant.done echoing its text."""
    for msg_id, (_key, text) in sent.items():
        frame = answers[msg_id]
        assert frame["type"] == "assistant.done", frame
        assert frame["payload"]["text"] == "answer: " + text


def turns_by_session(turns: list[dict[str, Any]]) -> dict[str, list[str]]:
    by_session: dict[str, list[str]] = {}
    for turn in turns:
        by_session.setdefault(turn["session"], []).append(turn["text"])
    return by_session


# -- 1. messages wake the instance once ---------------------------------------------------


async def test_messages_to_a_stopped_instance_start_it_once(deployment: Deployment) -> None:
    setup = WakeSetup(deployment)
    async with wake_server(deployment, setup) as server, server.rest() as rest, server.caller() as (caller, _events):
        assert setup.start_lines() == [], "nothing starts the instance before a message"
        sent: dict[str, tuple[str, str]] = {}
        # Three producers, three sessions, sent back to back while the guest is down.
        sent[await tether_send(rest, "a", "a1")] = ("host:a", "a1")
        sent[await post_message(rest, "telegram", "t1", "t-one")] = ("telegram:t1", "t-one")
        reply = await caller.call_tool("tether_send", {"instance": "box1", "session_id": "a", "text": "a2"})
        assert not reply.is_error, text_of(reply)
        sent[structured(reply)["msg_id"]] = ("host:a", "a2")
        reply = await caller.call_tool("session_message", {"instance": "box1", "session_id": "m1", "message": "m-one"})
        assert not reply.is_error, text_of(reply)
        sent[structured(reply)["msg_id"]] = ("mcp:m1", "m-one")
        sent[await tether_send(rest, "a", "a3")] = ("host:a", "a3")
        sent[await post_message(rest, "telegram", "t1", "t-two")] = ("telegram:t1", "t-two")

        answers = await wait_answers(rest, list(sent))
        assert_answered_once(answers, sent)

        # The guest is up now: one more message is answered without another start.
        later = await tether_send(rest, "a", "a4")
        sent[later] = ("host:a", "a4")
        assert_answered_once(await wait_answers(rest, [later]), {later: sent[later]})

        starts = setup.start_lines()
        turns = setup.turn_lines()

    assert len(starts) == 1, f"the start command ran {len(starts)} times for {len(sent)} messages"
    assert starts[0]["env"] == {
        "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": deployment.token("box1"), "OUBLIETTE_RELAY": deployment.relay,
    }
    assert sorted(turn["msg_id"] for turn in turns) == sorted(sent), "every message ran exactly once"
    assert turns_by_session(turns) == {
        "host:a": ["a1", "a2", "a3", "a4"],
        "telegram:t1": ["t-one", "t-two"],
        "mcp:m1": ["m-one"],
    }


# -- 2. a guest that dropped is woken again -------------------------------------------------


async def test_a_dropped_guest_is_woken_again_and_nothing_runs_twice(deployment: Deployment) -> None:
    setup = WakeSetup(deployment)
    # INFO: the server logs when a relay connection ends.
    async with wake_server(deployment, setup, "--log-level", "INFO") as server, server.rest() as rest:
        sent: dict[str, tuple[str, str]] = {}
        first = {await tether_send(rest, "a", "a1"): ("host:a", "a1"),
                 await post_message(rest, "telegram", "t1", "t-one"): ("telegram:t1", "t-one")}
        sent.update(first)
        assert_answered_once(await wait_answers(rest, list(first)), first)
        [first_start] = setup.start_lines()

        os.kill(first_start["pid"], signal.SIGKILL)  # the sandbox goes away without a word
        await server.wait_stderr("oubliette.access", " relay guest box1 ", " closed after ")
        await server.wait_stderr("start command of box1 exited with status -9")

        while_down = {await tether_send(rest, "a", "a2"): ("host:a", "a2"),
                      await post_message(rest, "telegram", "t1", "t-two"): ("telegram:t1", "t-two"),
                      await tether_send(rest, "a", "a3"): ("host:a", "a3")}
        sent.update(while_down)
        answers = await wait_answers(rest, list(sent))
        assert_answered_once(answers, sent)
        starts = setup.start_lines()
        turns = setup.turn_lines()

    assert len(starts) == 2, starts
    assert starts[1]["pid"] != first_start["pid"]
    assert sorted(turn["msg_id"] for turn in turns) == sorted(sent), "every message ran exactly once"
    assert turns_by_session(turns) == {"host:a": ["a1", "a2", "a3"], "telegram:t1": ["t-one", "t-two"]}
    first_run = {turn["msg_id"] for turn in turns[:2]}
    assert first_run == set(first), "the messages sent while it was down ran only after the second start"


# -- 3. a failing start command --------------------------------------------------------------


async def test_a_failing_start_command_is_logged_and_tried_again_by_the_next_message(deployment: Deployment) -> None:
    setup = WakeSetup(deployment)
    failing = setup.script("failing_start", FAILING_START)
    config = deployment.config_file("box1", "box2", start={
        "box1": [PYTHON, str(failing), str(setup.starts)],
        "box2": [str(setup.dir / "no-such-program")],
    })
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        failure = "start command of box1 exited with status 3"
        await tether_send(rest, "a", "first")
        await server.wait_stderr(failure)
        assert len(setup.start_lines()) == 1
        assert server.stderr_lines("failing start command: cannot start this instance"), "its stderr is the server's"

        await tether_send(rest, "a", "second")
        await server.wait_stderr(failure, count=2)
        assert len(setup.start_lines()) == 2

        # A start command that cannot run at all is logged as such, and retried the same way.
        for attempt in (1, 2):
            response = await rest.post("/v1/instances/box2/tether", json={
                "type": "user.message", "session": {"channel": "host", "id": "a"}, "payload": {"text": f"try {attempt}"},
            })
            assert response.status_code == 201, response.text
            lines = await server.wait_stderr("cannot run the start command of box2", count=attempt)
        assert "no-such-program" in lines[0]

        # Nothing ran the messages: each turn ended with the failed start's reason (and its stderr).
        response = await rest.get("/v1/instances/box1/tether/poll", params={"after_seq": 0, "wait_ms": 0})
        frames = response.json()["frames"]
        with trio.fail_after(TURN_TIMEOUT):
            while len(frames) < 4:
                response = await rest.get("/v1/instances/box1/tether/poll", params={
                    "after_seq": frames[-1]["seq"], "wait_ms": 10_000})
                frames += response.json()["frames"]
    # Each message's turn ended after it (the failure is logged before its session.error is
    # stored, so the second message may come before the first one's end).
    messages = {frame["msg_id"]: frame["seq"] for frame in frames if frame["type"] == "user.message"}
    ends = [frame for frame in frames if frame["type"] == "session.error"]
    assert len(messages) == 2 and len(ends) == 2, frames
    assert sorted(end["reply_to"] for end in ends) == sorted(messages), frames
    assert all(end["seq"] > messages[end["reply_to"]] for end in ends), frames
    assert all("cannot start this instance" in end["payload"]["message"] for end in ends)
    assert len(server.stderr_lines(failure)) == 2


# -- 3b. a guest that dies with unread data ---------------------------------------------------


async def test_a_guest_dropping_with_unread_data_leaves_the_server_serving(deployment: Deployment) -> None:
    """A guest killed with a delivery unread resets its connection (ECONNRESET); only that connection ends."""
    setup = WakeSetup(deployment)
    agent = setup.script("agent", TURN_AGENT)
    async with deployment.http_server("--config", str(deployment.config_file("box1")), "--log-level", "INFO") as server, \
            server.rest() as rest:
        m1 = await tether_send(rest, "a", "m1")
        async with RawRelay.connect(deployment) as raw:
            hello = await raw.hello("box1", deployment.token("box1"), role="guest")
            assert "result" in hello, hello
            delivery = await raw.receive(timeout=TURN_TIMEOUT)
            assert delivery is not None and delivery["params"]["frame"]["msg_id"] == m1, delivery
            m2 = await tether_send(rest, "a", "m2")
            # Wait until the delivery of m2 is in this socket's buffer, without reading it ...
            with trio.fail_after(TURN_TIMEOUT):
                await raw.stream.socket.recv(1, socket.MSG_PEEK)
            # ... then close: unread data makes the kernel reset the connection.
            raw.stream.socket.close()
        await server.wait_stderr("oubliette.access", " relay guest box1 ", " closed after ")

        health = await rest.get("/v1/health")
        assert health.status_code == 200 and health.json()["ok"] is True
        # Neither message was acknowledged: a guest that comes now answers both, once each.
        async with deployment.guest("box1", [PYTHON, str(agent), str(setup.turns)]):
            answers = await wait_answers(rest, [m1, m2])
    # Ended by the harness's SIGTERM (a clean exit, 0), not by a crash.
    assert server.process.returncode == 0, server.stderr.decode()
    assert b"Traceback" not in server.stderr
    assert {answers[m]["type"] for m in (m1, m2)} == {"assistant.done"}
    assert [turn["text"] for turn in setup.turn_lines()] == ["m1", "m2"]


# -- 4. an old start that fails late ---------------------------------------------------------

# argv: DIR. Logs "gate-start N pid P" to its stderr (the server's), waits for the file DIR/exit-N
# (60 s at most; it stops waiting when DIR is removed), then exits 1: a start command that
# fails long after it began.
LATE_FAILING_START = """
import os, sys, time
directory = sys.argv[1]
n = 1
while os.path.exists(os.path.join(directory, f"started-{n}")):
    n += 1
open(os.path.join(directory, f"started-{n}"), "w").close()
print(f"gate-start {n} pid {os.getpid()}", file=sys.stderr, flush=True)
deadline = time.monotonic() + 60
while (not os.path.exists(os.path.join(directory, f"exit-{n}")) and os.path.isdir(directory)
       and time.monotonic() < deadline):
    time.sleep(0.01)  # a file is the test's only word to a start command, and the stdlib has no event for one
sys.exit(1)
"""


async def test_an_earlier_start_failing_late_does_not_let_a_third_start_begin(deployment: Deployment) -> None:
    """Start 1 is still running when its guest drops and start 2 begins; start 1 then fails.

    Start 2 is still in progress, so the next message must not run the start command a third time.
    """
    setup = WakeSetup(deployment)
    gate = setup.script("late_failing_start", LATE_FAILING_START)
    agent = setup.script("agent", TURN_AGENT)
    config = deployment.config_file("box1", start={"box1": [PYTHON, str(gate), str(setup.dir)]})
    try:
        async with deployment.http_server("--config", str(config), "--log-level", "INFO") as server, \
                server.rest() as rest:
            m1 = await tether_send(rest, "a", "m1")
            await server.wait_stderr("gate-start 1 ")
            # The test plays the guest that start 1 brought up; it answers m1, then goes away.
            async with deployment.guest("box1", [PYTHON, str(agent), str(setup.turns)]):
                await wait_answers(rest, [m1])
            await server.wait_stderr("oubliette.access", " relay guest box1 ", " closed after ")

            m2 = await tether_send(rest, "a", "m2")
            await server.wait_stderr("gate-start 2 ")
            (setup.dir / "exit-1").touch()  # start 1 fails now, while start 2 is in progress
            await server.wait_stderr("start command of box1 exited with status 1")

            m3 = await tether_send(rest, "a", "m3")
            # Start 2's guest comes up (played by the test again) and answers both messages.
            async with deployment.guest("box1", [PYTHON, str(agent), str(setup.turns)]):
                answers = await wait_answers(rest, [m2, m3])
                # Counted while this guest is connected: when it leaves, a message whose ack had
                # not landed yet rightly wakes the instance again, which is not what this test is about.
                wakes = server.stderr_lines("waking box1")
                gate_starts = server.stderr_lines("gate-start")
            (setup.dir / "exit-2").touch()  # let start 2 end too, while the server is there to reap it
            await server.wait_stderr("start command of box1 exited with status 1", count=2)
    finally:
        for n in range(1, 5):
            (setup.dir / f"exit-{n}").touch()
    assert {answers[m]["type"] for m in (m2, m3)} == {"assistant.done"}
    assert len(wakes) == 2, wakes
    assert len(gate_starts) == 2, gate_starts


# -- 5. config file errors --------------------------------------------------------------------


BAD_CONFIGS = {
    "unknown section": ("[bogus]\nx = 1\n", "unknown section(s) bogus"),
    "unknown server key": ("[server]\ncaler_timeout = 5\n", "unknown [server] key 'caler_timeout'"),
    "wrong server type": ('[server]\ncaller_timeout = "fast"\n', "[server] caller_timeout must be a number, not a string (\"fast\")"),
    "boolean for a number": ("[server]\nretention_frames = true\n", "[server] retention_frames must be an integer, not true or false (true)"),
    "list of non-strings": ("[server]\nhttp = [8765]\n", "[server] http must be a list of strings"),
    "wrong start type": ("[instances.box1]\nstart = 5\n", "[instances.box1] start must be a string or a list"),
    "instance not a table": ('[instances]\nbox1 = "docker start box1"\n', "[instances.box1] must be a table"),
    "unknown instance key": ('[instances.box1]\nstrat = "docker start box1"\n', "'strat'"),
    "not TOML": ("[server\n", "is not valid TOML"),
    "wrong toolset type": (
        '[toolsets.t]\nkind = "mcp"\nprefix = "t"\ncommand = "x"\ntimeout = "5"\n',
        '[toolsets.t]: timeout must be a number, not a string ("5")',
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
async def test_config_file_errors_stop_the_server_with_a_clear_message(deployment: Deployment, case: str) -> None:
    text, expected = BAD_CONFIGS[case]
    path = deployment.root / "bad.toml"
    path.write_text(text)
    with trio.move_on_after(30):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_server", "--config", str(path), "--no-stdio",
             "--data-dir", str(deployment.data_dir), "--relay", deployment.relay],
            stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False,
        )
        stderr = done.stderr.decode(errors="replace")
        assert done.returncode != 0, stderr
        assert f"config file {path}" in stderr and expected in stderr, stderr
        assert "Traceback" not in stderr, stderr
        return
    pytest.fail(f"oubliette-server kept running with the bad config ({case})")


async def test_missing_config_file_is_a_clear_error(deployment: Deployment) -> None:
    path = deployment.root / "absent.toml"
    with trio.fail_after(30):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_server", "--config", str(path), "--no-stdio", "--data-dir", str(deployment.data_dir)],
            stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False,
        )
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode != 0
    assert f"cannot read config file {path}" in stderr and "Traceback" not in stderr, stderr


# -- SIGTERM ends the server and the guests it started ------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_sigterm_stops_the_server_and_the_guests_it_started(deployment: Deployment) -> None:
    setup = WakeSetup(deployment)
    async with wake_server(deployment, setup) as server, server.rest() as rest:
        msg_id = await tether_send(rest, "a", "hello")
        await wait_answers(rest, [msg_id])
        [start] = setup.start_lines()
        assert _alive(start["pid"])
        server.process.terminate()  # SIGTERM
        with trio.fail_after(30):
            code = await server.process.wait()
        assert code == 0, server.stderr.decode(errors="replace")[-2000:]
        # The guest runtime was a child of the server: it was stopped and reaped with it.
        assert not _alive(start["pid"])
        assert b"Traceback" not in server.stderr
