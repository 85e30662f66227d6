"""Caller tool declarations and the `caller_tool` relay method.

A caller declares its tools for a session with `session_message`'s
`context.caller_tools`; every client connection that sees that session gets a
`caller_tools_config`. A client bound to a session sees that session's tools;
an unbound one sees, per caller id, the session declared last.

The declaration is also recorded in the log, in a `session_record` frame only the server
appends (`declare` returns its part of the payload; server_owned.py), on every store; with a
shared store another server, where the agent's client connects, reads it from the log
(`load_declaration`) and relays the calls through the log (cluster/log_bus.py).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from protocol import (
    CallerToolSpec,
    EncodedNotification,
    RelayError,
    SessionRef,
    encode_notification,
    errors,
    messages,
    unstructure,
)
from protocol.schema_check import InvalidSchema, compile_schema

from ...core.callers import CallerConnection
from ...core.client_connections import ClientConnections, ClientPeer, progress_sink
from ...core.server_owned import DECLARATION_KEY
from ...core.sessions import Session, SessionRegistry
from ..approvals import ApprovalService
from ..policy import PolicyCheck, ToolCall, as_declared, owner_principal
from .pending import CallerCallRegistry


_CARRIED = frozenset({"permit", "approval"})
"""A caller tool call always appends a request frame (`approval_request`, `caller_tool_request`) unless forbidden."""


class CallerToolRelay:
    """Declares caller tools to the agents and relays their calls to the declaring caller.

    Needs: the session registry, the client connections (to push configurations to), the
    pending-call registry (which appends the request and outcome frames), the approval
    service (gated tools) and the policy check (`PolicyGate.check`; without one, the tools' own flags).
    Raises: `RelayError(NOT_FOUND)` for a tool the connection cannot see; `RelayError(DENIED)`
    for a gated call that was not approved or a call the policies forbid.
    """

    def __init__(
        self, sessions: SessionRegistry, clients: ClientConnections, pending: CallerCallRegistry, approvals: ApprovalService,
        policy: PolicyCheck = as_declared,
    ) -> None:
        self.sessions = sessions
        self.clients = clients
        self.pending = pending
        self.approvals = approvals
        self.policy = policy

    async def declare(
        self, session: Session, caller: CallerConnection, caller_id: str, tools: list[CallerToolSpec],
        echo_own_answers: bool | None = None,
    ) -> dict[str, Any]:
        """Make `caller` the owner of `session`'s caller tools and tell the clients that see them
        (`echo_own_answers`, when given: whether it gets the events of its own answers).

        A tool with `requires_approval` is gated (see `call`); the clients get its effective
        approval timeout, so they wait for the decision as long as the server does.
        Returns what the session's `session_record` must carry: the declaration (`caller_tools`:
        `{caller_id, tools}`), which other servers (and `oubliette-server status`) read from the log.
        """
        for tool in tools:
            self._check_schemas(tool)
        tools = [self._with_approval_timeout(tool) for tool in tools]
        self.sessions.declare(session, caller, caller_id, tools, echo_own_answers)
        config = unstructure(messages.CallerToolsConfig(session_id=session.id, caller_id=caller_id, tools=tools))
        note: EncodedNotification | None = None  # encoded once (up to 1 MiB), the same bytes to every client
        for connection in self.clients.of_instance(session.instance):
            if self._client_sees(connection, session):
                note = note or encode_notification(messages.CALLER_TOOLS_CONFIG, config)
                connection.notify_encoded(note)  # queued: never waits on a socket
        return {DECLARATION_KEY: {"caller_id": caller_id, "tools": [unstructure(tool) for tool in tools]}}

    @staticmethod
    def needs_record(session: Session, caller: CallerConnection, declared: dict[str, Any]) -> bool:
        """A `session_record` must tell the log the session's owner and `declared` (what `declare`
        returned): something was declared, or the log does not yet name this owner (a message that
        declares nothing need not record it again). On every store, one path: other servers read
        it back, and `oubliette-server status` shows it."""
        return bool(declared) or session.owner_identity != caller.identity

    async def load_declaration(self, connection: ClientPeer) -> None:
        """Shared store: before a client bound to a session this server has no caller for gets its
        configuration, read the session's latest declaration and its owner's identity from the log
        (written on another server): that owner may answer here too."""
        if connection.session_key is None or connection.instance is None:
            return
        ref = SessionRef.parse_key(connection.session_key)
        instance = connection.instance
        record = await self.pending.crossing.session_record(lambda: self.sessions.get_or_create(instance, ref.channel, ref.id))
        if record is None:
            return  # one server: memory is all there is
        session, owner, declared = record
        self.sessions.adopt_record(session, owner, declared)

    @staticmethod
    def _check_schemas(tool: CallerToolSpec) -> None:
        """Refuse a tool whose inputSchema or resultSchema is not a valid JSON Schema (checked against
        its metaschema once, here): the client could not publish it, and calls to it could never work."""
        for field, schema in (("inputSchema", tool.inputSchema), ("resultSchema", tool.resultSchema)):
            if schema is None:
                continue
            try:
                compile_schema(schema)
            except InvalidSchema as exc:
                raise RelayError(
                    errors.INVALID_PARAMS, f"caller tool '{tool.name}': {field} is not a valid JSON Schema ({exc}); nothing was declared",
                ) from None

    def _client_sees(self, connection: ClientPeer, session: Session) -> bool:
        if connection.session_key is not None:
            return SessionRef.parse_key(connection.session_key).key == session.key
        latest = self.sessions.latest_declarations(session.instance).get(session.caller_id or "")
        return latest is session

    def sessions_visible_to(self, connection: ClientPeer) -> list[Session]:
        """The sessions whose caller tools this client connection sees."""
        assert connection.instance is not None
        if connection.session_key is not None:
            ref = SessionRef.parse_key(connection.session_key)
            session = self.sessions.get(connection.instance, ref.channel, ref.id)
            return [session] if session is not None and session.caller_id else []
        return list(self.sessions.latest_declarations(connection.instance).values())

    def configs_for(self, connection: ClientPeer) -> list[dict[str, Any]]:
        """The `caller_tools_config` params a newly connected client must get before its hello reply."""
        return [
            unstructure(messages.CallerToolsConfig(
                session_id=session.id, caller_id=session.caller_id or "",
                tools=list(session.caller_tools.values()),
            ))
            for session in self.sessions_visible_to(connection)
        ]

    def _with_approval_timeout(self, tool: CallerToolSpec) -> CallerToolSpec:
        if not tool.requires_approval or tool.approval_timeout_ms is not None:
            return tool
        return attrs.evolve(tool, approval_timeout_ms=max(1, round(self.approvals.default_timeout * 1000)))

    async def call(self, connection: ClientPeer, call: messages.CallerToolCall) -> messages.CallerToolResult:
        """The `caller_tool` relay method: find the tool, relay it, return the caller's answer.

        The deployment's policies decide first (`policy`): a forbidden call is `RelayError(DENIED)`
        and the caller sees nothing of it. A call they gate (the tool's `requires_approval`, a
        `@requireApproval` policy) waits for the owning caller's decision; nothing is relayed
        before it. Denied (by the caller, the timeout, a disconnect): `RelayError(DENIED)`
        with the reason. A client-side tool answered directly (a tool return) is the result, with
        no `caller_tool_request` round trip.
        """
        session, spec = self._find(connection, call)
        arguments = call.arguments
        published = f"{session.caller_id}_{spec.name}"
        ruling = await self.policy(ToolCall(
            instance=session.instance, session=session.key, tool=published, kind="caller", owner=session.caller_id or "",
            arguments=arguments, requires_approval=spec.requires_approval, caller_principal=owner_principal(session),
        ), session, carried=_CARRIED)
        policy = ruling.to_carry  # the decision, in the first request frame of the call
        if ruling.effect == "approval":
            decision = await self.approvals.request(
                session, published, arguments, origin="caller", caller=session.owner,
                timeout=spec.approval_timeout_ms / 1000 if spec.approval_timeout_ms else None,
                input_schema=spec.inputSchema, allows_tool_return=True, policy=policy,
            )
            policy = None
            if decision.kind == "tool":
                if decision.status == "error":
                    raise RelayError(errors.TOOL_ERROR, _text(decision.tool_return))
                return messages.CallerToolResult(result=self.pending.check_result(spec, decision.tool_return))
            if not decision.approve:
                raise RelayError(errors.DENIED, f"'{published}' was denied: {decision.reason or 'no reason given'}")
            if decision.updated_arguments is not None:
                arguments = decision.updated_arguments
        result = await self.pending.relay(session, spec, arguments, progress_sink(connection, call.progress_ref), policy)
        return messages.CallerToolResult(result=result)

    def _find(self, connection: ClientPeer, call: messages.CallerToolCall) -> tuple[Session, CallerToolSpec]:
        candidates = self.sessions_visible_to(connection)
        if call.caller_id is not None:
            candidates = [s for s in candidates if s.caller_id == call.caller_id]
        for session in sorted(candidates, key=lambda s: s.declared_at, reverse=True):
            spec = session.caller_tools.get(call.tool)
            if spec is not None:
                return session, spec
        who = f"caller '{call.caller_id}'" if call.caller_id else "any caller"
        raise RelayError(errors.NOT_FOUND, f"unknown caller tool '{call.tool}' for {who} of this session")


def _text(value: Any) -> str:
    """A tool return as the agent's error text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
