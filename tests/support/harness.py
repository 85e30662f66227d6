"""Test harness: run the programs and drive them with the MCP SDK.

Each test gets a short temporary directory (Unix socket paths are limited to
~100 bytes), a server started as the caller's stdio MCP server, and helpers to
start guest runtimes, agents (the SDK's client spawning `oubliette-client`)
and raw relay connections. `Deployment` starts the real programs as
subprocesses; `InProcessDeployment` (a module marked `in_process`) runs the
server and the stdio client in the test's Trio loop with the same interface.
Tokens are computed in process, as `oubliette-server token` computes them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, TextIO

import mcp_types as types
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from oubliette_server.core.auth import TokenAuthority

PYTHON = sys.executable
EVENT_TIMEOUT = 20.0
HTTP_TOKEN_NAME = "http:admin"
"""The reserved name the HTTP bearer token is derived under (oubliette_server.program.cli `http-token`)."""


def fresh_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="oub-", dir="/tmp"))


class EventLog:
    """Caller events (notifications/message data from the `oubliette` logger), awaitable."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._changed = trio.Event()

    async def on_log(self, params: Any) -> None:
        if getattr(params, "logger", None) == "oubliette" and isinstance(params.data, dict):
            self.events.append(params.data)
            self._changed.set()
            self._changed = trio.Event()

    def callback_if(self, events: bool) -> dict[str, Any]:
        """The `Client` keyword that delivers events here, or none (a caller that reads no events)."""
        return {"logging_callback": self.on_log} if events else {}

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == type_]

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
        """The first event (already seen or coming) that satisfies `predicate`."""
        seen = 0
        with trio.fail_after(timeout):
            while True:
                for event in self.events[seen:]:
                    if predicate(event):
                        return event
                seen = len(self.events)
                await self._changed.wait()

    async def wait_type(self, type_: str, timeout: float = EVENT_TIMEOUT, **fields: Any) -> dict[str, Any]:
        return await self.wait_for(
            lambda e: e.get("type") == type_ and all(e.get(k) == v for k, v in fields.items()), timeout
        )


class ListChanged:
    """A legacy agent's `message_handler` that counts `notifications/tools/list_changed`."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = trio.Event()

    async def __call__(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.count += 1
            self._changed.set()
            self._changed = trio.Event()

    async def wait_beyond(self, seen: int, timeout: float = EVENT_TIMEOUT) -> int:
        """Wait until more than `seen` notifications arrived; the new count."""
        with trio.fail_after(timeout):
            while self.count <= seen:
                await self._changed.wait()
        return self.count


def structured(result: Any) -> dict[str, Any]:
    """A tool result's structured content, or its text parsed as JSON."""
    if result.structured_content is not None:
        return result.structured_content
    return json.loads(result.content[0].text)


def text_of(result: Any) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


_STORE_TOKENS: dict[tuple[str, ...], str] = {}
"""`Deployment._store_token`'s answers by (store URL, command)."""


