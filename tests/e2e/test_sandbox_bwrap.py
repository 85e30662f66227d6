"""The guest runtime and an agent inside a real sandbox made with bubblewrap (`bwrap`).

`examples/sandbox/bwrap-run.sh` builds the sandbox the Docker image in the same directory
describes: a read-only system (only /usr, /lib*, /bin, /sbin, /etc, and read-only the Python
and this checkout that hold the installed programs), no network (its own network namespace:
not even the host's loopback), its own PID namespace, a private /tmp, and the relay socket
bound at /oubliette/relay.sock. A full relayed caller tool call and a tether turn go through
it. The agent's side runs as uid 10001, as the Docker image's agent does, while the server runs
as this test's user (root): the server's `--relay-group` makes the socket 0660 with a group the
sandbox's user is given (`bwrap-run.sh --uid`), and nothing else (docs/SECURITY.md, "The relay socket").
bubblewrap is the Debian package `bubblewrap`; .ci/run installs it when it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from harness import EVENT_TIMEOUT, PYTHON, Deployment, structured

REPO = Path(__file__).resolve().parents[2]
BWRAP_RUN = REPO / "examples" / "sandbox" / "bwrap-run.sh"
#: The Docker image's agent user (examples/sandbox/Dockerfile), and the relay socket's group (no user's own).
AGENT_UID = 10001
RELAY_GROUP = 4243
CALLER_TOOLS = [{
    "name": "send_notification",
    "description": "Send a notification to the user of myapp",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
}]


def read_only_paths() -> list[str]:
    """What the sandbox needs of the host besides the system, which bwrap-run.sh finds by itself
    from the command's venv: the venv, its Python, this checkout (an editable install)."""
    paths = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, REPO)}
    return sorted(p for p in paths if not p.startswith("/usr/"))


def sandboxed(socket: Path, *command: str) -> list[str]:
    """The script as a user runs it: no `--ro` paths given, the agent's uid, the venv's Python as the command."""
    assert shutil.which("bwrap"), "bubblewrap is not installed: apt-get install -y bubblewrap (.ci/run does)"
    assert os.getuid() != AGENT_UID
    return ["sh", str(BWRAP_RUN), str(socket), "--uid", str(AGENT_UID), "--", *command]


def uid_of_process_with(token: str) -> int:
    """The uid of the process whose environment holds `token` and that runs `oubliette_client run`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if cmdline[1:4] == [b"-m", b"oubliette_client", b"run"] and f"OUBLIETTE_TOKEN={token}".encode() in environ:
            return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    raise AssertionError("no guest runtime found")


def sandbox_env(deployment: Deployment, instance: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "OUBLIETTE_INSTANCE": instance,
            "OUBLIETTE_TOKEN": deployment.token(instance)}


@asynccontextmanager
async def sandboxed_guest(deployment: Deployment, instance: str) -> AsyncIterator[trio.Process]:
    """`oubliette-client run -- oubliette-client demo-agent --mcp-config {mcp_config}` in the sandbox."""
    command = sandboxed(
        deployment.socket, PYTHON, "-m", "oubliette_client", "run", "--log-level", "WARNING", "--",
        PYTHON, "-m", "oubliette_client", "demo-agent", "--mcp-config", "{mcp_config}",
    )
    with open(deployment.root / "guest.log", "wb") as stderr:
        process = await trio.lowlevel.open_process(command, env=sandbox_env(deployment, instance), stderr=stderr)
    try:
        yield process
    finally:
        process.terminate()  # bwrap dies; --die-with-parent and the PID namespace take the rest
        with trio.CancelScope(shield=True):
            await process.wait()


async def test_the_sandbox_is_closed(deployment: Deployment) -> None:
    """What the agent's side can reach: no host network, no writable system, only the relay socket."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    (deployment.root / "host-secret").write_text("not for the sandbox")
    probe = f"""
import os, socket
out = {{}}
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close(); out["tcp"] = "connected"
except OSError as exc:
    out["tcp"] = type(exc).__name__
for path in ("/usr/oubliette-probe", "{REPO}/oubliette-probe", "/oubliette/other"):
    try:
        open(path, "w").close(); out[path] = "written"
    except OSError as exc:
        out[path] = "refused"
out["oubliette"] = sorted(os.listdir("/oubliette"))
out["host_file"] = os.path.exists("{deployment.root / 'host-secret'}")
open("/tmp/mine", "w").close(); out["tmp"] = sorted(os.listdir("/tmp"))
out["pid"] = os.getpid()
out["ids"] = [os.getuid(), os.getgid(), os.getgroups()]
out["env"] = sorted(k for k in os.environ if k.startswith("OUBLIETTE_"))
print(__import__("json").dumps(out))
"""
    deployment.data_dir.mkdir(parents=True, exist_ok=True)
    sock = trio.socket.socket(trio.socket.AF_UNIX)
    await sock.bind(str(deployment.socket))
    os.chown(deployment.socket, -1, RELAY_GROUP)  # as `oubliette-server --relay-group` leaves it
    try:
        with trio.fail_after(EVENT_TIMEOUT):
            done = await trio.run_process(
                sandboxed(deployment.socket, PYTHON, "-c", probe), env=sandbox_env(deployment, "box1"),
                capture_stdout=True, capture_stderr=True, check=False,
            )
    finally:
        sock.close()
        await listener.aclose()
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out = json.loads(done.stdout)
    assert out["tcp"] != "connected"
    assert out["/usr/oubliette-probe"] == out[f"{REPO}/oubliette-probe"] == out["/oubliette/other"] == "refused"
    assert out["oubliette"] == ["relay.sock"]
    assert out["host_file"] is False
    # Private /tmp: only what the probe wrote, plus the mount points of read-only paths that live
    # under /tmp (a checkout or venv there, as in a CI clone).
    bound_under_tmp = {Path(p).parts[2] for p in read_only_paths() if Path(p).parts[1:2] == ("tmp",) and len(Path(p).parts) > 2}
    assert out["tmp"] == sorted({"mine"} | bound_under_tmp)
    assert out["pid"] < 10  # its own PID namespace
    assert out["ids"] == [AGENT_UID, AGENT_UID, [RELAY_GROUP]]  # not root; of the host's groups, the socket's alone
    assert out["env"] == ["OUBLIETTE_INSTANCE", "OUBLIETTE_RELAY", "OUBLIETTE_TOKEN"]
    assert not (REPO / "oubliette-probe").exists()


