"""oubliette-client's start: the agent's handshake answered while the MCP SDK is still loading.

Why: importing the MCP SDK is about 0.7 s of the client's ~0.9 s start, nearly all of it
pydantic models (`bench/bench_coldstart.py`). The handshake's first requests have
fixed shapes and need none of it, so `serve_stdio` loads the SDK in a worker thread while the
Trio thread connects to the relay and reads the agent's stdin; until the SDK is loaded it
answers these itself, and hands every other line on, in order, to the SDK once loaded:

- the first line, when it is a handshake-era `initialize` (`{"jsonrpc": "2.0", "id", "method":
  "initialize", "params": {"protocolVersion": one of HANDSHAKE_VERSIONS, "capabilities": {...},
  "clientInfo": {"name": str, "version": str, ...}}}`): answered with the capabilities and
  server info the SDK gives. The line is still handed to the SDK first, so its session is
  initialized exactly as before; its answer to it is dropped (and compared with ours: a
  difference is logged as a warning);
- `ping`, and `tools/list` without a cursor after such an `initialize`: answered as the SDK
  would (`SandboxTools.listed_tools`, after the relay's first attempt as on the SDK's path),
  and not handed on. A change of the list after the one the agent got is announced by the SDK's
  side (`SandboxToolServer.serve`'s `listed_version`).

Everything else — a 2026-07-28 request, any other method, anything malformed — waits for the
SDK and gets its answer.

The agent's first request (an `initialize`, or any request of a 2026-07-28 agent) is answered
only once the relay has given its verdict on this client's hello, at most `HELLO_VERDICT_WAIT`
from the start (and never past `--connect-wait`): a relay that refuses the instance for good (a
wrong token, an unknown instance), or that cannot be reached at all until then (no socket at the
path, nothing listening), gets that request — and every request in the next `REFUSED_LINGER`
seconds — a JSON-RPC error with the reason, and the program then exits 1 with the same line on
stderr, so a host's health check (`claude mcp list`) shows a failure instead of a healthy server
whose every call fails. Failing the start is right for an unreachable relay too: the guest
runtime starts an agent only for a message it just received over that relay, so a relay not
there at the agent's start is a wrong address or a missing mount, not a blip (`--connect-wait 0`
asks to serve at once whatever the relay, and does). A relay that is
merely slow (connected, its hello not answered yet) is waited for: the client serves, and the
first list waits for it. A relay lost after the start may come back: the client serves on, and
each call's error says why. `OUBLIETTE_EARLY_HANDSHAKE=0` (or false/no/off) turns the early answers
off: then every line waits for the SDK, as before.

Owns: the relay link's task, the stdin reader task, and the SDK's serving, in one nursery; at most
MAX_WAITING_LINES lines, and MAX_WAITING_CHARS characters of them (one longer line always fits), wait
for the SDK in memory; past either, stdin is read no further until it takes them.
Cancellation: cancelling `serve_stdio` stops all three; the SDK import runs on in its thread
and is abandoned.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import trio

from oubliette_runtime.fast_tool_calls import error_line, is_request_id, response_line, switched_on
from oubliette_runtime.gc_freeze import freeze_startup_heap
from oubliette_runtime.stdio_streams import claimed_stdio
from oubliette_runtime.telemetry import tracing_configured
from protocol import VERSION, errors

from .sandbox_tools import SandboxTools
from .settings import RelaySettings

if TYPE_CHECKING:
    from .stdio_server import SandboxToolServer

__all__ = ["HANDSHAKE_VERSIONS", "SERVER_INFO", "EarlyHandshake", "early_handshake_enabled", "serve_stdio"]

log = logging.getLogger("oubliette.client")

#: The SDK's handshake-era protocol versions (`mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS`; a
#: test keeps the two equal, so an SDK upgrade that changes them fails there first).
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
#: `serverInfo` as `SandboxToolServer`'s SDK server reports it.
SERVER_INFO = {"name": "oubliette-client", "version": VERSION}
#: `capabilities` as the SDK reports them for `SandboxToolServer` (tools, with list changes).
CAPABILITIES = {"tools": {"listChanged": True}}

#: Lines read while the SDK loads that wait for it; past this, stdin is not read until the SDK
#: takes them (the agent's writes block on the pipe: backpressure, not memory).
MAX_WAITING_LINES = 256
#: The characters those lines may hold together (one line over it still fits alone): a stdin line
#: may be 16 MiB (`stdio_streams`), so 256 of them could be 4 GiB.
MAX_WAITING_CHARS = 32 * 1024 * 1024

#: Seconds from the start the agent's first request waits at most for the relay's verdict on the
#: hello (a local relay answers in milliseconds; a slow one gets the handshake answered anyway).
HELLO_VERDICT_WAIT = 1.0
#: Seconds a refused client goes on answering requests with the refusal before it exits (an
#: SDK client in "auto" mode probes `server/discover`, then tries `initialize`): at stdin's end sooner.
REFUSED_LINGER = 2.0

_REQUEST_KEYS = frozenset({"jsonrpc", "id", "method", "params"})


def early_handshake_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Yes unless `OUBLIETTE_EARLY_HANDSHAKE` is `0`, `false`, `no` or `off`, or spans are exported
    (then the SDK answers every line and makes its MCP spans)."""
    return switched_on("OUBLIETTE_EARLY_HANDSHAKE", environ) and not tracing_configured()


