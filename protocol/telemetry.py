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
    "guard_sdk_extraction",
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
    and exported. The paths beside the MCP SDK step aside then (protocol/trace_spans.py)."""
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


class _StringGetter:
    """Reads a carrier that an untrusted peer filled: a value that is not a string is absent."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [key for key in carrier if isinstance(key, str)]


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


_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _version_00(meta: Mapping[str, Any], base: Context) -> Context | None:
    """`extract` of the usual carrier in a few µs instead of the propagators' ~16–24: a
    well-formed version-00 `traceparent`, valid ids, no `baggage`. None for anything else, which
    the propagators then read (and ignore if invalid) as before: this is only a shortcut, the
    result is the same context the W3C propagator would build."""
    traceparent = meta.get("traceparent")
    if not isinstance(traceparent, str) or "baggage" in meta:
        return None
    match = _TRACEPARENT_00.fullmatch(traceparent)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    from opentelemetry import trace

    tracestate = meta.get("tracestate")
    span_context = trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(match[3], 16)),
        trace_state=trace.TraceState.from_header([tracestate]) if isinstance(tracestate, str) else None,
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context), base)


def inject(meta: MutableMapping[str, Any], context: Context | None = None) -> None:
    """Write `context`'s (default: the current) trace context into `meta` — an MCP request's
    `_meta` or a relay message's params: `traceparent`, `tracestate`, `baggage` when there are any."""
    _w3c().inject(meta, context=context)


def extract(meta: Any, context: Context | None = None) -> Context:
    """The context `meta`'s `traceparent`/`tracestate`/`baggage` describe, on top of `context`
    (default: the current one). Anything invalid — no mapping, a malformed or non-string
    `traceparent` — is ignored: the result is then `context` itself, never an error."""
    from opentelemetry import context as otel_context

    base = otel_context.get_current() if context is None else context
    if not isinstance(meta, Mapping):
        return base
    quick = _version_00(meta, base)
    if quick is not None:
        return quick
    return _PeerCarriers(_w3c()).extract(meta, base)  # a peer's carrier: strings only, never an error


def guard_sdk_extraction() -> None:
    """Make the global propagator read a peer's carrier as `extract` does: string values only,
    and never an error. The MCP SDK extracts every request's `_meta` with the global propagator
    and the default getter, and catches only ValueError and TypeError: a `_meta.baggage` that is
    not a string (a number, an object) raised AttributeError in the W3C baggage propagator and
    failed the request. Both programs call this where they build the SDK's server; idempotent."""
    from opentelemetry import propagate

    current = propagate.get_global_textmap()
    if not isinstance(current, _PeerCarriers):
        propagate.set_global_textmap(_PeerCarriers(current))  # type: ignore[arg-type]  # duck-typed: the API stays unimported until here


class _PeerCarriers:
    """A propagator (the global one, wrapped) that reads a mapping carrier through `_StringGetter`
    and, whatever it holds, returns the context it was given rather than raise."""

    def __init__(self, inner: TextMapPropagator) -> None:
        self.inner = inner

    def extract(self, carrier: Any, context: Context | None = None, getter: Any = None) -> Context:
        """The inner propagator's `extract`, on string values only; on any failure, `context`."""
        try:
            if isinstance(carrier, Mapping):
                return self.inner.extract(carrier, context, getter=_StringGetter())  # type: ignore[arg-type]
            return self.inner.extract(carrier, context, **({} if getter is None else {"getter": getter}))
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