class Deployment:
    """One server's files: data dir, relay address, tokens."""

    def __init__(self, root: Path | None = None, store: str | None = None) -> None:
        self.store = store
        """The server's `--store` (a PostgreSQL URI), or None for SQLite in the data dir."""
        self.root = root or fresh_dir()
        self.data_dir = self.root / "data"
        self.socket = self.root / "relay.sock"
        self.relay = f"unix:{self.socket}"

    def token(self, instance: str) -> str:
        """The instance's relay token, computed in process as `oubliette-server token INSTANCE` does
        (tests/server/core/test_auth.py checks that the command prints the same value). With a PostgreSQL store the
        secret is the deployment's, in the database: the command itself is asked."""
        if self.store:
            return self._store_token("token", instance)
        return TokenAuthority.for_data_dir(self.data_dir).token_for(instance)

    def http_token(self, principal: str | None = None) -> str:
        """The HTTP API's bearer token (the admin's, or a named `principal`'s), computed in process
        as `oubliette-server http-token [--principal NAME]` does."""
        if self.store:
            return self._store_token("http-token", *(["--principal", principal] if principal else []))
        name = f"http:{principal}" if principal else HTTP_TOKEN_NAME
        return TokenAuthority.for_data_dir(self.data_dir).token_for(name)

    def _store_token(self, *command: str) -> str:
        """`oubliette-server token|http-token … --store URL`: the token every server of the deployment accepts.

        Asked once per database and name: the secret never changes once stored, and every test's
        database is a new one (tests/support/postgres.py), so the answer is kept for the test's other
        deployments and calls (each command is a Python process of ~0.25 s CPU)."""
        assert self.store is not None
        key = (self.store, *command)
        if key not in _STORE_TOKENS:
            done = subprocess.run(
                [PYTHON, "-m", "oubliette_server", *command, "--store", self.store],
                capture_output=True, text=True, timeout=60, check=True,
            )
            _STORE_TOKENS[key] = done.stdout.strip()
        return _STORE_TOKENS[key]

    @asynccontextmanager
    async def http_server(
        self, *extra: str, nofile: int | None = None, env: dict[str, str] | None = None, unix_http: bool = True,
    ) -> AsyncIterator["HttpServer"]:
        """Start oubliette-server with TCP (port 0) and Unix HTTP listeners (`unix_http` False: TCP
        only) and no stdio caller.

        It reads the server's stderr until the ready line, then keeps draining it
        (into `HttpServer.stderr`) so the pipe never fills. `nofile`: the server's
        `RLIMIT_NOFILE` (its descriptor limit), set in the child before it starts; `env`:
        variables added to the server's environment.
        """

        def limit_descriptors() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_server", "--relay", self.relay, "--data-dir", str(self.data_dir),
             "--http", "127.0.0.1:0", *(["--http", f"unix:{self.root / 'http.sock'}"] if unix_http else []), "--no-stdio",
             "--log-level", "WARNING", *self.store_args(), *extra],
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit_descriptors,
            env={**os.environ, **env} if env else None,
        )
        assert process.stderr is not None
        buffer = bytearray()
        try:
            with trio.fail_after(30):
                while READY_PREFIX not in buffer or b"\n" not in buffer[buffer.index(READY_PREFIX):]:
                    chunk = await process.stderr.receive_some(65536)
                    if not chunk:
                        raise RuntimeError("oubliette-server exited before it was ready:\n" + buffer.decode(errors="replace"))
                    buffer.extend(chunk)
            start = buffer.index(READY_PREFIX) + len(READY_PREFIX)
            ready = json.loads(buffer[start: buffer.index(b"\n", start)])
            server = HttpServer(self, process, ready)
            server.stderr.extend(buffer)

            async def drain() -> None:
                while chunk := await process.stderr.receive_some(65536):
                    server._stderr_received(chunk)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                yield server
                nursery.cancel_scope.cancel()
        finally:
            if process.returncode is None:
                process.terminate()
            with trio.CancelScope(shield=True):
                await process.wait()

    def server_parameters(self, *extra: str) -> StdioServerParameters:
        return StdioServerParameters(
            command=PYTHON,
            args=["-m", "oubliette_server", "--relay", self.relay, "--data-dir", str(self.data_dir),
                  "--log-level", "WARNING", *self.store_args(), *extra],
        )

    def store_args(self) -> list[str]:
        """`--store URL` when this deployment's server keeps its log in PostgreSQL."""
        return ["--store", self.store] if self.store else []

    def client_env(self, instance: str, session: str | None = None, token: str | None = None) -> dict[str, str]:
        env = {"OUBLIETTE_RELAY": self.relay, "OUBLIETTE_INSTANCE": instance,
               "OUBLIETTE_TOKEN": token if token is not None else self.token(instance)}
        if session:
            env["OUBLIETTE_SESSION"] = session
        return env

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def turn_ends(self, instance: str) -> dict[str, int]:
        """How many turn ends (`TURN_END_TYPES`) each `user.message` of `instance` has in this
        deployment's log (its SQLite file, or its PostgreSQL database), read directly."""
        from protocol.frames import TURN_END_TYPES

        sql = "SELECT f.type, f.msg_id, f.reply_to FROM frames f "
        if self.store:
            import psycopg

            with psycopg.connect(self.store) as pg:
                rows = pg.execute(sql + "WHERE f.instance = %s", (instance,)).fetchall()
        else:
            import sqlite3

            with contextlib.closing(sqlite3.connect(self.data_dir / "frames.sqlite3")) as db:
                rows = db.execute(sql + "JOIN instances i ON i.iid = f.iid WHERE i.name = ?", (instance,)).fetchall()
        ends = {msg_id: 0 for type, msg_id, _ in rows if type == "user.message"}
        for type, _, reply_to in rows:
            if type in TURN_END_TYPES and reply_to in ends:
                ends[reply_to] += 1
        return ends

    def config_file(self, *instances: str, start: dict[str, list[str]] | None = None) -> Path:
        """A server config file (pass it as `--config PATH`) that declares `instances`.

        A declared instance is known to the tether API before its guest ever connects.
        `start` gives instances a wake-on-message start command.
        """
        start = start or {}
        lines: list[str] = []
        for name in dict.fromkeys([*instances, *start]):
            lines.append(f"[instances.{json.dumps(name)}]")
            if name in start:
                lines.append("start = [" + ", ".join(json.dumps(part) for part in start[name]) + "]")
        path = self.root / "oubliette.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    @asynccontextmanager
    async def embedded(self, *, store: Any = None, **settings: Any) -> AsyncIterator["EmbeddedApp"]:
        """`embedded_app` on this deployment's data directory and relay socket, the rest of its
        `ServerConfig` from `settings` (`http=["127.0.0.1:0"]` for an HTTP listener)."""
        from oubliette_server.program.config import ServerConfig

        config = ServerConfig(data_dir=self.data_dir, relay=self.relay, **settings)
        async with embedded_app(config, store=store) as embedded:
            yield embedded

    @asynccontextmanager
    async def embedded_http_server(self, *instances: str) -> AsyncIterator["EmbeddedHttpServer"]:
        """The server embedded in the test's own Trio loop (README.md, "Embedding") with a TCP
        HTTP listener, `instances` configured: for tests that look at its state (e.g. the
        frame store's long-poll waiters) directly."""
        async with self.embedded(http=["127.0.0.1:0"], instances={name: {} for name in instances}) as embedded:
            yield embedded.http_server(self)

    @asynccontextmanager
    async def caller(self, *extra: str, mode: str = "legacy", events: bool = True) -> AsyncIterator[tuple[Client, EventLog]]:
        """Start oubliette-server as this caller's stdio MCP server.

        `events=False`: a caller with no logging callback, which acts on tool results only (its
        EventLog stays empty)."""
        log = EventLog()
        async with Client(self.server_parameters(*extra), mode=mode, **log.callback_if(events)) as client:
            # The server binds the relay socket before it serves stdio, so it is ready now.
            yield client, log

    @asynccontextmanager
    async def agent(
        self, instance: str, session: str | None = None, *, mode: str = "legacy",
        token: str | None = None, extra_args: tuple[str, ...] = (), message_handler: Any = None,
        errlog: TextIO | None = None,
    ) -> AsyncIterator[Client]:
        """The SDK's MCP client spawning oubliette-client, as an agent in the sandbox would.

        `errlog`: a real file (it needs a file descriptor) that receives the client's stderr.
        """
        params = StdioServerParameters(
            command=PYTHON, args=["-m", "oubliette_client", *extra_args],
            env=self.client_env(instance, session, token),
        )
        server: Any = params if errlog is None else stdio_client(params, errlog=errlog)
        async with Client(server, mode=mode, message_handler=message_handler) as client:
            yield client

    @asynccontextmanager
    async def guest(
        self, instance: str, command: list[str], *, relay: str | None = None, token: str | None = None,
        env: dict[str, str] | None = None, cwd: Path | None = None,
    ) -> AsyncIterator[trio.Process]:
        """`oubliette-client run -- command` for `instance` (`relay`: another address, or a list;
        `env`: its whole environment instead of this process's; `cwd`: the agent's working directory)."""
        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_client", "run", "--relay", relay or self.relay, "--instance", instance,
             "--token", token or self.token(instance), "--log-level", "WARNING", "--", *command],
            env=env, cwd=cwd,
        )
        try:
            yield process
        finally:
            process.terminate()
            with trio.CancelScope(shield=True):
                await process.wait()