def _parse(line: str) -> dict[str, Any] | None:
    """The line's JSON object, or None for anything this module leaves to the SDK."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or not is_request_id(message.get("id")):
        return None
    return message


def _handshake_initialize(message: dict[str, Any]) -> str | None:
    """The protocol version of a plain handshake-era `initialize`, else None."""
    params = message.get("params")
    if message.get("method") != "initialize" or message.keys() - _REQUEST_KEYS or not isinstance(params, dict):
        return None
    version, client = params.get("protocolVersion"), params.get("clientInfo")
    if version not in HANDSHAKE_VERSIONS or not isinstance(params.get("capabilities"), dict):
        return None
    if not isinstance(client, dict) or not isinstance(client.get("name"), str) or not isinstance(client.get("version"), str):
        return None
    return version


class EarlyHandshake:
    """The stdin reader of `serve_stdio`: answers what it can until `handover`, forwards the rest.

    Owns: nothing but its state; `read` runs in the caller's nursery.
    Needs: `write(text)` safe from several tasks; `SandboxTools` whose link runs.
    """

    def __init__(self, tools: SandboxTools, write: Callable[[str], Awaitable[None]], relay_deadline: float,
                 *, enabled: bool = True) -> None:
        self.tools = tools
        self._write = write
        self._relay_deadline = relay_deadline
        self._enabled = enabled
        self._sdk_ready = False
        self._busy = trio.Lock()  # held while an early answer is being made
        self.waiting = WaitingChars(MAX_WAITING_CHARS)
        self._seen_first = False
        self._verdict_checked = False
        self._started = trio.current_time()
        #: Why the relay refused this client for good, learnt before the first answer (None: it did not).
        self.refusal: str | None = None
        self._refusal_code = errors.UNAUTHORIZED
        #: The id and our result of the `initialize` answered early (None: none was).
        self.initialize_id: str | int | None = None
        self.initialize_result: dict[str, Any] | None = None
        self.initialize_version: str | None = None
        #: The registry version of the last `tools/list` answered early (None: none was).
        self.listed_version: int | None = None

    async def read(self, stdin: Any, forward: trio.MemorySendChannel[str]) -> None:
        """Read the agent's lines until EOF, answering early ones and forwarding the rest in order."""
        async with forward:
            with trio.CancelScope() as reading:
                async for line in stdin:
                    try:
                        if self.refusal is None and not self._verdict_checked and _parse(line) is not None:
                            self._verdict_checked = True
                            await self._learn_verdict()
                            if self.refusal is not None:
                                reading.deadline = trio.current_time() + REFUSED_LINGER
                        if self.refusal is not None:
                            await self._refuse(line)
                            continue
                        if not self._sdk_ready and self._enabled:
                            async with self._busy:
                                taken = await self._answer(line, forward)
                            if taken:
                                continue
                    except anyio.ClosedResourceError:
                        break  # stdout is broken (the agent has gone): stdin is closed too
                    await self._forward(forward, line)
        if self.refusal is not None:
            from .relay_link import RelayRefused

            raise RelayRefused(self.refusal)

    async def _learn_verdict(self) -> None:
        """Before the agent's first request is answered: wait (bounded) for the relay's verdict on
        the hello; a refusal for good is kept in `refusal`."""
        link = self.tools.link
        deadline = min(self._relay_deadline, self._started + HELLO_VERDICT_WAIT)
        await self.tools.wait_first_attempt(deadline)
        waits = self._relay_deadline > self._started  # `--connect-wait 0`: serve at once, relay or not
        if waits and link.attempted.is_set() and not link.connected and link.refused is None:
            with trio.move_on_at(deadline):  # unreachable: a server that is restarting gets until the deadline
                await link.wait_settled()
            if not link.connected and link.refused is None:
                self.refusal = link.failure_line()
                self._refusal_code = errors.PEER_DISCONNECTED
                return
        if link.refused is not None:
            self.refusal = link.failure_line()
            self._refusal_code = link.refused_code or errors.UNAUTHORIZED

    async def _refuse(self, line: str) -> None:
        """Answer a request with the refusal (a notification or anything else gets nothing)."""
        message = _parse(line)
        if message is not None and self.refusal is not None:
            await self._write(error_line(message["id"], self._refusal_code, self.refusal))

    async def _answer(self, line: str, forward: trio.MemorySendChannel[str]) -> bool:
        """Answer `line` now if it is one of the early requests; True when it needs no more."""
        first, self._seen_first = not self._seen_first, True
        message = _parse(line)
        if message is None:
            return False
        if first:
            version = _handshake_initialize(message)
            if version is None:
                return False
            result = {"capabilities": CAPABILITIES, "protocolVersion": version, "serverInfo": SERVER_INFO}
            self.initialize_id, self.initialize_result, self.initialize_version = message["id"], result, version
            await self._write(response_line(message["id"], result))
            await self._forward(forward, line)  # the SDK's session must see it; its answer is dropped
            return True
        method = message.get("method")
        if message.keys() - _REQUEST_KEYS or message.get("params") not in (None, {}):
            return False  # a cursor, `_meta` or anything else: the SDK's
        if method == "ping":
            await self._write(response_line(message["id"], {}))
            return True
        if method == "tools/list" and self.initialize_result is not None:
            await self.tools.wait_first_attempt(self._relay_deadline)
            tools_version = self.tools.registry.version
            tools = self.tools.listed_tools()
            await self._write(response_line(message["id"], {"tools": tools}))
            self.listed_version = tools_version
            return True
        return False

    async def _forward(self, forward: trio.MemorySendChannel[str], line: str) -> None:
        await self.waiting.reserve(len(line))
        await forward.send(line)

    async def handover(self) -> None:
        """From now on every line goes to the SDK; returns when no early answer is still being made."""
        self._sdk_ready = True
        async with self._busy:
            pass


