"""The guest runtime (`oubliette-client run -- CMD…`), end to end with the real programs.

The server runs as the caller's stdio MCP server (`deployment.caller()`), the guest
runtime as the sandbox entrypoint (`deployment.guest(instance, command)`). The agent
commands are small Python scripts written to the test's directory. Ordering and
parallelism are checked through files the scripts write and wait for, never through
timing: every wait in these tests is on an event or a file, bounded by `fail_after`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from harness import DEMO_AGENT, PYTHON, Deployment, EventLog, structured, text_of

pytestmark = pytest.mark.in_process

TURN_TIMEOUT = 30.0
from protocol.frames import TURN_END_TYPES
from recording_peer import RecordingPeer

# Prints each line of the message (stdin) on its own stdout line.
ECHO_AGENT = """
import sys
for line in sys.stdin.read().splitlines():
    print(line, flush=True)
"""

# Prints, as one JSON line, its OUBLIETTE_* environment, its arguments, and the MCP config
# file its first argument names (content and permission bits).
ENV_AGENT = """
import json, os, stat, sys
sys.stdin.read()
path = sys.argv[1]
with open(path) as handle:
    config = json.load(handle)
print(json.dumps({
    "env": {k: v for k, v in os.environ.items() if k.startswith("OUBLIETTE_")},
    "argv": sys.argv[1:],
    "config_path": path,
    "config": config,
    "mode": stat.S_IMODE(os.stat(path).st_mode),
}), flush=True)
"""

# A message starting with "fail" prints a line, a lot of stderr ending in a known line,
# and exits 3; any other message is echoed.
FAILING_AGENT = """
import sys
message = sys.stdin.read()
if message.startswith("fail"):
    print("partial answer", flush=True)
    for n in range(2000):
        sys.stderr.write(f"noise line {n:05d} ........................................\\n")
    sys.stderr.write("boom: the agent gave up\\n")
    sys.stderr.flush()
    sys.exit(3)
print("fine: " + message, flush=True)
"""

# The message is a JSON object: {"name", "log", "write"?, "wait_for"?}. Appends
# "start NAME" to the log, prints "started NAME", creates the file `write`, waits for the
# file `wait_for` (60 s at most), appends "end NAME" and prints "done NAME". A copy whose
# guest runtime died (it was re-parented) logs "orphaned NAME" instead of ending.
STEP_AGENT = """
import json, os, sys, time
spec = json.loads(sys.stdin.read())
name = spec["name"]
parent = os.getppid()

def log(event):
    with open(spec["log"], "a") as handle:
        handle.write(f"{event} {name}\\n")

log("start")
print(f"started {name}", flush=True)
if spec.get("write"):
    with open(spec["write"] + ".tmp", "w") as handle:
        handle.write(name)
    os.replace(spec["write"] + ".tmp", spec["write"])
if spec.get("wait_for"):
    deadline = time.monotonic() + 60
    while not os.path.exists(spec["wait_for"]):
        if time.monotonic() > deadline:
            log("gave-up")
            sys.exit(2)
        time.sleep(0.01)  # a file is the test's only word to the agent, and the stdlib has no event for one
    if os.getppid() != parent:
        log("orphaned")
        sys.exit(1)
log("end")
print(f"done {name}", flush=True)
"""


def agent_command(deployment: Deployment, name: str, source: str, *args: str) -> list[str]:
    """Write `source` as a script in the test's directory; the command that runs it."""
    directory = deployment.root / "agents"
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(source)
    return [PYTHON, str(path), *args]


async def send(caller: Client, session_id: str, message: str, instance: str = "box1", **extra: Any) -> dict[str, Any]:
    result = await caller.call_tool("session_message", {
        "instance": instance, "session_id": session_id, "message": message, **extra,
    })
    assert not result.is_error, text_of(result)
    return structured(result)


async def send_and_wait(caller: Client, session_id: str, message: str, **extra: Any) -> dict[str, Any]:
    with trio.fail_after(TURN_TIMEOUT):
        return await send(caller, session_id, message, wait=True, **extra)