READY_PREFIX = b"oubliette-server ready "


class HandMcp:
    """JSON-RPC lines to and from a stdio MCP server process, one request at a time."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._buffer = b""
        self.received: list[dict[str, Any]] = []
        """Every message received so far, in order."""
        self._unclaimed: list[dict[str, Any]] = []  # responses read but not yet returned by `response`

    async def send(self, message: dict[str, Any] | str) -> None:
        """Send a message, or a line as it is (malformed ones included)."""
        assert self.process.stdin is not None
        if isinstance(message, dict) and "id" in message and "method" in message:
            # A new request with this id: a response to an earlier one of the same id is not its.
            self._unclaimed = [old for old in self._unclaimed if old.get("id") != message["id"]]
        line = message if isinstance(message, str) else json.dumps(message) + "\n"
        await self.process.stdin.send_all(line.encode())

    async def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some(65536)
            assert chunk, "the server process closed its stdout"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        self.received.append(message)
        if isinstance(message, dict) and "id" in message and "method" not in message:
            self._unclaimed.append(message)
        return message

    async def response(self, request_id: Any) -> dict[str, Any]:
        """The response to `request_id`, read now or while waiting for another: several requests in
        flight are answered in any order (notifications and other messages are skipped)."""
        while True:
            for index, message in enumerate(self._unclaimed):
                if message.get("id") == request_id:
                    del self._unclaimed[index]
                    return message
            await self.receive()


class HttpServer:
    """A server started with HTTP listeners (and no stdio caller)."""

    def __init__(self, deployment: "Deployment", process: trio.Process, ready: dict[str, Any]) -> None:
        self.deployment = deployment
        self.process = process
        self.ready = ready
        """The server's ready line: `relay`, `http` and (with `--metrics`) `metrics` addresses."""
        self.url = next(u for u in ready["http"] if u.startswith("http://127.0.0.1"))
        self.unix_socket = str(deployment.root / "http.sock")
        self.token = deployment.http_token()
        self.stderr = bytearray()
        self._stderr_changed = trio.Event()

    def _stderr_received(self, chunk: bytes) -> None:
        self.stderr.extend(chunk)
        self._stderr_changed.set()
        self._stderr_changed = trio.Event()

    def stderr_lines(self, *needles: str) -> list[str]:
        """The server's stderr lines (so far) that contain every one of `needles`."""
        text = self.stderr.decode(errors="replace")
        return [line for line in text.splitlines() if all(n in line for n in needles)]

    async def wait_stderr(self, *needles: str, count: int = 1, timeout: float = EVENT_TIMEOUT) -> list[str]:
        """Wait until at least `count` complete stderr lines contain every one of `needles`; those lines."""
        with trio.fail_after(timeout):
            while True:
                complete = self.stderr[: self.stderr.rfind(b"\n") + 1].decode(errors="replace")
                lines = [line for line in complete.splitlines() if all(n in line for n in needles)]
                if len(lines) >= count:
                    return lines
                await self._stderr_changed.wait()

    @property
    def mcp_url(self) -> str:
        return self.url + "/mcp"

    async def wait_connected(self, instance: str, timeout: float = EVENT_TIMEOUT) -> None:
        """Until `/v1/health` lists `instance` as connected.

        A bounded check: a guest's connection is written only to the access log (INFO), which these
        servers, at WARNING, do not write; `/v1/health` has no long poll nor stream."""
        async with self.unix_rest() as rest:
            with trio.fail_after(timeout):
                while True:
                    response = await rest.get("/v1/health")
                    response.raise_for_status()
                    if instance in response.json()["connected_instances"]:
                        return
                    await trio.sleep(0.05)

    def rest(self, token: str | None = "default") -> Any:
        """An HTTP client for the tether API (bearer token: the server's, unless given)."""
        import httpx2

        headers = {}
        chosen = self.token if token == "default" else token
        if chosen is not None:
            headers["Authorization"] = f"Bearer {chosen}"
        return httpx2.AsyncClient(base_url=self.url, headers=headers, timeout=60)

    def unix_rest(self) -> Any:
        """An HTTP client over the Unix socket listener (no token: the file mode is the credential)."""
        import httpx2

        return httpx2.AsyncClient(
            transport=httpx2.AsyncHTTPTransport(uds=self.unix_socket), base_url="http://oubliette", timeout=60,
        )

    @asynccontextmanager
    async def caller(
        self, *, mode: str = "legacy", events: bool = True, token: str | None = None,
    ) -> AsyncIterator[tuple[Client, EventLog]]:
        """An MCP caller over Streamable HTTP with the server's bearer token, or `token` (`events=False`:
        no logging callback and no log level asked for; it acts on tool results only)."""
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        log = EventLog()
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token or self.token}"}, timeout=60)
        transport = streamable_http_client(self.mcp_url, http_client=http)
        logging: dict[str, Any] = {"logging_callback": log.on_log, "log_level": "info"} if events else {}
        async with http, Client(transport, mode=mode, **logging) as client:
            yield client, log


