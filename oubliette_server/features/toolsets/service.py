"""The toolset feature as one service: registration, allowlists, per-session routers, `toolset_call`.

Both the embedding API (`OublietteServer.register_toolset` & co.) and the config
file go through here; client connections are told at once when what they see
changes.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Iterable, Mapping

import trio

from protocol import RelayError, encode_notification, errors, messages

from ...core.client_connections import ClientConnections, ClientPeer, progress_sink
from ...core.task_host import TaskHost
from ..approvals import ConnectionApprovals
from ..policy import PolicyCheck, ToolCall, as_declared, owner_principal
from .base import ToolResult, Toolset, ToolsetFactory, ToolSpec, call_progress
from .command_toolset import CommandToolset
from .elicit import current_asker
from .mcp_toolset import DEFAULT_CALL_TIMEOUT, McpToolset
from .registry import ToolsetDefinition, ToolsetRegistry
from .router import ToolRouter
from .session_toolsets import ToolsetSessions

log = logging.getLogger("oubliette.server.toolsets")

#: Backoff of a toolset that could not start (first retry, longest wait; seconds): tried again
#: on this schedule alone, so calls while it is down start nothing.
TOOLSET_RETRY = (1.0, 60.0)

AskCaller = Callable[[ClientPeer, str, dict[str, Any], str, dict[str, Any]], Awaitable[dict[str, Any]]]
"""`(connection, tool name, arguments, message, requestedSchema) -> {"action", "content"?}`: a toolset's
form put to the caller that owns the calling session."""


ApprovalTimeout = float | Mapping[str, float] | None
"""A toolset's `approval_timeout`: seconds for every gated tool, per tool name, or None (the server's)."""


def toolsets_config(router: ToolRouter) -> dict[str, Any]:
    """The `toolsets_config` params that publish a router's tools (and its toolsets that could not start)."""
    unavailable = router.unavailable()
    return {"tools": router.published(), "separator": router.separator, **({"unavailable": unavailable} if unavailable else {})}


class NotStarted(Toolset):
    """Stands in for a toolset that could not start: it publishes no tool, and a call says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Never routed to (it has no tools); says why if it is."""
        return ToolResult.failure(self.reason)

    async def aclose(self) -> None:
        """Nothing runs."""


_CARRIED = frozenset({"approval"})
"""A toolset call appends a frame of its own only when gated (`approval_request`): a permit's decision is a frame."""