class _DropInitializeAnswer:
    """The SDK's stdout, less its answer to the `initialize` the early handshake answered already."""

    def __init__(self, stdout: Any, request_id: str | int | None, ours: dict[str, Any] | None) -> None:
        self._stdout = stdout
        self._id = request_id
        self._ours = ours
        self._pending = request_id is not None

    async def write(self, text: str) -> None:
        """Write `text`, unless it is the SDK's answer to the early `initialize` (dropped once)."""
        if self._pending:
            message = _parse(text)
            if message is not None and message.get("id") == self._id and ("result" in message or "error" in message):
                self._pending = False
                if message.get("result") != self._ours:
                    log.warning("the MCP SDK answered initialize with %s; the agent got %s",
                                message.get("result", message.get("error")), self._ours)
                await trio.lowlevel.checkpoint()
                return
        await self._stdout.write(text)

    async def flush(self) -> None:
        """Nothing is buffered here."""
        await self._stdout.flush()


class WaitingChars:
    """The characters of the lines forwarded and not yet taken; `reserve` waits while they are
    over `budget` (a line alone always fits), `release` when one is taken."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._freed = trio.Event()

    async def reserve(self, size: int) -> None:
        """Count `size` more, once it fits."""
        while self.used and self.used + size > self.budget:
            await self._freed.wait()
        self.used += size

    def release(self, size: int) -> None:
        """Count `size` less, and wake a waiting `reserve`."""
        self.used -= size
        self._freed.set()
        self._freed = trio.Event()


async def _channel_lines(receive: trio.MemoryReceiveChannel[str], waiting: WaitingChars) -> AsyncIterator[str]:
    async with receive:
        async for line in receive:
            waiting.release(len(line))
            yield line


def _load_sdk_server() -> type[SandboxToolServer]:
    """Import the MCP SDK and the server on it (run in a worker thread: ~0.7 s)."""
    from .stdio_server import SandboxToolServer

    return SandboxToolServer


async def serve_stdio(
    settings: RelaySettings, *, connect_wait: float, progress_interval: float, early: bool | None = None,
) -> None:
    """oubliette-client's stdio MCP server, started as the module docstring says; returns when
    the agent closes stdin. Lists and calls wait up to `connect_wait` (from now) for the relay's
    first attempt, then go on even if the relay is down (calls say why)."""
    tools = SandboxTools(settings)
    async with trio.open_nursery() as nursery:
        relay_deadline = trio.current_time() + connect_wait
        await nursery.start(tools.link.run)
        nursery.start_soon(tools.warn_if_relay_down, relay_deadline)
        with claimed_stdio() as (stdin, stdout):
            gate = EarlyHandshake(tools, stdout.write, relay_deadline,
                                  enabled=early_handshake_enabled() if early is None else early)
            forward, lines = trio.open_memory_channel[str](MAX_WAITING_LINES)
            nursery.start_soon(gate.read, stdin, forward)
            server_class = await trio.to_thread.run_sync(_load_sdk_server, abandon_on_cancel=True)
            server = server_class(
                settings, connect_wait=connect_wait, progress_interval=progress_interval, tools=tools,
            )
            server.relay_deadline = relay_deadline
            freeze_startup_heap()  # the SDK is loaded, the server built: no collection walks them again
            await gate.handover()
            writer = _DropInitializeAnswer(stdout, gate.initialize_id, gate.initialize_result)
            await server.serve(_channel_lines(lines, gate.waiting), writer, listed_version=gate.listed_version,
                               handshake_version=gate.initialize_version)
        nursery.cancel_scope.cancel()