class EmbeddedHttpServer(HttpServer):
    """An `OublietteServer` running in the test's Trio loop (`app`), with `rest()` and `caller()`."""

    def __init__(self, deployment: Deployment, app: Any, url: str, unix_socket: str | None = None) -> None:
        from oubliette_server.core.auth import HTTP_ADMIN

        self.deployment = deployment
        self.app = app
        self.url = url
        self.unix_socket = unix_socket
        self.token = app.tokens.token_for(HTTP_ADMIN)
        self.stderr = bytearray()
        self._stderr_changed = trio.Event()

    def unix_rest(self) -> Any:
        if self.unix_socket is None:
            raise NotImplementedError("this embedded server has a TCP listener only")
        return super().unix_rest()

    async def wait_waiters(self, instance: str, count: int, timeout: float = EVENT_TIMEOUT) -> None:
        """Until exactly `count` tasks (poll, SSE, tether_read, guest delivery) wait on `instance`'s frames
        (looked at again as each waiter comes or goes: the store's `waiters_changed`)."""
        store = self.app.store
        with trio.fail_after(timeout):
            await store.waiters_changed.until(lambda: store.waiter_count(instance) == count)


class EmbeddedApp:
    """An `OublietteServer` serving in the test's Trio loop: the server (`app`), the nursery it
    runs in (for the test's own tasks, cancelled with it) and its HTTP listeners' URLs."""

    def __init__(self, app: Any, nursery: trio.Nursery, urls: list[str]) -> None:
        self.app = app
        self.nursery = nursery
        self.urls = urls

    def http_server(self, deployment: Deployment) -> EmbeddedHttpServer:
        """Its TCP listener as an `EmbeddedHttpServer` (`rest()`, `caller()`, `wait_waiters`)."""
        return EmbeddedHttpServer(deployment, self.app, next(u for u in self.urls if u.startswith("http://127.0.0.1")))