class ToolsetService:
    """Host toolsets for the agents: what is registered, who may see it, and calls to it.

    Owns: a nursery (start it with `await nursery.start(service.serve)`) that runs the shared
    MCP toolsets and stops routers of sessions that ended. Needs: the tool-name separator,
    the client connections to push lists to, and the connection approvals (gated tools ask the
    owning caller of the calling connection's session; without them a gated call is denied).
    Raises: `RuntimeError` from `register_mcp_toolset` before `serve` started or when the MCP
    server cannot start; `ValueError` for a bad registration; `RelayError` from `call`
    (`DENIED` with the reason for a gated call that was not approved).
    """

    def __init__(
        self,
        separator: str,
        clients: ClientConnections,
        approvals: ConnectionApprovals | None = None,
        ask_caller: AskCaller | None = None,
        on_call: Callable[[str, BaseException | None], None] = lambda toolset, error: None,
        policy: PolicyCheck = as_declared,
    ) -> None:
        self.policy = policy
        """Decides each call before it runs (`PolicyGate.check`; by default the tools' own flags)."""
        self.ask_caller = ask_caller
        self.on_call = on_call
        """Told when a `toolset_call` ends: the toolset's id ("unknown" if none publishes the name), its error or None."""
        self.registry = ToolsetRegistry()
        self.clients = clients
        self.approvals = approvals
        self.sessions = ToolsetSessions(self.registry, separator, self._push)
        self._tasks = TaskHost()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the toolsets' nursery until cancelled."""
        await self._tasks.serve(task_status=task_status)

    # -- registration --------------------------------------------------------------------

    async def register_toolset(
        self,
        toolset_id: str,
        prefix: str,
        tools: list[ToolSpec],
        *,
        factory: ToolsetFactory | None = None,
        ref: Toolset | None = None,
        kind: str = "code",
        requires_approval: bool | Iterable[str] = False,
        approval_timeout: ApprovalTimeout = None,
    ) -> ToolsetDefinition:
        """Register a toolset: `factory` makes one per session (stopped with it), `ref` is one shared toolset.

        `requires_approval`: True gates every tool, a collection of tool names (their own names,
        without the prefix) gates those: each call waits for the owning caller's decision first.
        `approval_timeout`: seconds a gated call waits for it before it is denied: one number for
        every gated tool, or a mapping of tool names (their own) to seconds; the server's
        `approval_timeout` for the rest.
        Raises: `ValueError` for a timeout that is not a positive number, and as `ToolsetRegistry.register`.
        """
        definition = self._definition(
            toolset_id, prefix, tools, factory=factory, ref=ref, kind=kind, requires_approval=requires_approval,
            approval_timeout=approval_timeout,
        )
        self.registry.register(definition)
        await self.refresh()
        return definition

    def _definition(
        self, toolset_id: str, prefix: str, tools: list[ToolSpec], *, factory: ToolsetFactory | None, ref: Toolset | None,
        kind: str, requires_approval: bool | Iterable[str], approval_timeout: ApprovalTimeout,
    ) -> ToolsetDefinition:
        gate = requires_approval if isinstance(requires_approval, bool) else frozenset(requires_approval)
        default_ms, per_tool_ms = self._approval_timeouts_ms(toolset_id, approval_timeout)
        return ToolsetDefinition(
            toolset_id, prefix, list(tools), factory=factory, ref=ref, kind=kind, requires_approval=gate,
            approval_timeout_ms=default_ms if gate else None, approval_timeouts_ms=per_tool_ms,
        )

    async def register_mcp_toolset(
        self,
        toolset_id: str,
        prefix: str,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        roots: list[str] | None = None,
        *,
        call_timeout: float | None = None,
        requires_approval: bool | Iterable[str] = False,
        approval_timeout: ApprovalTimeout = None,
        keep_trying: bool = False,
    ) -> ToolsetDefinition:
        """Start a stdio MCP server with the SDK's client, list its tools, and register them (shared).

        `keep_trying`: a server that cannot start is registered all the same, as unavailable with
        the reason (allowlists may name it; the agents are told why it has no tools) and started
        again in the background, `TOOLSET_RETRY` apart (doubling), until it runs or is unregistered.
        Raises: `RuntimeError` before `serve`, or (without `keep_trying`) when the server cannot start.
        """
        nursery = self._tasks.nursery
        if nursery is None:
            raise RuntimeError("start the server (serve) before registering an MCP toolset")

        async def start() -> tuple[Toolset, list[ToolSpec]]:
            toolset = McpToolset(
                toolset_id, command, args, env, cwd, roots, nursery=nursery,
                call_timeout=call_timeout or DEFAULT_CALL_TIMEOUT,
            )
            return toolset, await toolset.start()

        options: dict[str, Any] = {"kind": "mcp", "requires_approval": requires_approval, "approval_timeout": approval_timeout}
        try:
            toolset, tools = await start()
        except Exception as exc:
            if not keep_trying:
                raise
            placeholder = self._definition(toolset_id, prefix, [], factory=None, ref=NotStarted(str(exc)), **options)
            placeholder.unavailable = str(exc)
            self.registry.register(placeholder)
            await self.refresh()
            nursery.start_soon(self._keep_starting, placeholder, start, options)
            return placeholder
        try:
            return await self.register_toolset(toolset_id, prefix, tools, ref=toolset, **options)
        except Exception:
            await toolset.aclose()
            raise

    async def _keep_starting(
        self, placeholder: ToolsetDefinition, start: Callable[[], Awaitable[tuple[Toolset, list[ToolSpec]]]],
        options: dict[str, Any],
    ) -> None:
        """Start an unavailable toolset again on the `TOOLSET_RETRY` backoff; once it runs, it takes
        the placeholder's place (same id and prefix, so allowlists keep it) and the agents get its tools."""
        delay = TOOLSET_RETRY[0]
        attempts = 1
        while True:
            log.warning("toolset %s could not start: %s; trying again in %g s", placeholder.id, placeholder.unavailable, delay)
            await trio.sleep(delay)  # a backoff between attempts, not a wait for an event
            if self.registry.definitions.get(placeholder.id) is not placeholder:
                return  # unregistered (or replaced) meanwhile
            attempts += 1
            try:
                toolset, tools = await start()
            except Exception as exc:  # whatever it is, the toolset stays unavailable and the server serves
                delay = min(delay * 2, TOOLSET_RETRY[1])
                if placeholder.unavailable != str(exc):
                    placeholder.unavailable = str(exc)
                    await self.refresh()
                continue
            if self.registry.definitions.get(placeholder.id) is not placeholder:
                await toolset.aclose()
                return
            self.registry.unregister(placeholder.id)
            self.registry.register(self._definition(placeholder.id, placeholder.prefix, tools, factory=None, ref=toolset, **options))
            await self.refresh()
            log.warning("toolset %s started at attempt %d; its %d tool(s) are published", placeholder.id, attempts, len(tools))
            return

    async def register_command_toolset(
        self,
        toolset_id: str,
        prefix: str,
        command: str | list[str],
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        requires_approval: bool | Iterable[str] = False,
        approval_timeout: ApprovalTimeout = None,
    ) -> ToolsetDefinition:
        """Register an endpoint speaking the action contract; discovery failures leave it empty."""
        options: dict[str, Any] = {"env": env, "cwd": cwd}
        if timeout is not None:
            options["timeout"] = timeout
        toolset = CommandToolset(toolset_id, command, **options)
        tools = await toolset.discover()
        return await self.register_toolset(
            toolset_id, prefix, tools, ref=toolset, kind="command", requires_approval=requires_approval,
            approval_timeout=approval_timeout,
        )

    async def unregister_toolset(self, toolset_id: str) -> None:
        """Remove a toolset: every session's router drops it (the agents are told), then a shared one is closed.

        Raises: `KeyError` when no toolset has that id.
        """
        definition = self.registry.unregister(toolset_id)
        await self.refresh()
        if definition.ref is not None:
            await definition.ref.aclose()

    async def update_allowed_toolsets(self, instance: str, toolset_ids: list[str]) -> None:
        """Set which toolsets an instance's agents see (empty by default); agents are told at once."""
        self.registry.set_allowed(instance, toolset_ids)
        await self.refresh(instance)

    async def refresh(self, instance: str | None = None) -> None:
        """Rebind every session's toolsets (of one instance) and tell clients whose list changed."""
        await self.sessions.refresh(instance)

    async def _push(self, router: ToolRouter) -> None:
        note = encode_notification(messages.TOOLSETS_CONFIG, toolsets_config(router))  # once for every client
        for connection in self.clients:
            if self.sessions.router_of(connection) is router:
                connection.notify_encoded(note)  # queued: never waits on a socket

    # -- connections ---------------------------------------------------------------------

    async def attach(self, connection: ClientPeer) -> dict[str, Any]:
        """Bind a new client connection to its session's router; the config it must get first."""
        return toolsets_config(await self.sessions.attach(connection))

    def detach(self, connection: ClientPeer) -> None:
        """A client connection is gone; if it was its session's last, the router is stopped in the service's nursery.

        When the service is stopping, the router is left to the nursery's teardown.
        """
        self.sessions.detach(connection, self._tasks.start_soon)

    def _approval_timeouts_ms(self, toolset_id: str, timeout: ApprovalTimeout) -> tuple[int | None, dict[str, int]]:
        """`approval_timeout` as milliseconds: (the toolset's default, per tool); the server's default if not given."""
        default = None if self.approvals is None else self.approvals.approvals.default_timeout
        per_tool: dict[str, float] = {}
        if isinstance(timeout, Mapping):
            per_tool = dict(timeout)
        elif timeout is not None:
            default = timeout
        for name, seconds in [("", default), *per_tool.items()]:
            if seconds is not None and not (
                isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 < seconds < math.inf
            ):
                where = f" of tool {name!r}" if name else ""
                raise ValueError(f"toolset {toolset_id!r}: approval_timeout{where} must be a positive number of seconds")
        return (
            None if default is None else max(1, round(default * 1000)),
            {name: max(1, round(seconds * 1000)) for name, seconds in per_tool.items()},
        )

    async def call(self, connection: ClientPeer, call: messages.ToolsetCall) -> messages.ToolsetCallResult:
        """The `toolset_call` relay method: decided by the policies first (forbidden: `RelayError(DENIED)`);
        a call they gate runs only once the owning caller approved it."""
        error: BaseException | None = None
        try:
            return await self._call(connection, call)
        except BaseException as exc:
            error = exc
            raise
        finally:
            router = self.sessions.router_of(connection)
            toolset = router.toolset_of(call.name) if router is not None else None
            self.on_call(toolset or "unknown", error)
            error = None  # its traceback holds this frame: no cycle left for the collector

    async def _call(self, connection: ClientPeer, call: messages.ToolsetCall) -> messages.ToolsetCallResult:
        router = self.sessions.router_of(connection)
        if router is None:
            raise RelayError(errors.NOT_FOUND, "no toolsets are bound to this connection")
        entry = router.checked(call.name, call.arguments)
        arguments = call.arguments
        definition = entry.binding.definition
        session = self.approvals.session_of(connection) if self.approvals is not None else None
        ruling = await self.policy(ToolCall(
            instance=connection.instance or "", session=connection.session_key or "", tool=call.name, kind="toolset",
            owner=definition.id, arguments=arguments, requires_approval=definition.gates(entry.spec.name),
            caller_principal=owner_principal(session),
        ), session, carried=_CARRIED)
        if ruling.effect == "approval":
            timeout_ms = definition.approval_timeout_ms_for(entry.spec.name)
            arguments = await self._approved_arguments(
                connection, call.name, arguments, entry.spec.input_schema,
                None if timeout_ms is None else timeout_ms / 1000, ruling.to_carry,
            )
        ask = self.ask_caller
        if ask is not None:

            async def asker(message: str, schema: dict[str, Any]) -> dict[str, Any]:
                return await ask(connection, call.name, arguments, message, schema)

            current_asker.set(asker)  # this task's context only: the call's own toolset reads it
        token = call_progress.set(progress_sink(connection, call.progress_ref))
        try:
            outcome = await router.call(call.name, arguments)
        finally:
            call_progress.reset(token)
        if outcome.is_error:
            raise RelayError(errors.TOOL_ERROR, outcome.error or f"{call.name} failed")
        return messages.ToolsetCallResult(result=outcome.result, content=outcome.content)

    async def _approved_arguments(
        self, connection: ClientPeer, name: str, arguments: dict[str, Any], schema: dict[str, Any],
        timeout: float | None, policy: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Wait for the decision on a gated call (`policy`: the policies' decision its `approval_request`
        carries): the arguments to run with, or `RelayError(DENIED)`."""
        if self.approvals is None:
            raise RelayError(errors.DENIED, f"'{name}' requires approval and this server has nobody to ask")
        decision = await self.approvals.decide(
            connection, name, arguments, origin="toolset", input_schema=schema, timeout=timeout, policy=policy,
        )
        if not decision.approve:
            raise RelayError(errors.DENIED, f"'{name}' was denied: {decision.reason or 'no reason given'}")
        return decision.updated_arguments if decision.updated_arguments is not None else arguments
