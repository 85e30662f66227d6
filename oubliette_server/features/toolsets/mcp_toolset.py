"""A toolset backed by a stdio MCP server that the host runs (started with the SDK's client).

The server process is started once and shared by every session it is allowed
for. If it dies, the call that notices fails with a tool error saying so, and
the next call restarts it, up to `max_restarts` times.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import trio

from .base import ToolResult, Toolset, ToolSpec, call_progress
from .elicit import Asker, current_asker

log = logging.getLogger("oubliette.server.toolsets.mcp")

STDERR_TAIL_LINES = 5
STDERR_GRACE = 1.0
"""Seconds a failed start waits for the server's last stderr lines, which usually say why."""
DEFAULT_MAX_RESTARTS = 3
START_TIMEOUT = 30.0
DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds one tool call may take before the agent gets a timeout error (`timeout` in the config)."""


ProgressReport = Callable[[float, "float | None", "str | None"], None]


@contextlib.asynccontextmanager
async def _progress_in_order(
    transport: AsyncContextManager[Any], reports: dict[str, ProgressReport]
) -> AsyncIterator[tuple[Any, Any]]:
    """The transport's streams, with each progress report for a token in `reports` handed on as it is read.

    The SDK runs a call's progress callback in a task of its own, so a report can reach the
    agent after the call's result. Reading them here, in the order the server wrote them and
    before the result behind them reaches the SDK, keeps the agent's view in order.
    """
    async with transport as (read, write):
        send, receive = anyio.create_memory_object_stream[Any](0)

        async def pump() -> None:
            async with send:
                async for item in read:
                    message = getattr(item, "message", None)
                    if getattr(message, "method", None) == "notifications/progress":
                        _report_progress(getattr(message, "params", None), reports)
                    await send.send(item)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(pump)
            try:
                yield receive, write
            finally:
                tasks.cancel_scope.cancel()


def _report_progress(params: Any, reports: dict[str, ProgressReport]) -> None:
    """Hand one `notifications/progress` to its call's report (a token that is not ours is left to the SDK)."""
    match params:
        case {"progressToken": str() as token, "progress": int() | float() as progress} if (
            not isinstance(progress, bool) and (report := reports.get(token)) is not None
        ):
            total, message = params.get("total"), params.get("message")
            report(
                float(progress),
                float(total) if isinstance(total, int | float) and not isinstance(total, bool) else None,
                message if isinstance(message, str) else None,
            )
        case _:
            pass


def _content_dicts(content: list[Any]) -> list[dict[str, Any]]:
    return [block.model_dump(by_alias=True, mode="json", exclude_none=True) for block in content]


def _text_of(content: list[Any]) -> str:
    return " ".join(getattr(block, "text", "") for block in content).strip()