@asynccontextmanager
async def embedded_app(config: Any, *, store: Any = None) -> AsyncIterator[EmbeddedApp]:
    """The one embedded-server helper: `OublietteServer(config, store=store)` started in a
    nursery of the test's Trio loop with `nursery.start(app.serve)`, as `run_server` starts it
    (relay, configured toolsets, the HTTP and metrics listeners `config` names), stopped when the
    block ends."""
    from oubliette_server.program.app import OublietteServer

    app = OublietteServer(config, store=store)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(app.serve)
        try:
            yield EmbeddedApp(app, nursery, bound.http)
        finally:
            nursery.cancel_scope.cancel()


# The reference endpoint's (examples/mcp_echo.py) descriptor of its one tool, as it lists it.
ECHO_EXTERNAL = {
    "name": "echo_external",
    "description": "Echo a message back from outside the sandbox",
    "command": "echo_external --message TEXT",
    "origin": "remote",
    "safety": "read-only; no side effects",
    "input_schema": {
        "type": "object",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
        "additionalProperties": False,
    },
    "result_schema": {
        "type": "object",
        "properties": {"echo": {"type": "string"}},
        "required": ["echo"],
    },
}


DEMO_AGENT = [PYTHON, "-m", "oubliette_client.demo_agent", "--mcp-config", "{mcp_config}"]


