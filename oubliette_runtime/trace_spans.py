"""The spans of one call across the sandbox boundary, and the W3C trace context it carries.

Why one module: a relayed call is one trace from the agent's `tools/call` to the caller's tool
(docs/OBSERVABILITY.md, "Traces: one call across the boundary"). The client hands the current
span on in the relay request's `_meta` (`current_meta`: its `tools/call {tool}` span, which
covers the relay request; one span per program per hop, so the request gets no span of its
own), the server opens its span under it (`traced_relay_handler`) and hands its own on to the
caller (the pending entry, the `caller_tool_request` frame); an approval's wait is a span of its own, handed to the
caller the same way (`approval_wait_span`); and a caller's `session_message` reaches the agent
command as `TRACEPARENT` (`turn_environment`), through the guest runtime's span of the turn
when that traces (`turn_span`). Names and attributes follow the OpenTelemetry
semantic conventions for MCP (`tools/call {tool}`, `mcp.method.name`, `gen_ai.tool.name`,
`mcp.session.id`).

Cost: with no SDK configured (oubliette_runtime/telemetry.py) nothing here builds a span unless a peer
sent a context to pass on, and then only the API's no-op span, which carries the peer's context
through unchanged; attributes are set only on a recording span (`span.is_recording()`). An
invalid `traceparent` is ignored (`telemetry.extract`), never an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import telemetry

__all__ = [
    "current_meta", "tracing_on", "traced_relay_handler", "approval_wait_span",
    "record_approval_decision", "record_policy_decision",
    "turn_environment", "turn_span", "Turn", "TURN_SPAN", "fast_call_span", "TARGET_FIELDS",
]

#: The relay request methods that open a span in the server, and the params field naming the tool.
TARGET_FIELDS = {"caller_tool": "tool", "toolset_call": "name", "approval": "tool_name"}

_tracer: Any = None
_api: Any = None
"""opentelemetry's `trace` and `context` modules and `SpanKind`, imported at the first span (not
when this module is: a program that never traces never imports them)."""


def tracing_on() -> bool:
    """Whether spans are recorded and exported in this process (the SDK was set up from `OTEL_*`)."""
    return telemetry.tracing_configured()


def _get_tracer() -> Any:
    global _tracer, _api
    if _api is None:
        from types import SimpleNamespace

        from opentelemetry import context, trace

        _api = SimpleNamespace(trace=trace, context=context, SpanKind=trace.SpanKind, StatusCode=trace.StatusCode)
    if _tracer is None:
        # The SDK's tracer when the provider is set (at start), else a proxy that follows it.
        _tracer = _api.trace.get_tracer("oubliette")
    return _tracer


class _Current:
    """`span` as the current span until exit, then ended; an exception leaving it marks it an
    error. What the API's `start_as_current_span` does, without its two generator context
    managers: a few µs of each span on a relayed call's path (bench/bench_trace_spans.py)."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Any) -> None:
        self.span = span
        self._token: Any = None

    def __enter__(self) -> Any:
        self._token = _api.context.attach(_api.trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        _api.context.detach(self._token)
        if isinstance(exc, Exception) and self.span.is_recording():
            # What start_as_current_span's status-on-exception did (a cancellation is no error).
            if "error.type" not in (getattr(self.span, "attributes", None) or {}):
                self.span.set_attribute("error.type", type(exc).__qualname__)
            self.span.set_status(_api.StatusCode.ERROR, str(exc))
        self.span.end()


def _start(name: str, kind: str, attributes: dict[str, Any], context: Any = None) -> _Current:
    """A span `name` of `kind` (a `SpanKind` name) under `context` (default: the current one), its
    attributes given at start (checked once by the SDK, seen by the sampler), to enter as current."""
    tracer = _get_tracer()
    return _Current(tracer.start_span(
        name, context=context, kind=_api.SpanKind[kind], attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ))


def _meta_of(span_context: Any) -> dict[str, str] | None:
    """`span_context` as the `_meta` to hand on, or None when it is not valid."""
    if not span_context.is_valid:
        return None
    meta = {"traceparent": f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}"}
    if span_context.trace_state:
        meta["tracestate"] = span_context.trace_state.to_header()
    return meta


def current_meta() -> dict[str, str] | None:
    """`traceparent` (and `tracestate`) of the current span as a `_meta` to hand on, or None when
    there is no valid span (then nothing is added anywhere). The client's relay request carries
    this: tracing on, its `tools/call {tool}` span (a root of the client's own when the agent sent
    no context); tracing off, the agent's context passed through (the API's no-op span)."""
    from opentelemetry import trace

    return _meta_of(trace.get_current_span().get_span_context())


def _span_names(method: str, target: Any) -> tuple[str, str]:
    """(span name, `mcp.method.name`) of a relay request: a tool call is `tools/call {tool}` as the
    MCP conventions name it; an agent's approval request is `approval {tool}`."""
    if method == "approval":
        return f"approval {target}", "approval"
    return f"tools/call {target}", "tools/call"


def traced_relay_handler(
    method: str, handler: Callable[[Any, Any], Awaitable[Any]],
) -> Callable[[Any, Any], Awaitable[Any]]:
    """`handler` (connection, params) run inside the server's span of relay request `method`,
    parented on the `_meta` the client sent (its trace context); without tracing and without a
    `_meta` it is `handler` itself, at no cost."""
    field = TARGET_FIELDS[method]

    async def traced(connection: Any, params: Any) -> Any:
        meta = getattr(params, "_meta", None)
        if meta is None and not tracing_on():
            return await handler(connection, params)
        target = getattr(params, field, None)
        name, mcp_method = _span_names(method, target)
        context = telemetry.extract(meta) if meta is not None else None
        with _start(name, "SERVER", {
            "mcp.method.name": mcp_method, "gen_ai.tool.name": str(target),
            "gen_ai.operation.name": "execute_tool", "mcp.session.id": connection.session_key or "",
            "oubliette.relay.method": method, "oubliette.instance": connection.instance or "",
        }, context) as span:
            try:
                return await handler(connection, params)
            except Exception as exc:
                if span.is_recording():
                    code = getattr(exc, "code", None)
                    span.set_attribute("error.type", str(code) if code is not None else type(exc).__qualname__)
                    span.set_status(_api.StatusCode.ERROR, str(exc))
                raise

    return traced


def _no_result(result: Any) -> None:
    """`fast_call_span`'s result hook when no span records."""


@contextmanager
def fast_call_span(name: str, request_id: str | int, meta: dict[str, Any]) -> Iterator[Callable[[Any], None]]:
    """The span the MCP SDK makes for a `tools/call` (oubliette_runtime/fast_tool_calls.py takes the call
    off the SDK's path): `tools/call {name}`, kind SERVER, its attributes, under `meta`'s
    `traceparent`. Yields a hook to call with the result object, which marks a tool error as the
    SDK does. Without tracing and without context in `meta`: no span at all."""
    if "traceparent" not in meta and not tracing_on():
        yield _no_result
        return
    context = telemetry.extract(meta) if "traceparent" in meta else None
    with _start(f"tools/call {name}", "SERVER", {
        "mcp.method.name": "tools/call", "jsonrpc.request.id": str(request_id),
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
    }, context) as span:
        if not span.is_recording():
            yield _no_result
            return

        def ended(result: Any) -> None:
            if isinstance(result, dict) and result.get("isError") is True:
                span.set_attribute("error.type", "tool_error")
                span.set_status(_api.StatusCode.ERROR)

        yield ended


@contextmanager
def approval_wait_span(tool: str, request_id: str) -> Iterator[dict[str, str] | None]:
    """The server's span of the wait for an approval's decision (`approval wait`, kind INTERNAL,
    under the current span: the server's span of the gated call), open from the request to the
    decision: yields the `_meta` the `approval_request` carries to the caller, so the caller's
    `approval_response` nests under it. Tracing off: no span, the current context or None."""
    if not tracing_on():
        yield current_meta()
        return
    with _start("approval wait", "INTERNAL", {"gen_ai.tool.name": tool, "oubliette.approval.request_id": request_id}) as span:
        yield _meta_of(span.get_span_context())


def record_approval_decision(decision: str) -> None:
    """Mark the current `approval wait` span with how it ended (`decision`, the metrics' label):
    the approvals' `on_decided` hook runs inside that span."""
    if not tracing_on():
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("oubliette.approval.decision", decision)


def record_policy_decision(effect: str, policies: tuple[str, ...], enforced: bool) -> None:
    """Mark the current span (the server's span of a `caller_tool` or `toolset_call`) with the
    policies' decision on the call: its effect, the deciding policies, and whether it was enforced
    (an observe-only server lets a forbidden call run)."""
    if not tracing_on():
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("oubliette.policy.effect", effect)
        span.set_attribute("oubliette.policy.policies", list(policies))
        span.set_attribute("oubliette.policy.enforced", enforced)


def turn_environment(meta: Any) -> dict[str, str]:
    """`TRACEPARENT` / `TRACESTATE` for the agent command of a `user.message` whose payload's
    `_meta` is `meta` (the caller's context, through the server's span); empty without one, and
    for an invalid one."""
    if not isinstance(meta, dict):
        return {}
    context = telemetry.extract(meta)
    from opentelemetry import trace

    if not trace.get_current_span(context).get_span_context().is_valid:
        return {}
    return telemetry.traceparent_env(context)


TURN_SPAN = "process user.message"
"""The name of the guest runtime's span of a turn. The OpenTelemetry messaging conventions name
the processing of a received message `{operation} {destination}` with a low-cardinality
destination: the turn processes a `user.message` frame (kind CONSUMER). The session (`channel:id`)
is an attribute, not part of the name: span names stay few so backends can group them."""


class Turn:
    """What the guest runtime hands its agent command and records of one turn: `environment` is
    `TRACEPARENT` / `TRACESTATE` (and `BAGGAGE`) for the command; `exited` / `failed` mark how the
    turn ended on the span (no-ops without one)."""

    __slots__ = ("environment", "_span")

    def __init__(self, environment: dict[str, str], span: Any = None) -> None:
        self.environment = environment
        self._span = span if span is not None and span.is_recording() else None

    def exited(self, code: int) -> None:
        """The agent command exited with `code`: `process.exit.code`, and a non-zero one is an
        error (`error.type` the code, as the conventions give an exit status)."""
        if self._span is None:
            return
        self._span.set_attribute("process.exit.code", code)
        if code != 0:
            self.failed(str(code), f"the agent command exited with status {code}")

    def failed(self, error_type: str, description: str) -> None:
        """The turn failed without an exit status of its own (`start_failed`, `timeout`) or with one
        (`exited`): status ERROR with `error.type`."""
        if self._span is None:
            return
        self._span.set_attribute("error.type", error_type)
        self._span.set_status(_api.StatusCode.ERROR, description)


@contextmanager
def turn_span(meta: Any, session: str, instance: str, msg_id: str) -> Iterator[Turn]:
    """The guest runtime's span of one turn (`TURN_SPAN`, kind CONSUMER) around the whole turn,
    parented on the `user.message` frame's `_meta` (`meta`: the caller's context, through the
    server's span); a root of its own without a valid one. The agent command gets this span as
    `TRACEPARENT`, so the agent's own spans nest under the turn. Attributes: `mcp.session.id`
    (`session`, the key `channel:id`), `oubliette.instance`, `oubliette.msg_id`; the outcome
    through the yielded `Turn`. Tracing off in this process: no span (and no SDK), the frame's
    context handed on as it came (`turn_environment`)."""
    if not tracing_on():
        yield Turn(turn_environment(meta))
        return
    _get_tracer()
    parent = telemetry.extract(meta, _api.context.Context())  # a root when there is nothing valid
    with _start(TURN_SPAN, "CONSUMER", {
        "mcp.session.id": session, "oubliette.instance": instance, "oubliette.msg_id": msg_id,
    }, parent) as span:
        yield Turn(telemetry.traceparent_env(_api.trace.set_span_in_context(span, parent)), span)