async def session_frames(caller: Client, session_id: str) -> list[dict[str, Any]]:
    """Every frame of the session's conversation, read with the `session_events` tool from seq 0
    (not the server's own `session_record` of its owner, which is pushed to nobody)."""
    result = await caller.call_tool("session_events", {"session_id": session_id, "after_seq": 0, "limit": 200})
    assert not result.is_error, text_of(result)
    return [f for f in structured(result)["frames"] if f["type"] != "session_record"]


async def turn_end(events: EventLog, msg_id: str) -> dict[str, Any]:
    """The caller event that ends the turn answering `msg_id`."""
    return await events.wait_for(
        lambda e: e.get("reply_to") == msg_id and e.get("type") in TURN_END_TYPES, timeout=TURN_TIMEOUT,
    )


def replies_to(events: EventLog, msg_id: str, type_: str | None = None) -> list[dict[str, Any]]:
    return [e for e in events.events if e.get("reply_to") == msg_id and (type_ is None or e.get("type") == type_)]


def step(log: Path, name: str, **extra: Path) -> str:
    """A STEP_AGENT message."""
    return json.dumps({"name": name, "log": str(log), **{k: str(v) for k, v in extra.items()}})


def log_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


# -- a turn --------------------------------------------------------------------------------


@pytest.mark.real_programs
async def test_message_runs_command_and_frames_the_turn(deployment: Deployment) -> None:
    """CMD gets the message on stdin; the turn is user.message, presence, one delta per line, done."""
    message = "alpha\nbeta gamma\ndelta"
    async with deployment.caller() as (caller, events), deployment.guest("box1", agent_command(deployment, "echo", ECHO_AGENT)):
        reply = await send_and_wait(caller, "s-echo", message)
        assert reply["stop_reason"] == "end_turn"
        assert reply["text"] == "alpha\nbeta gamma\ndelta"
        assert reply["session_id"] == "s-echo" and reply["instance"] == "box1"
        msg_id = reply["msg_id"]

        # As caller events (pushed as they are appended, in order).
        await turn_end(events, msg_id)
        pushed = [e for e in events.events if e.get("session_id") == "s-echo"]
        assert [e["type"] for e in pushed] == [
            "user.message", "status.presence",
            "assistant.delta", "assistant.delta", "assistant.delta", "assistant.done",
        ]
        user, presence, *deltas, done = pushed
        assert user["msg_id"] == msg_id and user["text"] == message
        assert user["seq"] == reply["ingress_seq"]
        assert presence["state"] == "thinking"
        assert [d["text"] for d in deltas] == ["alpha", "beta gamma", "delta"]
        assert done["text"] == "alpha\nbeta gamma\ndelta"
        for event in pushed[1:]:
            assert event["reply_to"] == msg_id
            assert event["instance"] == "box1" and event["channel"] == "mcp"
        seqs = [e["seq"] for e in pushed]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        # The same frames, read back with session_events.
        frames = await session_frames(caller, "s-echo")
        assert [f["type"] for f in frames] == [e["type"] for e in pushed]
        assert [f["seq"] for f in frames] == seqs
        assert frames[0]["msg_id"] == msg_id and frames[0]["payload"] == {"text": message}
        assert "reply_to" not in frames[0]
        assert frames[1]["payload"] == {"state": "thinking"}
        assert [f["payload"]["text"] for f in frames[2:5]] == ["alpha", "beta gamma", "delta"]
        assert frames[5]["payload"]["text"] == "alpha\nbeta gamma\ndelta"
        for frame in frames:
            assert frame["session"] == {"channel": "mcp", "id": "s-echo"}
            assert frame["instance"] == "box1"
        for frame in frames[1:]:
            assert frame["reply_to"] == msg_id