class RawRelay:
    """A hand-driven relay connection, for protocol-level tests."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    @classmethod
    @asynccontextmanager
    async def connect(cls, deployment: Deployment) -> AsyncIterator["RawRelay"]:
        stream = await trio.open_unix_socket(str(deployment.socket))
        try:
            yield cls(stream)
        finally:
            await stream.aclose()

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, message: dict[str, Any]) -> None:
        await self.send_raw(json.dumps(message).encode() + b"\n")

    async def hello(self, instance: str, token: str, role: str = "client", session: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"protocol": "oubliette-relay/1", "role": role, "instance": instance, "token": token}
        if session:
            params["session"] = session
        await self.send({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": params})
        while True:
            message = await self.receive()
            assert message is not None, "connection closed during hello"
            if message.get("id") == 0:
                return message

    async def receive(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """The next message, or None once the server closed the connection."""
        with trio.fail_after(timeout):
            while b"\n" not in self._buffer:
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    return None
                self._buffer.extend(chunk)
        end = self._buffer.index(b"\n")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return json.loads(line)

    async def closed(self, timeout: float = 10.0) -> bool:
        """True when the server closes the connection (after any pending messages)."""
        with trio.fail_after(timeout):
            while True:
                try:
                    chunk = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return True
                if not chunk:
                    return True
                self._buffer.extend(chunk)


#: A flooder whose connect found the relay's listen backlog full tries again after this long: the
#: attacker's own pace (nothing tells it a place freed), so the test's process does not spin.
FLOOD_RECONNECT_PAUSE = 0.01


class Progress:
    """A count that can be awaited (cases finished, connections closed): `advance`, `reach`."""

    def __init__(self) -> None:
        self.done = 0
        self._changed = trio.Event()

    def advance(self) -> None:
        self.done += 1
        self._changed.set()
        self._changed = trio.Event()

    async def reach(self, count: int) -> None:
        while self.done < count:
            await self._changed.wait()


async def never_say_hello(deployment: Deployment, closed: Progress) -> None:
    """One relay connection that never sends a byte, opened again as soon as the server closes it:
    an attacker without a token (docs/SECURITY.md, "Relay connections that never say hello").
    `closed` counts the connections the server closed. Runs until cancelled."""
    while True:
        try:
            stream = await trio.open_unix_socket(str(deployment.socket))
        except OSError:
            await trio.sleep(FLOOD_RECONNECT_PAUSE)
            continue
        async with stream:
            try:
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOTCONN:
                    # Trio's connect to a Unix socket with a full backlog returns it unconnected.
                    await trio.sleep(FLOOD_RECONNECT_PAUSE)
                    continue
        closed.advance()


async def hello_outcome(
    deployment: Deployment, timeout: float, instance: str = "box1", *, again_if_dropped: bool = False,
) -> str:
    """"ok" when a sandbox's hello with a valid token is answered with a result within `timeout`
    seconds of starting to connect; else what happened instead.

    `again_if_dropped`: a connection the server closed before answering (evicted at the relay's
    cap by newer connections before its hello was read) connects again, as a sandbox's client
    does (its `RelayLink` reconnects), within the same `timeout`."""
    with trio.move_on_after(timeout):
        while True:
            try:
                async with RawRelay.connect(deployment) as relay:
                    answer = await relay.hello(instance, deployment.token(instance))
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, AssertionError) as exc:
                if again_if_dropped and isinstance(exc, (OSError, trio.BrokenResourceError)):
                    continue
                return f"failed: {exc or type(exc).__name__}"
            return "ok" if "result" in answer else f"refused: {answer.get('error')}"
    return f"no answer within {timeout:g} s"


async def health_outcome(server: HttpServer, timeout: float) -> str:
    """"ok" when the operator's `GET /v1/health` (on the HTTP Unix socket) answers 200 within
    `timeout` seconds; else what happened instead."""
    import httpx2

    with trio.move_on_after(timeout):
        try:
            async with server.unix_rest() as rest:
                response = await rest.get("/v1/health")
        except httpx2.TransportError as exc:
            return f"failed: {type(exc).__name__}: {exc}"
        return "ok" if response.status_code == 200 else f"status {response.status_code}"
    return f"no answer within {timeout:g} s"


async def hello_and_health(
    deployment: Deployment, server: HttpServer, timeout: float, *, again_if_dropped: bool = False,
) -> tuple[str, str]:
    """`hello_outcome` and `health_outcome`, at the same time."""
    outcomes: dict[str, str] = {}
    async with trio.open_nursery() as nursery:

        async def hello() -> None:
            outcomes["hello"] = await hello_outcome(deployment, timeout, again_if_dropped=again_if_dropped)

        async def health() -> None:
            outcomes["health"] = await health_outcome(server, timeout)

        nursery.start_soon(hello)
        nursery.start_soon(health)
    return outcomes["hello"], outcomes["health"]


def env_without_oubliette() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OUBLIETTE_")}


#: The venv the tests run in: the one the README's command 1 (or 2) made in the checkout.
VENV = Path(sys.executable).parent.parent
#: The checkout's Claude Code, installed by the README's command 2 (tests/tools/install-claude-code.sh).
CLAUDE_CODE_DIR = Path(__file__).resolve().parents[2] / ".claude-code"


def fresh_shell(root: Path) -> tuple[Path, dict[str, str]]:
    """A user's new shell in the checkout after the README's commands: (its working directory, its environment).

    The directory holds `.venv`, `.claude-code` and `examples` as the checkout does, as links
    to the real ones; `HOME` is `root/home`. The environment has no `OUBLIETTE_*`, no XDG data home,
    no active venv: neither the venv's bin nor Claude Code is on `PATH`, so a pasted command
    that forgets to activate the venv fails here as it fails for a user.
    """
    checkout, home = root / "checkout", root / "home"
    checkout.mkdir(parents=True)
    home.mkdir(parents=True, exist_ok=True)
    (checkout / ".venv").symlink_to(VENV)
    (checkout / ".claude-code").symlink_to(CLAUDE_CODE_DIR)
    (checkout / "examples").symlink_to(Path(__file__).resolve().parents[2] / "examples")
    hidden = {(VENV / "bin").resolve(), CLAUDE_CODE_DIR.resolve()}
    path = os.pathsep.join(
        entry for entry in os.environ.get("PATH", "").split(os.pathsep)
        if entry and Path(entry).resolve() not in hidden
    )
    env = {
        key: value for key, value in env_without_oubliette().items()
        if key not in {"XDG_DATA_HOME", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    env.update(PATH=path, HOME=str(home))
    for program in ("oubliette-server", "oubliette-client"):  # (a `claude` of the machine's own may stay)
        assert shutil.which(program, path=path) is None, f"{program} is on PATH before any activation"
    return checkout, env


# -- the same programs as libraries in the test's Trio loop ----------------------------------


@asynccontextmanager
async def memory_transport(server: Any, options: Any) -> AsyncIterator[Any]:
    """An MCP transport to `server` over memory streams: what stdio is to the real programs.

    `server.run` gets the same initialization options the program passes on stdio; closing
    the client's side is the EOF a program sees when its stdin closes."""
    from mcp.shared.memory import create_client_server_memory_streams

    async with create_client_server_memory_streams() as (client_streams, server_streams):
        done = trio.Event()

        async def run() -> None:
            try:
                await server.run(*server_streams, options)
            finally:
                done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            try:
                yield client_streams
            finally:
                await client_streams[1].aclose()
                await server_streams[1].aclose()
                with trio.move_on_after(2.0):
                    await done.wait()
                nursery.cancel_scope.cancel()