def _describe(exc: BaseException) -> str:
    """`Type: message` of the first real error, not of the exception groups around it."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class McpToolset(Toolset):
    """A shared toolset backed by a stdio MCP server the host runs, restarted on demand up to `max_restarts` times.

    Owns: the server process and its SDK client session, run as a task in the `nursery` it is
    given (the toolset service's), so it ends when that nursery does or on `aclose`.
    Needs: `start()` once (it reports the tools, or raises `RuntimeError` when the server does
    not start or list its tools within 30 s).
    Raises: `call` raises nothing; a dead server, a failed call or a call past `call_timeout`
    (60 s by default) is a `ToolResult.failure`.
    """

    def __init__(
        self,
        toolset_id: str,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        roots: list[str] | None = None,
        *,
        nursery: trio.Nursery,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        self.id = toolset_id
        self.command = command
        self.args = list(args or [])
        self.env = env
        self.cwd = cwd
        self.roots = list(roots or [])
        self.max_restarts = max_restarts
        self.call_timeout = call_timeout
        self.restarts = 0
        self._nursery = nursery
        self._client: Any = None
        self._stop: trio.Event | None = None
        self._dead_reason: str | None = None
        self._start_lock = trio.Lock()
        self._started = False
        self._askers: list[Asker] = []  # one per call in flight that can put a form to its session's caller
        self._calls_in_flight = 0
        self._progress_reports: dict[str, ProgressReport] = {}  # by the progress token each call sent
        self._progress_tokens = itertools.count(1)

    async def start(self) -> list[ToolSpec]:
        """Start the server (once) and return its tools."""
        tools = await self._nursery.start(self._run)
        return [
            ToolSpec(
                name=tool.name, description=tool.description or "", input_schema=dict(tool.input_schema),
                result_schema=dict(tool.output_schema) if tool.output_schema else None,
                safety=f"runs in the host's MCP server '{self.id}' ({self.command})",
            )
            for tool in tools
        ]

    async def _list_roots(self, context: Any) -> types.ListRootsResult:
        return types.ListRootsResult(
            # Validated from a dict: pydantic turns the string into the `FileUrl` the field is typed as.
            roots=[
                types.Root.model_validate({"uri": Path(root).resolve().as_uri(), "name": Path(root).name})
                for root in self.roots
            ]
        )

    async def _elicit(self, context: Any, params: Any) -> types.ElicitResult:
        """The server asks during a call: forward the form to the calling session's caller.

        A shared server's `elicitation/create` does not say which call it belongs to: it is
        forwarded only while exactly one call is in flight, and cancelled otherwise (fail closed).
        """
        if getattr(params, "mode", "form") != "form" or self._calls_in_flight != 1 or len(self._askers) != 1:
            log.warning("MCP toolset %s asked for input with %d call(s) in flight; cancelled (cannot tell whose)",
                        self.id, self._calls_in_flight)
            return types.ElicitResult(action="cancel")
        answer = await self._askers[0](params.message, dict(params.requested_schema))
        return types.ElicitResult(action=answer["action"], content=answer.get("content"))

    async def _run(self, task_status: trio.TaskStatus[list[types.Tool]] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the server until stopped; its stderr becomes log lines, and the last ones explain a failed start."""
        read_fd, write_fd = os.pipe()
        errlog = os.fdopen(write_fd, "w")
        stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            stderr_done = trio.Event()
            nursery.start_soon(self._log_stderr, trio.lowlevel.FdStream(read_fd), stderr_tail, stderr_done)
            try:
                await self._serve_client(errlog, task_status)
            except Exception as exc:  # the process died or never started: report it, never crash the server
                failure = exc
                errlog.close()
                with trio.move_on_after(STDERR_GRACE):  # the child's last words explain the failure
                    await stderr_done.wait()
            finally:
                errlog.close()
                nursery.cancel_scope.cancel()
        if failure is None:
            return
        reason = _describe(failure)
        if stderr_tail:
            reason += f" (its stderr: {stderr_tail[-1]})"
        self._dead_reason = reason
        log.warning("MCP toolset %s stopped: %s", self.id, reason)
        if not self._started:
            raise RuntimeError(f"MCP toolset {self.id!r} could not start {self.command}: {reason}") from failure

    async def _serve_client(self, errlog: Any, task_status: trio.TaskStatus[list[types.Tool]]) -> None:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=self.command, args=self.args, env=self.env, cwd=self.cwd)
        stop = self._stop = trio.Event()
        self._started = False
        with trio.CancelScope(deadline=trio.current_time() + START_TIMEOUT) as startup:
            async with Client(
                _progress_in_order(stdio_client(params, errlog=errlog), self._progress_reports), mode="legacy",
                list_roots_callback=self._list_roots if self.roots else None,
                elicitation_callback=self._elicit,
            ) as client:
                errlog.close()  # the child has its own copy: at its exit the stderr pipe ends
                listing = await client.list_tools()
                startup.deadline = math.inf
                self._client, self._dead_reason = client, None
                self._started = True
                task_status.started(list(listing.tools))
                try:
                    await stop.wait()
                finally:
                    self._client = None
        if startup.cancelled_caught:
            raise TimeoutError(f"no answer within {START_TIMEOUT:g} s")

    async def _log_stderr(self, stream: trio.lowlevel.FdStream, tail: collections.deque[str], done: trio.Event) -> None:
        """Each stderr line of the server as a log line (it used to go to our stderr raw); keep the last few."""
        buffer = b""
        try:
            async with stream:
                while chunk := await stream.receive_some(65536):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for raw in lines:
                        self._stderr_line(raw, tail)
            self._stderr_line(buffer, tail)
        finally:
            done.set()

    def _stderr_line(self, raw: bytes, tail: collections.deque[str]) -> None:
        line = raw.decode(errors="replace").rstrip()
        if line:
            tail.append(line)
            log.info("MCP toolset %s: %s", self.id, line)

    async def _ensure_running(self) -> Any:
        async with self._start_lock:
            if self._client is not None:
                return self._client
            if self.restarts >= self.max_restarts:
                raise RuntimeError(
                    f"MCP toolset '{self.id}' is down ({self._dead_reason}) and was restarted "
                    f"{self.restarts} times already; not restarting again"
                )
            self.restarts += 1
            log.info("restarting MCP toolset %s (restart %d of %d)", self.id, self.restarts, self.max_restarts)
            await self._nursery.start(self._run)
            return self._client

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Call `tool` on the MCP server (restarting it first if it died), bounded by `call_timeout`.

        Cancellation: the SDK request is abandoned; the server keeps running for the next call.
        """
        try:
            client = await self._ensure_running()
        except Exception as exc:
            return ToolResult.failure(str(exc))
        asker = current_asker.get()
        self._calls_in_flight += 1
        if asker is not None:
            self._askers.append(asker)
        meta: Any = None
        if (report := call_progress.get()) is not None:
            token = f"oubliette-progress-{next(self._progress_tokens)}"
            self._progress_reports[token] = report
            meta = {"progressToken": token}
        try:
            with trio.move_on_after(self.call_timeout) as deadline:
                result = await client.call_tool(tool, arguments, meta=meta)
        except Exception as exc:
            self._mark_dead(exc)
            return ToolResult.failure(
                f"MCP toolset '{self.id}' failed during '{tool}' ({exc or type(exc).__name__}); "
                "it will be restarted on the next call"
            )
        finally:
            self._calls_in_flight -= 1
            if asker is not None:
                self._askers.remove(asker)
            if meta is not None:
                del self._progress_reports[meta["progressToken"]]
        if deadline.cancelled_caught:
            return ToolResult.failure(
                f"MCP toolset '{self.id}' did not answer '{tool}' within {self.call_timeout:g} s (its call timeout)"
            )
        if result.is_error:
            return ToolResult.failure(_text_of(result.content) or f"'{tool}' failed")
        return ToolResult.ok(result.structured_content, _content_dicts(result.content))

    def _mark_dead(self, exc: BaseException) -> None:
        self._dead_reason = str(exc) or type(exc).__name__
        self._client = None
        if self._stop is not None:
            self._stop.set()

    async def aclose(self) -> None:
        """Ask the server's task to end (it closes the session and the process); returns without waiting for it."""
        if self._stop is not None:
            self._stop.set()