async def test_command_environment_and_mcp_config(deployment: Deployment) -> None:
    """OUBLIETTE_* env for the session; {mcp_config} is a 0600 file that starts a bound oubliette-client."""
    token = deployment.token("box1")
    command = agent_command(deployment, "env", ENV_AGENT, "{mcp_config}")
    ping = {"name": "ping", "description": "Ping the caller"}
    async with deployment.caller() as (caller, events), deployment.guest("box1", command):
        seen = {}
        for session_id in ("s-env-1", "s-env-2"):
            tools = [dict(ping, name=f"ping_{session_id[-1]}")]
            reply = await send_and_wait(caller, session_id, "show me", context={"caller_id": "myapp", "caller_tools": tools})
            assert reply["stop_reason"] == "end_turn", reply
            seen[session_id] = json.loads(reply["text"])

        for session_id, report in seen.items():
            expected_env = {
                "OUBLIETTE_RELAY": deployment.relay, "OUBLIETTE_INSTANCE": "box1",
                "OUBLIETTE_TOKEN": token, "OUBLIETTE_SESSION": f"mcp:{session_id}",
            }
            for key, value in expected_env.items():
                assert report["env"][key] == value, key
            # The placeholder became the config file's absolute path.
            path = report["config_path"]
            assert report["argv"] == [path] and "{mcp_config}" not in path and os.path.isabs(path)
            assert report["mode"] == 0o600
            servers = report["config"]["mcpServers"]
            assert len(servers) == 1
            entry = next(iter(servers.values()))
            assert entry["type"] == "stdio"
            argv = [entry["command"], *entry["args"]]
            assert argv == [sys.executable, "-m", "oubliette_client"] or os.path.basename(argv[0]) == "oubliette-client", argv
            assert entry["env"] == expected_env
        assert seen["s-env-1"]["config_path"] != seen["s-env-2"]["config_path"]

        # The entry really starts an oubliette-client bound to its session: it lists that
        # session's caller tool (and not the other session's).
        entry = next(iter(seen["s-env-2"]["config"]["mcpServers"].values()))
        params = StdioServerParameters(command=entry["command"], args=entry["args"], env=entry["env"])
        with trio.fail_after(TURN_TIMEOUT):
            async with Client(params, mode="legacy") as agent:
                names = [tool.name for tool in (await agent.list_tools()).tools]
        assert "myapp_ping_2" in names and "myapp_ping_1" not in names


async def test_nonzero_exit_is_session_error(deployment: Deployment) -> None:
    """A failing CMD ends the turn with session.error (exit code, stderr tail); stop_reason error."""
    async with deployment.caller() as (caller, events), deployment.guest("box1", agent_command(deployment, "fail", FAILING_AGENT)):
        reply = await send_and_wait(caller, "s-fail", "fail please")
        assert reply["stop_reason"] == "error"
        # the caller reads why: the end of the agent's stderr and stdout, not only its exit status
        assert reply["text"] == (
            "the agent command exited with status 3; its stderr ends: noise line 01998 "
            "........................................ | noise line 01999 ........................................ | "
            "boom: the agent gave up; its stdout ends: partial answer"
        )
        msg_id = reply["msg_id"]

        error = await turn_end(events, msg_id)
        assert error["type"] == "session.error"
        assert error["exit_code"] == 3
        stderr = error["stderr"]
        assert stderr.endswith("boom: the agent gave up\n")
        total = 2000 * len("noise line 00000 ........................................\n")
        assert len(stderr) < total, "only the tail of stderr is kept"
        assert not replies_to(events, msg_id, "assistant.done")

        frames = await session_frames(caller, "s-fail")
        assert [f["type"] for f in frames] == ["user.message", "status.presence", "assistant.delta", "session.error"]
        assert frames[2]["payload"]["text"] == "partial answer"
        assert frames[3]["payload"]["exit_code"] == 3 and frames[3]["reply_to"] == msg_id

        # The session goes on: the next message is a normal turn.
        again = await send_and_wait(caller, "s-fail", "hello")
        assert again["stop_reason"] == "end_turn" and again["text"] == "fine: hello"