async def test_relayed_call_and_tether_turn_through_the_sandbox(deployment: Deployment) -> None:
    async with deployment.caller("--relay-group", str(RELAY_GROUP)) as (caller, log), \
            sandboxed_guest(deployment, "box1") as guest:

        with trio.fail_after(60):
            stopped = structured(await caller.call_tool("session_message", {
                "instance": "box1", "message": 'Please call myapp_send_notification {"message": "hello"}',
                "wait": True, "context": {"caller_id": "myapp", "caller_tools": CALLER_TOOLS},
            }))
            assert stopped["stop_reason"] == "requires_action", stopped
            [pending] = stopped["pending"]
            reply = structured(await caller.call_tool("caller_tool_response", {
                "session_id": stopped["session_id"], "request_id": pending["request_id"],
                "result": {"status": "sent"}, "wait": True,
            }))
        assert reply["stop_reason"] == "end_turn", reply
        assert 'myapp_send_notification returned {"status": "sent"}' in reply["text"]
        request = log.of_type("caller_tool_request")
        assert [(r["tool"], r["arguments"]) for r in request] == [("send_notification", {"message": "hello"})]

        sent = structured(await caller.call_tool("tether_send", {"instance": "box1", "text": "hi from the host"}))
        frames: list[dict[str, Any]] = []
        cursor = sent["ingress_seq"]
        with trio.fail_after(60):
            while not any(f["type"] == "assistant.done" for f in frames):
                page = structured(await caller.call_tool("tether_read", {
                    "instance": "box1", "after_seq": cursor, "wait_ms": 10000,
                }))
                frames += page["frames"]
                cursor = page["next_seq"]
        done = next(f for f in frames if f["type"] == "assistant.done")
        assert done["reply_to"] == sent["msg_id"]
        assert "You said: hi from the host" in done["payload"]["text"]
        assert guest.returncode is None  # the sandbox is still serving
        assert uid_of_process_with(deployment.token("box1")) == AGENT_UID  # the server is root, the guest is not


async def test_without_a_relay_group_the_agent_user_is_not_let_in(deployment: Deployment) -> None:
    """The socket stays 0600, the server's user's alone: bwrap-run.sh says what to do instead of
    giving the agent root's group."""
    async with deployment.caller():
        done = await trio.run_process(
            sandboxed(deployment.socket, PYTHON, "-m", "oubliette_client", "tools", "list"),
            env=sandbox_env(deployment, "box1"), capture_stdout=True, capture_stderr=True, check=False,
        )
    assert done.returncode == 2
    assert b"start oubliette-server with --relay-group GROUP so that uid 10001 may use it" in done.stderr


async def test_bwrap_run_refuses_a_bad_command_line() -> None:
    done = await trio.run_process(["sh", str(BWRAP_RUN), "/nowhere"], capture_stderr=True, check=False,
                                  stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert b"usage: bwrap-run.sh" in done.stderr


def test_the_dockerfile_runs_what_the_bwrap_test_runs() -> None:
    """The image is not built here (no Docker engine); its entrypoint and socket path match the test's."""
    dockerfile = (REPO / "examples" / "sandbox" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["oubliette-client", "run", "--"]' in dockerfile
    assert 'CMD ["oubliette-client", "demo-agent", "--mcp-config", "{mcp_config}"]' in dockerfile
    assert "ENV OUBLIETTE_RELAY=unix:/oubliette/relay.sock" in dockerfile
    assert "--setenv OUBLIETTE_RELAY unix:/oubliette/relay.sock" in BWRAP_RUN.read_text()
    assert f"useradd --create-home --uid {AGENT_UID} agent" in dockerfile and "USER agent" in dockerfile
    assert "--group-add" in dockerfile and "--relay-group" in dockerfile
    # The image installs the sandbox distribution (tests/lint/test_packaging.py installs the same one): no server.
    assert "COPY . ./" in dockerfile  # the build context: what .dockerignore lets in
    context = (REPO / ".dockerignore").read_text().splitlines()
    for package in ("protocol", "oubliette_runtime", "oubliette_client", "sandbox"):
        assert f"!{package}" in context
    assert "RUN pip wheel --no-deps -w /wheels ./sandbox" in dockerfile
    assert "oubliette_server" not in dockerfile
