"""OpenTelemetry for both programs: the SDK set up from the standard `OTEL_*` variables, and W3C
trace context carried in MCP `_meta`, relay params and environment variables.

Why one module: oubliette-server and every mode of oubliette-client start the same way
(`setup_observability` once, at program start) and hand trace context on the same way
(`inject` / `extract`, `traceparent_env`), so a trace crosses caller → server → sandbox → agent
without each program growing its own idea of it.

Cost: with no `OTEL_*` exporter variable set (or `OTEL_SDK_DISABLED=true`, or
`OTEL_TRACES_EXPORTER=none`) nothing is configured and the SDK is never imported; the spans the
MCP SDK makes go to the API's no-op provider. The SDK and exporters are the optional extra `otel`
(docs/OBSERVABILITY.md, "Traces: exporting"); asked for without it, one WARNING says which pip
command installs it and the program goes on without tracing. At exit, spans still queued are
exported within `SHUTDOWN_SECONDS`, never longer.

Context follows Trio tasks: OpenTelemetry keeps it in contextvars, which a Trio task inherits
from its parent at spawn; the SDK's batch processor exports from its own (daemon) thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from .log_format import configure_logging

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator

__all__ = [
    "SHUTDOWN_SECONDS", "MISSING_EXTRA", "tracing_requested", "configure_tracing", "shutdown_tracing",
    "setup_observability", "inject", "extract", "traceparent_env", "context_from_env", "tracing_configured",
    "guard_sdk_extraction", "peer_trace_context", "PEER_FIELDS", "TRACEPARENT_CHARS", "TRACESTATE_CHARS",
    "TRACESTATE_MEMBERS", "BAGGAGE_BYTES", "BAGGAGE_MEMBERS", "BAGGAGE_MEMBER_CHARS",
]

log = logging.getLogger("oubliette.telemetry")

SHUTDOWN_SECONDS = 2.0
"""At exit, how long queued spans may take to export before the program ends anyway."""

MISSING_EXTRA = (
    "%s is set, but the OpenTelemetry SDK is not installed: tracing is off. Install the `otel` extra: "
    "pip install -e '.[otel]' (from the checkout) or pip install 'oubliette-relay[otel]' (once published)"
)

#: The variables that ask for spans to be exported (`OTEL_SERVICE_NAME` alone does not).
EXPORTER_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
#: The environment carriers of W3C trace context for a child process, by carrier key.
ENV_CARRIERS = {"traceparent": "TRACEPARENT", "tracestate": "TRACESTATE", "baggage": "BAGGAGE"}

_provider: Any = None
_propagator: TextMapPropagator | None = None


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    """`OTEL_TRACES_EXPORTER` as a list (default `otlp`); `none` is the empty list."""
    names = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if not names:
        return ["otlp"]
    return [] if "none" in names else names


def tracing_requested(environ: Mapping[str, str] = os.environ) -> str | None:
    """The variable that asks for exported spans, or None (nothing to set up, nothing imported)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or not _exporter_names(environ):
        return None
    return next((name for name in EXPORTER_VARIABLES if environ.get(name, "").strip()), None)


def _otlp_exporter(environ: Mapping[str, str]) -> Any:
    """The OTLP span exporter of the configured protocol; it reads its endpoint, headers,
    timeout, compression and certificates from the `OTEL_EXPORTER_OTLP_*` variables itself.

    Raises ImportError when the extra is missing, ValueError for a protocol it does not speak.
    """
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    elif protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported; use http/protobuf or grpc")
    return OTLPSpanExporter()