def test_a_failed_agents_last_words_are_bounded_and_escaped() -> None:
    """`output_end` quotes the last lines of each stream, at most OUTPUT_END_CHARS of them, with
    controls, C1 controls and bidi overrides escaped: it reaches the caller and a log line."""
    from oubliette_client.guest import OUTPUT_END_CHARS, output_end

    # `claude -p` not logged in: one line on stdout, nothing on stderr
    assert output_end("", ["Not logged in · Please run /login"]) == "; its stdout ends: Not logged in · Please run /login"
    assert output_end("", []) == "" and output_end("\n \n", ["", "  "]) == ""
    hostile = output_end("a\x1b[2Jb\x9b31m\u202egnp.exe\n" + "x" * 5000, [])
    assert "\x1b" not in hostile and "\x9b" not in hostile and "\u202e" not in hostile
    assert len(hostile) < OUTPUT_END_CHARS + 40 and hostile.endswith("x" * 20)
    escaped = output_end("a\x1b[2Jb\x9b31m\u202egnp.exe", [])
    assert escaped == "; its stderr ends: a\\x1b[2Jb\\x9b31m\\u202egnp.exe"


HANGING_AGENT = """
import sys, time
message = sys.stdin.read()
if message.startswith("hang"):
    print("partial answer", flush=True)
    time.sleep(1000)
print("fine: " + message, flush=True)
"""


