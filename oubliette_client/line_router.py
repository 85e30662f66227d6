"""oubliette-client's line router: the one place that decides which of the agent's lines are
answered here and which the MCP SDK answers.

Why: importing the MCP SDK is about 0.7 s of the client's ~0.9 s start, nearly all of it
pydantic models (`bench/bench_coldstart.py`), and the SDK's per-request machinery was about half
of the client's CPU per relayed call (`oubliette_runtime/fast_tool_calls.py`). The handshake era's
requests have fixed shapes and need none of it. So `serve_stdio` loads the SDK in a worker
thread while the Trio thread connects to the relay and reads the agent's stdin, and
`LineRouter` reads each line and either answers it or hands it on, in order, to the SDK (once
loaded). It answers, with `OUBLIETTE_FAST_PATH` on:

- the first line, when it is a handshake-era `initialize` (`{"jsonrpc": "2.0", "id", "method":
  "initialize", "params": {"protocolVersion": one of HANDSHAKE_VERSIONS, "capabilities": {...},
  "clientInfo": {"name": str, "version": str, ...}}}`): with the capabilities and server info
  the SDK gives. That handshake is then the router's: the SDK never sees the `initialize` (it
  learns the connection is initialized from the agent's `notifications/initialized`, which it
  does see), and the router answers the rest of the connection's fixed shapes:
- `ping` and `tools/list` (without params beyond a cursor): as the SDK would
  (`SandboxTools.listed_tools`, after the relay's first attempt as on the SDK's path);
- `tools/call` of any tool (`oubliette_runtime.fast_tool_calls`): `SandboxToolServer.answer_call`, the
  SDK's own handler, once the SDK is loaded; `notifications/cancelled` cancels such a call.

Everything else — a handshake the SDK negotiates (a first line that is not a plain handshake-era
`initialize`), a 2026-07-28 request, any other method, anything malformed — is the SDK's, the
reference; `OUBLIETTE_FAST_PATH=0` makes every line the SDK's. Nothing the SDK answers is
dropped. `tests/client/test_early_handshake.py` drives the same lines both ways and compares the answers.
A change of the list after the one the agent got is announced by the SDK's side
(`SandboxToolServer.serve`'s `listed_version`), through the router's writer when the handshake
was the router's (`SandboxToolServer.initialized`: the SDK picks a protocol era only when a
request reaches it, so it may never act on the `notifications/initialized` it was handed).

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
each call's error says why. This holds with the switch on and off.

Owns: the relay link's task, the stdin reader task, and the SDK's serving, in one nursery; at most
MAX_WAITING_LINES lines, and MAX_WAITING_CHARS characters of them (one longer line always fits), wait
for the SDK in memory, and as many calls taken meanwhile (`_room_before_the_sdk`); past either,
stdin is read no further until the SDK takes them.
Cancellation: cancelling `serve_stdio` stops all three; the SDK import runs on in its thread
and is abandoned.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import trio

from protocol import VERSION, errors
from oubliette_runtime.fast_tool_calls import (
    FastToolCalls, SendProgress, call_result, error_line, fast_path_enabled, is_request_id, modern_envelope,
    notification_line, response_line,
)
from oubliette_runtime.gc_freeze import freeze_startup_heap
from oubliette_runtime.stdio_streams import claimed_stdio

from .sandbox_tools import SandboxTools
from .settings import RelaySettings

if TYPE_CHECKING:
    from .stdio_server import SandboxToolServer

__all__ = ["HANDSHAKE_VERSIONS", "SERVER_INFO", "LineRouter", "serve_stdio"]

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
_CALL_MARK = '"tools/call"'
_INITIALIZED_MARK = '"notifications/initialized"'
#: The params of a `tools/list` answered here: none, a cursor (the list is never paged) or `_meta`.
_LIST_PARAMS = frozenset({"cursor", "_meta"})


def _parse(line: str) -> dict[str, Any] | None:
    """The line's JSON object when it is a request, or None for anything this module leaves to the SDK."""
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


def _plain_list(message: dict[str, Any]) -> bool:
    """A `tools/list` with no params but a cursor or `_meta` (both of which the SDK's answer ignores)."""
    params = message.get("params", {})
    return (message.get("method") == "tools/list" and not message.keys() - _REQUEST_KEYS
            and isinstance(params, dict) and params.keys() <= _LIST_PARAMS
            and isinstance(params.get("cursor", ""), str) and isinstance(params.get("_meta", {}), dict) and not modern_envelope(params.get("_meta")))