class InProcessDeployment(Deployment):
    """A `Deployment` whose `caller()` and `agent()` run oubliette-server and oubliette-client
    as libraries in the test's Trio loop (README.md, "Embedding"), over memory streams
    instead of stdio: the same objects the command-line programs build, without two
    interpreter start-ups (~1-3 s each) per test. `guest()` and `http_server()` still start
    the real programs; tests marked `real_programs` get a plain `Deployment`.

    This is the one place that knows how the programs are assembled inside (as
    oubliette_server.program.runner and oubliette_client.stdio_server do it)."""

    @asynccontextmanager
    async def caller(self, *extra: str, mode: str = "legacy", events: bool = True) -> AsyncIterator[tuple[Client, EventLog]]:
        """The server, configured from the same flags as `Deployment.caller`, with one caller
        connected as on stdio; the server stops when the caller leaves (as the program does).
        The running server is `self.app` meanwhile, for tests that watch its state."""
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS

        from oubliette_server.doors.caller_api.mcp_server import build_caller_server, initialization_options
        from oubliette_server.program.runner import SHUTDOWN_DRAIN_SECONDS

        async with self.embedded_server(*extra) as (app, _urls):
            self.app = app
            caller = app.open_caller("stdio")

            def resolve(ctx: Any, arguments: Any = None) -> Any:
                if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
                    caller.mcp_session = ctx.session
                return caller

            server = build_caller_server(app.caller_api(), resolve)
            log = EventLog()
            try:
                transport = memory_transport(server, initialization_options(server))
                async with Client(transport, mode=mode, **log.callback_if(events)) as client:
                    yield client, log
            finally:
                app.close_caller(caller)
                with trio.CancelScope(shield=True):
                    await app.drain(SHUTDOWN_DRAIN_SECONDS)

    @asynccontextmanager
    async def embedded_server(self, *extra: str) -> AsyncIterator[tuple[Any, list[str]]]:
        """`OublietteServer` configured from command-line flags, its relay (and configured
        toolsets, and HTTP listeners if asked for) up, as `run_server` starts it:
        (the server, its HTTP URLs)."""
        from oubliette_server.program.cli import _serve_parser, build_config

        config = build_config(_serve_parser().parse_args(
            ["--relay", self.relay, "--data-dir", str(self.data_dir), *extra]))
        async with embedded_app(config) as embedded:
            yield embedded.app, embedded.urls

    @asynccontextmanager
    async def http_server(self, *extra: str) -> AsyncIterator["HttpServer"]:
        """The server with the same TCP and Unix HTTP listeners as `Deployment.http_server`, in
        process. It has no `process`, and its `stderr` stays empty: tests that read them are
        marked `real_programs`."""
        flags = ("--http", "127.0.0.1:0", "--http", f"unix:{self.root / 'http.sock'}", "--no-stdio", *extra)
        async with self.embedded_server(*flags) as (app, urls):
            url = next(u for u in urls if u.startswith("http://127.0.0.1"))
            yield EmbeddedHttpServer(self, app, url, unix_socket=str(self.root / "http.sock"))

    @asynccontextmanager
    async def agent(
        self, instance: str, session: str | None = None, *, mode: str = "legacy",
        token: str | None = None, extra_args: tuple[str, ...] = (), message_handler: Any = None,
        errlog: TextIO | None = None,
    ) -> AsyncIterator[Client]:
        """oubliette-client's stdio MCP server (`SandboxToolServer`) in process, as `run_stdio`
        runs it. `errlog` (the client's stderr) needs the real program: `Deployment.agent`."""
        if errlog is not None:
            async with super().agent(instance, session, mode=mode, token=token, extra_args=extra_args,
                                     message_handler=message_handler, errlog=errlog) as client:
                yield client
            return
        import argparse

        from mcp.server.lowlevel.server import NotificationOptions

        from oubliette_client.progress import DEFAULT_PROGRESS_INTERVAL
        from oubliette_client.settings import RelaySettings
        from oubliette_client.stdio_server import DEFAULT_CONNECT_WAIT, SandboxToolServer

        flags = argparse.ArgumentParser()
        flags.add_argument("--connect-wait", type=float, default=DEFAULT_CONNECT_WAIT)
        flags.add_argument("--progress-interval", type=float, default=DEFAULT_PROGRESS_INTERVAL)
        parsed = flags.parse_args(list(extra_args))
        settings = RelaySettings(
            relay=self.relay, instance=instance, session=session,
            token=token if token is not None else self.token(instance),
        )
        sandbox = SandboxToolServer(settings, connect_wait=parsed.connect_wait, progress_interval=parsed.progress_interval)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sandbox.link.run)
            nursery.start_soon(sandbox._announce_changes)
            with trio.move_on_after(sandbox.connect_wait):
                await sandbox.link.attempted.wait()
            options = sandbox.server.create_initialization_options(NotificationOptions(tools_changed=True))
            async with Client(memory_transport(sandbox.server, options), mode=mode,
                              message_handler=message_handler) as client:
                yield client
            nursery.cancel_scope.cancel()