def configure_tracing(service_name_default: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Set up the SDK from the `OTEL_*` variables if they ask for it; True when spans are exported.

    `service_name_default` names the program unless `OTEL_SERVICE_NAME` or `service.name` in
    `OTEL_RESOURCE_ATTRIBUTES` does. The sampler, batch and span limits come from their own
    `OTEL_*` variables (read by the SDK). Call it once, at program start, after logging is set
    up; the spans queued at exit are exported then (`shutdown_tracing`, registered with atexit).
    """
    global _provider
    asked = tracing_requested(environ)
    if asked is None or _provider is not None:
        return _provider is not None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning(MISSING_EXTRA, asked)
        return False
    exporters = []
    for name in _exporter_names(environ):
        if name == "otlp":
            try:
                exporters.append(_otlp_exporter(environ))
            except ImportError:
                log.warning(MISSING_EXTRA, asked)
                return False
            except ValueError as exc:
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL: %s; no OTLP export", exc)
        elif name == "console":  # stdout carries MCP in both programs: spans go to stderr
            exporters.append(ConsoleSpanExporter(out=sys.stderr))
        else:
            log.warning("OTEL_TRACES_EXPORTER: exporter %r is not supported (otlp, console or none); ignored", name)
    if not exporters:
        return False
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name_default}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # ours is bounded
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown_tracing)
    log.debug("exporting traces as %s (%s)", resource.attributes.get(SERVICE_NAME), asked)
    return True


def tracing_configured() -> bool:
    """Whether this process set the SDK up (`configure_tracing` returned True): spans are recorded
    and exported. The paths beside the MCP SDK step aside then (oubliette_runtime/trace_spans.py)."""
    return _provider is not None


def shutdown_tracing(deadline: float = SHUTDOWN_SECONDS) -> None:
    """Export the spans still queued and stop the exporters, waiting at most `deadline` seconds.

    Runs at exit (atexit) once `configure_tracing` set the SDK up; does nothing otherwise. A
    collector that does not answer costs the program `deadline`, never a hang: the export goes
    on in a daemon thread that dies with the process.
    """
    global _provider
    provider, _provider = _provider, None
    if provider is None:
        return
    worker = threading.Thread(target=provider.shutdown, name="oubliette-otel-shutdown", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # no new thread this late in interpreter shutdown: what remains is dropped
        return
    worker.join(deadline)
    if worker.is_alive():
        log.warning("traces: spans not exported within %g s at exit were dropped", deadline)


def setup_observability(service_name_default: str, log_level: str | int, log_format: str = "text") -> None:
    """Program start, in one call: stderr logs (`--log-level`, `--log-format`), then tracing if asked."""
    configure_logging(log_level, log_format)
    configure_tracing(service_name_default)


# -- W3C trace context in carriers ----------------------------------------------------------------


#: W3C Trace Context's limits (https://www.w3.org/TR/trace-context/): a version-00 `traceparent`
#: is 55 characters; a `tracestate` at most 32 list members and 512 characters.
TRACEPARENT_CHARS = 55
TRACESTATE_CHARS = 512
TRACESTATE_MEMBERS = 32
#: W3C Baggage's limits (https://www.w3.org/TR/baggage/): 8,192 bytes and 64 list members; one
#: member at most 4,096 (the OpenTelemetry propagator's own cap, past which it logs the key).
BAGGAGE_BYTES = 8192
BAGGAGE_MEMBERS = 64
BAGGAGE_MEMBER_CHARS = 4096

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_BAGGAGE_VALUE = r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_BAGGAGE_MEMBER = re.compile(
    rf"{_TOKEN}[ \t]*=[ \t]*{_BAGGAGE_VALUE}[ \t]*(?:;[ \t]*{_TOKEN}[ \t]*(?:=[ \t]*{_BAGGAGE_VALUE}[ \t]*)?)*"
)
_LIST_SEPARATOR = re.compile(r"[ \t]*,[ \t]*")
#: The carrier keys a peer's trace context is read from (W3C's; SEP-414's `_meta` keys).
PEER_FIELDS = ("traceparent", "tracestate", "baggage")


def _members(header: str, most: int, member: re.Pattern[str], member_chars: int) -> list[str] | None:
    """The non-empty members of a W3C list header, or None when one is malformed, there are too many
    or none (OpenTelemetry's baggage propagator warns of a header of blanks)."""
    members = [m for m in _LIST_SEPARATOR.split(header.strip(" \t")) if m]
    if not members or len(members) > most or any(len(m) > member_chars or not member.fullmatch(m) for m in members):
        return None
    return members


def _is_traceparent(value: str) -> bool:
    match = _TRACEPARENT.fullmatch(value) if len(value) == TRACEPARENT_CHARS else None
    return match is not None and match[1] != "ff" and match[2] != "0" * 32 and match[3] != "0" * 16


def _is_tracestate(value: str) -> bool:
    if len(value) > TRACESTATE_CHARS:
        return False
    members = _members(value, TRACESTATE_MEMBERS, _TRACESTATE_MEMBER, TRACESTATE_CHARS)
    return members is not None and len({m.partition("=")[0] for m in members}) == len(members)


def _is_baggage(value: str) -> bool:
    return (value.isascii() and len(value) <= BAGGAGE_BYTES
            and _members(value, BAGGAGE_MEMBERS, _BAGGAGE_MEMBER, BAGGAGE_MEMBER_CHARS) is not None)


def peer_trace_context(carrier: Mapping[str, Any]) -> dict[str, str]:
    """The trace context of a carrier a peer filled, each key kept only when well-formed and within
    W3C's limits (`traceparent` a valid 55-character header, `tracestate` beside it, `baggage`):
    the one door every peer's context passes (`extract`, and the MCP SDK's own extraction through
    `guard_sdk_extraction`), so no library sees — or logs — a malformed or oversized value (a
    900 KB `tracestate` made OpenTelemetry log all of it, per request)."""
    clean: dict[str, str] = {}
    traceparent = carrier.get("traceparent")
    if isinstance(traceparent, str) and _is_traceparent(traceparent):
        clean["traceparent"] = traceparent
        tracestate = carrier.get("tracestate")
        if isinstance(tracestate, str) and _is_tracestate(tracestate):
            clean["tracestate"] = tracestate
    baggage = carrier.get("baggage")
    if isinstance(baggage, str) and _is_baggage(baggage):
        clean["baggage"] = baggage
    return clean


def _w3c() -> TextMapPropagator:
    """`traceparent` + `tracestate` and `baggage`, whatever `OTEL_PROPAGATORS` says: the MCP
    `_meta` keys (SEP-414) and the relay's are W3C's by definition."""
    global _propagator
    if _propagator is None:
        from opentelemetry.baggage.propagation import W3CBaggagePropagator
        from opentelemetry.propagators.composite import CompositePropagator
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    return _propagator


def _version_00(clean: Mapping[str, str], base: Context) -> Context | None:
    """`extract` of the usual carrier in a few µs instead of the propagators' ~16–24: a version-00
    `traceparent` (already well-formed: `peer_trace_context`), no `baggage`. None for anything
    else, which the propagators then read: this is only a shortcut, the result is the same
    context the W3C propagator would build."""
    traceparent = clean.get("traceparent")
    if traceparent is None or not traceparent.startswith("00-") or "baggage" in clean:
        return None
    from opentelemetry import trace

    tracestate = clean.get("tracestate")
    span_context = trace.SpanContext(
        int(traceparent[3:35], 16), int(traceparent[36:52], 16), is_remote=True,
        trace_flags=trace.TraceFlags(int(traceparent[53:55], 16)),
        trace_state=trace.TraceState.from_header([tracestate]) if tracestate is not None else None,
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context), base)


def inject(meta: MutableMapping[str, Any], context: Context | None = None) -> None:
    """Write `context`'s (default: the current) trace context into `meta` — an MCP request's
    `_meta` or a relay message's params: `traceparent`, `tracestate`, `baggage` when there are any."""
    _w3c().inject(meta, context=context)


def extract(meta: Any, context: Context | None = None) -> Context:
    """The context `meta`'s `traceparent`/`tracestate`/`baggage` describe, on top of `context`
    (default: the current one). Anything not well-formed (`peer_trace_context`) — no mapping, a
    malformed, oversized or non-string value — is dropped: the result is then `context` itself,
    never an error."""
    from opentelemetry import context as otel_context

    base = otel_context.get_current() if context is None else context
    if not isinstance(meta, Mapping):
        return base
    clean = peer_trace_context(meta)
    if not clean:
        return base
    quick = _version_00(clean, base)
    if quick is not None:
        return quick
    return _PeerCarriers(_w3c()).extract(clean, base)


def guard_sdk_extraction() -> None:
    """Make the global propagator read a peer's carrier as `extract` does: well-formed W3C values
    only (`peer_trace_context`), and never an error. The MCP SDK extracts every request's `_meta`
    with the global propagator and the default getter, and catches only ValueError and TypeError:
    a `_meta.baggage` that is not a string (a number, an object) raised AttributeError in the W3C
    baggage propagator and failed the request. Both programs call this where they build the SDK's
    server; idempotent."""
    from opentelemetry import propagate

    current = propagate.get_global_textmap()
    if not isinstance(current, _PeerCarriers):
        propagate.set_global_textmap(_PeerCarriers(current))  # type: ignore[arg-type]  # duck-typed: the API stays unimported until here


def _carrier_values(carrier: Any, getter: Any) -> Mapping[str, Any]:
    """`PEER_FIELDS` of a carrier: a mapping as it is, anything else through its getter (several
    values of one field joined as W3C lists are, with commas)."""
    if isinstance(carrier, Mapping) or getter is None:
        return carrier if isinstance(carrier, Mapping) else {}
    values = {}
    for key in PEER_FIELDS:
        found = getter.get(carrier, key)
        if isinstance(found, (list, tuple)) and found and all(isinstance(v, str) for v in found):
            values[key] = ",".join(found)
    return values


class _PeerCarriers:
    """A propagator (the global one, wrapped) that reads a carrier through `peer_trace_context`
    and, whatever it holds, returns the context it was given rather than raise."""

    def __init__(self, inner: TextMapPropagator) -> None:
        self.inner = inner

    def extract(self, carrier: Any, context: Context | None = None, getter: Any = None) -> Context:
        """The inner propagator's `extract`, on the well-formed W3C values only; on any failure, `context`."""
        try:
            return self.inner.extract(peer_trace_context(_carrier_values(carrier, getter)), context)
        except Exception:  # a peer's malformed header must never fail its request
            from opentelemetry import context as otel_context

            return otel_context.get_current() if context is None else context

    def inject(self, carrier: Any, context: Context | None = None, setter: Any = None) -> None:
        """The inner propagator's `inject`, unchanged (what this process writes is well-formed)."""
        self.inner.inject(carrier, context, **({} if setter is None else {"setter": setter}))

    @property
    def fields(self) -> set[str]:
        """The inner propagator's fields."""
        return self.inner.fields


def traceparent_env(context: Context | None = None) -> dict[str, str]:
    """`TRACEPARENT`, `TRACESTATE` (and `BAGGAGE`) for a child process's environment: the
    convention by which a process picks up its parent's trace; empty outside a span."""
    carrier: dict[str, str] = {}
    inject(carrier, context)
    return {ENV_CARRIERS[key]: value for key, value in carrier.items() if key in ENV_CARRIERS}


def context_from_env(environ: Mapping[str, str] = os.environ, context: Context | None = None) -> Context:
    """The trace context a parent process handed on in `TRACEPARENT`/`TRACESTATE`/`BAGGAGE`."""
    return extract({key: environ[name] for key, name in ENV_CARRIERS.items() if name in environ}, context)