class LineRouter:
    """The stdin reader of `serve_stdio`: answers its lines, forwards the rest to the SDK in order.

    Owns: the taken calls (`calls`, run by `serve_stdio` in its nursery); `read` runs there too.
    Needs: `write(text)` safe from several tasks; `SandboxTools` whose link runs; `serving(server)`
    once the SDK's server is built (taken calls wait for it).
    """

    def __init__(self, tools: SandboxTools, write: Callable[[str], Awaitable[None]], relay_deadline: float,
                 *, enabled: bool = True) -> None:
        self.tools = tools
        self._write = write
        self._relay_deadline = relay_deadline
        self._enabled = enabled
        self.waiting = WaitingChars(MAX_WAITING_CHARS)
        self._seen_first = False
        self._verdict_checked = False
        self._started = trio.current_time()
        #: Why the relay refused this client for good, learnt before the first answer (None: it did not).
        self.refusal: str | None = None
        self._refusal_code = errors.UNAUTHORIZED
        #: The handshake-era version of the `initialize` answered here (None: the handshake is the SDK's).
        self.version: str | None = None
        #: The registry version of the last `tools/list` answered here (None: none was).
        self.listed_version: int | None = None
        self.calls = FastToolCalls(self._route, write)
        self._server: SandboxToolServer | None = None
        self._server_built = trio.Event()
        self._early_chars = 0  # the characters of the calls taken before the SDK was loaded
        self._initialized = False  # the agent of the router's handshake sent `notifications/initialized`

    async def serving(self, server: SandboxToolServer) -> None:
        """The SDK is loaded and its server built: calls taken here run its `answer_call`, and an
        agent the router initialized is told of list changes through it."""
        self._server = server
        self._server_built.set()
        if self._initialized:
            await server.initialized(self._tell_list_changed)

    async def _tell_list_changed(self) -> None:
        await self._write(notification_line("notifications/tools/list_changed"))

    async def read(self, stdin: Any, forward: trio.MemorySendChannel[str]) -> None:
        """Read the agent's lines until EOF, answering the router's and forwarding the rest in order."""
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
                        if self._enabled and await self._answer(line):
                            continue
                    except anyio.ClosedResourceError:
                        break  # stdout is broken (the agent has gone): stdin is closed too
                    await self.waiting.reserve(len(line))
                    await forward.send(line)
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

    async def _answer(self, line: str) -> bool:
        """Answer `line` here if it is the router's (see the module docstring); True when the SDK must not see it."""
        first, self._seen_first = not self._seen_first, True
        if self.version is None:
            message = _parse(line) if first else None
            version = None if message is None else _handshake_initialize(message)
            if message is None or version is None:
                return False
            self.version = version
            result = {"capabilities": CAPABILITIES, "protocolVersion": version, "serverInfo": SERVER_INFO}
            await self._write(response_line(message["id"], result))
            return True
        if not self._server_built.is_set() and _CALL_MARK in line:
            await self._room_before_the_sdk(len(line))
        if self.calls.take(line):
            if not self._server_built.is_set():
                self._early_chars += len(line)
            return True
        message = _parse(line)
        if message is None:
            if not self._initialized and _INITIALIZED_MARK in line:
                await self._note_initialized(line)
            return False
        if message.get("method") == "ping" and not message.keys() - _REQUEST_KEYS and message.get("params") in (None, {}):
            await self._write(response_line(message["id"], {}))
            return True
        if _plain_list(message):
            await self.tools.wait_first_attempt(self._relay_deadline)
            tools_version = self.tools.registry.version
            tools = self.tools.listed_tools()
            await self._write(response_line(message["id"], {"tools": tools}))
            self.listed_version = tools_version
            return True
        return False

    async def _note_initialized(self, line: str) -> None:
        """The agent's `notifications/initialized` (also the SDK's, which then accepts requests):
        from now on the SDK's server announces list changes through the router."""
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return
        if not isinstance(message, dict) or message.get("method") != "notifications/initialized" or "id" in message:
            return
        self._initialized = True
        if self._server is not None:
            await self._server.initialized(self._tell_list_changed)

    async def _room_before_the_sdk(self, size: int) -> None:
        """Calls taken while the SDK loads wait for it in memory, bounded as forwarded lines are
        (MAX_WAITING_LINES calls, MAX_WAITING_CHARS of their lines); past that, stdin waits."""
        if self.calls.in_flight >= MAX_WAITING_LINES or (self._early_chars and self._early_chars + size > MAX_WAITING_CHARS):
            await self._server_built.wait()

    def _route(self, name: str, arguments: dict[str, Any]) -> Any:
        """Every `tools/call` of the router's handshake: the SDK's own handler, shaped for its version."""
        version = self.version
        if version is None:
            return None

        async def handle(token: str | int | None, send_progress: SendProgress | None) -> dict[str, Any]:
            await self._server_built.wait()
            assert self._server is not None
            return call_result(await self._server.answer_call(name, arguments, token, send_progress), version)
        return handle


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
    settings: RelaySettings, *, connect_wait: float, progress_interval: float, fast_path: bool | None = None,
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
            router = LineRouter(tools, stdout.write, relay_deadline,
                                enabled=fast_path_enabled() if fast_path is None else fast_path)
            await nursery.start(router.calls.run)
            forward, lines = trio.open_memory_channel[str](MAX_WAITING_LINES)
            nursery.start_soon(router.read, stdin, forward)
            server_class = await trio.to_thread.run_sync(_load_sdk_server, abandon_on_cancel=True)
            server = server_class(
                settings, connect_wait=connect_wait, progress_interval=progress_interval, tools=tools,
            )
            server.relay_deadline = relay_deadline
            freeze_startup_heap()  # the SDK is loaded, the server built: no collection walks them again
            await router.serving(server)
            await server.serve(_channel_lines(lines, router.waiting), stdout, listed_version=router.listed_version)
        nursery.cancel_scope.cancel()