async def test_a_turn_past_its_deadline_is_stopped_and_ends_with_session_error(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--turn-timeout` / OUBLIETTE_TURN_TIMEOUT: the waiting caller gets stop_reason error, the session goes on."""
    monkeypatch.setenv("OUBLIETTE_TURN_TIMEOUT", "1")
    async with deployment.caller() as (caller, events), deployment.guest("box1", agent_command(deployment, "hang", HANGING_AGENT)):
        reply = await send_and_wait(caller, "s-hang", "hang please")
        assert reply["stop_reason"] == "error"
        assert reply["text"] == "the agent command did not finish within 1 s (the turn timeout); it was stopped"
        error = await turn_end(events, reply["msg_id"])
        assert error["type"] == "session.error" and error["text"] == "partial answer"
        again = await send_and_wait(caller, "s-hang", "hello")
        assert again["stop_reason"] == "end_turn" and again["text"] == "fine: hello"


# An agent with a child of its own (an MCP client it spawned, say): prints "AGENT_PID CHILD_PID",
# then waits for the child, which sleeps far longer than any test.
TREE_AGENT = ["sh", "-c", 'sleep 600 & echo "$$ $!"; wait']


async def _wait_gone(pid: int) -> None:
    """Until process `pid` has exited (its pidfd is readable), not necessarily our child."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


async def test_the_agent_tree_dies_with_a_runtime_killed_with_sigkill(deployment: Deployment) -> None:
    """`kill -9` of the runtime ends its running turn's agent and the agent's own children within seconds."""
    async with deployment.caller() as (caller, events), deployment.guest("box1", TREE_AGENT) as runtime:
        await send(caller, "s-tree", "sleep, please")
        delta = await events.wait_type("assistant.delta", timeout=TURN_TIMEOUT)
        agent_pid, child_pid = (int(pid) for pid in delta["text"].split())
        os.kill(agent_pid, 0)  # both alive while the runtime is
        os.kill(child_pid, 0)
        runtime.kill()
        try:
            with trio.fail_after(10):
                await runtime.wait()
                await _wait_gone(agent_pid)
                await _wait_gone(child_pid)
        except BaseException:
            for pid in (agent_pid, child_pid):  # a failed run leaves nothing behind
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            raise


def test_the_lifeline_works_whatever_its_descriptor_number() -> None:
    """A runtime with many files open gets a lifeline numbered 10 or more (a POSIX shell's `<&N`
    takes one digit): the agent still runs, with its exit status, and dies when the lifeline ends."""
    from oubliette_client.guest import lifeline_command

    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(12)]
    read_end, write_end = os.pipe()
    try:
        assert read_end >= 10
        done = subprocess.run(lifeline_command(["sh", "-c", "echo ran; exit 3"], read_end), pass_fds=(read_end,),
                              capture_output=True, text=True, timeout=30, start_new_session=True)
        assert (done.returncode, done.stdout, done.stderr) == (3, "ran\n", "")
        agent = subprocess.Popen(lifeline_command(["sleep", "600"], read_end), pass_fds=(read_end,),
                                 start_new_session=True)
        os.close(write_end)  # as when the runtime dies
        write_end = -1
        assert agent.wait(timeout=10) == -9
    finally:
        for fd in [*spare, read_end, write_end]:
            if fd >= 0:
                os.close(fd)


# -- scheduling ----------------------------------------------------------------------------


async def test_one_turn_at_a_time_per_session(deployment: Deployment) -> None:
    """The second message of a session starts only after the first turn has ended."""
    log, gate = deployment.root / "turns.log", deployment.root / "gate"
    async with deployment.caller() as (caller, events), deployment.guest("box1", agent_command(deployment, "step", STEP_AGENT)):
        first = await send(caller, "s-a", step(log, "A1", wait_for=gate))
        second = await send(caller, "s-a", step(log, "A2"))
        # A message to another session, sent after both: once its turn is over the guest has
        # received the second message too (delivery is in seq order on one connection).
        other = await send(caller, "s-b", step(log, "B1"))
        await turn_end(events, other["msg_id"])
        await events.wait_for(lambda e: e.get("reply_to") == first["msg_id"] and e.get("text") == "started A1")

        assert not replies_to(events, second["msg_id"]), "the second turn must wait for the first"
        gate.touch()
        first_end = await turn_end(events, first["msg_id"])
        second_end = await turn_end(events, second["msg_id"])
        assert first_end["type"] == second_end["type"] == "assistant.done"

        assert [line for line in log_lines(log) if line.endswith("A1") or line.endswith("A2")] == [
            "start A1", "end A1", "start A2", "end A2",
        ]
        second_presence = replies_to(events, second["msg_id"], "status.presence")
        assert len(second_presence) == 1 and second_presence[0]["seq"] > first_end["seq"]


async def test_sessions_run_in_parallel(deployment: Deployment) -> None:
    """Two sessions' turns overlap: each CMD waits for a file the other one writes."""
    log = deployment.root / "turns.log"
    mark_a, mark_b = deployment.root / "a-is-running", deployment.root / "b-is-running"
    async with deployment.caller() as (caller, events), deployment.guest("box1", agent_command(deployment, "step", STEP_AGENT)):
        replies: dict[str, dict[str, Any]] = {}

        async def turn(session_id: str, message: str) -> None:
            replies[session_id] = await send(caller, session_id, message, wait=True)

        # Sequential turns would deadlock here (each CMD would wait for a file that only
        # the other, not yet started, writes); the bound turns that into a failure.
        with trio.fail_after(TURN_TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(turn, "s-a", step(log, "A", write=mark_a, wait_for=mark_b))
                nursery.start_soon(turn, "s-b", step(log, "B", write=mark_b, wait_for=mark_a))
        assert replies["s-a"]["stop_reason"] == replies["s-b"]["stop_reason"] == "end_turn"
        assert replies["s-a"]["text"] == "started A\ndone A"
        assert replies["s-b"]["text"] == "started B\ndone B"
        lines = log_lines(log)
        assert sorted(lines) == ["end A", "end B", "start A", "start B"]
        assert set(lines[:2]) == {"start A", "start B"}, "both turns were running at once"


# -- delivery ------------------------------------------------------------------------------


async def test_messages_queued_while_no_guest_run_once_in_order(deployment: Deployment) -> None:
    """Messages sent while no guest is connected run once each, in order, when it connects."""
    log = deployment.root / "turns.log"
    async with deployment.caller() as (caller, events):
        sent = []
        for session_id, name in (("s-a", "A1"), ("s-b", "B1"), ("s-a", "A2"), ("s-a", "A3"), ("s-b", "B2")):
            sent.append(await send(caller, session_id, step(log, name)))
        assert not events.of_type("status.presence")
        assert not log_lines(log)

        async with deployment.guest("box1", agent_command(deployment, "step", STEP_AGENT)):
            ends = [await turn_end(events, reply["msg_id"]) for reply in sent]
            assert all(end["type"] == "assistant.done" for end in ends)
            # A last message per session: a duplicate delivery would be queued before it.
            for session_id, name in (("s-a", "A4"), ("s-b", "B3")):
                reply = await send_and_wait(caller, session_id, step(log, name))
                assert reply["stop_reason"] == "end_turn"

        lines = log_lines(log)
        for name in ("A1", "A2", "A3", "A4", "B1", "B2", "B3"):
            assert lines.count(f"start {name}") == 1 and lines.count(f"end {name}") == 1, (name, lines)
        assert [line for line in lines if line.endswith(("A1", "A2", "A3", "A4"))] == [
            "start A1", "end A1", "start A2", "end A2", "start A3", "end A3", "start A4", "end A4",
        ]
        assert [line for line in lines if line.endswith(("B1", "B2", "B3"))] == [
            "start B1", "end B1", "start B2", "end B2", "start B3", "end B3",
        ]
        for reply in sent:
            assert len(replies_to(events, reply["msg_id"], "status.presence")) == 1
            assert len(replies_to(events, reply["msg_id"], "assistant.done")) == 1


async def test_restarted_guest_gets_only_unacknowledged_messages(deployment: Deployment) -> None:
    """A new guest process gets what came while no guest ran; no turn runs twice.

    M1 finishes under the first guest. M2 is running (blocked on a gate) when that guest is
    killed: the server ends M2's turn with session.error (the guest disconnected mid-turn,
    an orphaned turn), so the second guest does not run it again. M3 is sent while no guest
    runs; the second guest runs it. M1 is never run again.
    """
    log, gate = deployment.root / "turns.log", deployment.root / "gate"
    command = agent_command(deployment, "step", STEP_AGENT)
    async with deployment.caller() as (caller, events):
        async with deployment.guest("box1", command) as first_guest:
            m1 = await send_and_wait(caller, "s-a", step(log, "M1"))
            assert m1["stop_reason"] == "end_turn"
            m2 = await send(caller, "s-a", step(log, "M2", wait_for=gate))
            await events.wait_for(lambda e: e.get("reply_to") == m2["msg_id"] and e.get("text") == "started M2")
            first_guest.kill()
            with trio.fail_after(10):
                await first_guest.wait()
            m2_end = await turn_end(events, m2["msg_id"])

        m3 = await send(caller, "s-a", step(log, "M3"))
        async with deployment.guest("box1", command):
            assert (await turn_end(events, m3["msg_id"]))["type"] == "assistant.done"
            m4 = await send_and_wait(caller, "s-a", step(log, "M4"))
            assert m4["stop_reason"] == "end_turn"
        gate.touch()  # lets the first guest's orphaned agent process (if still alive) exit

        lines = [line for line in log_lines(log) if not line.startswith(("orphaned", "end M2"))]
        assert lines == ["start M1", "end M1", "start M2", "start M3", "end M3", "start M4", "end M4"]
        assert m2_end["type"] == "session.error" and m2_end["reason"] == "guest_disconnected"
        assert replies_to(events, m2["msg_id"], "assistant.done") == []
        assert len(replies_to(events, m2["msg_id"], "status.presence")) == 1
        assert len(replies_to(events, m1["msg_id"], "status.presence")) == 1
        assert len(replies_to(events, m1["msg_id"], "assistant.done")) == 1
        assert len(replies_to(events, m3["msg_id"], "status.presence")) == 1


# -- the demo agent ------------------------------------------------------------------------


@pytest.mark.real_programs
async def test_demo_agent_calls_a_caller_tool(deployment: Deployment) -> None:
    """The scripted demo agent, under the guest runtime, calls the caller's tool; the answer has its result."""
    tools = [{
        "name": "send_notification", "description": "Send a notification",
        "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
    }]
    message = 'Please call myapp_send_notification {"message": "hello"}'
    async with deployment.caller() as (caller, events), deployment.guest("box1", DEMO_AGENT):
        stop = await send_and_wait(caller, "s-demo", message, context={
            "caller_id": "myapp", "caller_tools": tools, "echo_own_answers": True,  # the result event is checked below
        })
        # The wait stops as soon as the agent calls (requires_action), with the request in the result;
        # the event says the same to programs that follow the session.
        assert stop["stop_reason"] == "requires_action", stop
        [pending] = stop["pending"]
        request = await events.wait_type("caller_tool_request", timeout=TURN_TIMEOUT)
        assert pending["request_id"] == request["request_id"]
        assert pending["arguments"] == request["arguments"]
        with trio.fail_after(TURN_TIMEOUT):
            response = await caller.call_tool("caller_tool_response", {
                "session_id": "s-demo", "request_id": pending["request_id"],
                "result": {"status": "sent", "id": 42}, "wait": True,
            })
        reply = structured(response)
        assert reply["resolved"] is True
        assert request["tool"] == "send_notification"
        assert request["arguments"] == {"message": "hello"}
        assert request["session_id"] == "s-demo"
        assert reply["stop_reason"] == "end_turn"
        assert "myapp_send_notification returned" in reply["text"]
        result_line = next(line for line in reply["text"].splitlines() if "returned" in line)
        assert json.loads(result_line.split("returned", 1)[1]) == {"status": "sent", "id": 42}
        await events.wait_type("caller_tool_result", request_id=request["request_id"])


async def test_the_guest_runtime_is_started_as_a_service() -> None:
    """`nursery.start(runtime.run)` returns once its relay link runs (the relay may be down);
    cancelling it removes the temporary directory of MCP configs."""
    from oubliette_client.guest import GuestRuntime
    from oubliette_client.settings import RelaySettings

    runtime = GuestRuntime(RelaySettings(relay="unix:/nonexistent/relay.sock", instance="box1", token="t"), ["true"])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            assert runtime.config_dir is not None and runtime.config_dir.is_dir()
            await runtime.link.attempted.wait()
            nursery.cancel_scope.cancel()
    assert not runtime.config_dir.exists()


# -- exactly-once appends: the guest's side (a fake link, no server) -----------------------


@pytest.mark.parametrize("first, second", [
    ({"append_id"}, {"append_id"}),  # a new server, then another new one: the same id both times
    (set(), {"append_id"}),  # an older server first (no id), then a new one (the id)
    ({"append_id"}, set()),  # a new server, then an older one: no id to the older one
])
async def test_the_guest_sends_one_append_id_per_frame_to_servers_that_list_it(first: set[str], second: set[str]) -> None:
    from oubliette_client.guest import GuestRuntime
    from oubliette_client.settings import RelaySettings
    from protocol import Frame, SessionRef

    runtime = GuestRuntime(RelaySettings(relay="unix:/nonexistent/relay.sock", instance="box1", token="t"), ["true"])
    last = RecordingPeer(runtime.link, frozenset(second))
    broken = RecordingPeer(runtime.link, frozenset(first), then=last)
    broken.connect()
    message = Frame(v=1, seq=3, ts="2026-11-22T10:00:00.123Z", instance="box1", session=SessionRef(channel="mcp", id="s1"),
                    type="user.message", msg_id="m-1", payload={"text": "hi"})
    with trio.fail_after(5):
        await runtime._append(message, "status.presence", {"state": "thinking"})
        sent = [*broken.sent, *last.sent]
        await runtime._append(message, "status.presence", {"state": "thinking"})
    assert len(sent) == 2 and [p.get("append_id") is not None for p in sent] == [bool(first), bool(second)], sent
    ids = {p["append_id"] for p in sent if "append_id" in p}
    assert len(ids) <= 1, f"one id per frame, on every attempt: {sent}"
    assert all(len(i) == 32 for i in ids)
    if second:
        assert last.sent[-1]["append_id"] not in ids, "the next frame has an id of its own"
    assert {k: v for k, v in sent[0].items() if k != "append_id"} == {k: v for k, v in sent[1].items() if k != "append_id"}
