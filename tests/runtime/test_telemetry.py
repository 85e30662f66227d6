"""Traces and structured logs (docs/OBSERVABILITY.md): W3C trace context in `_meta` and the
environment (oubliette_runtime/telemetry.py), the SDK set up from `OTEL_*` only when asked (and not even
imported otherwise), one WARNING when the `otel` extra is missing, `--log-format json`, and both
real programs exporting their spans over OTLP/HTTP (and the server over OTLP/gRPC) to a
receiver this test runs on loopback."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider

from harness import PYTHON, Deployment, HandMcp
from otlp_sink import OtlpReceiver  # bench/, on the tests' path

from oubliette_runtime.log_format import JsonFormatter
from oubliette_runtime.telemetry import context_from_env, extract, inject, traceparent_env, tracing_requested
from otel_env import CALLER_LINES, PROBE, _env_without_otel

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
tracer = TracerProvider().get_tracer("test")  # not the global provider: no export, no global state


def _current_ids() -> tuple[str, str]:
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


# -- carriers -------------------------------------------------------------------------------------


def test_inject_writes_the_current_span_and_extract_reads_it_back() -> None:
    meta: dict[str, Any] = {"progressToken": 1}
    with tracer.start_as_current_span("call"):
        inject(meta)
        trace_id, span_id = _current_ids()
    assert meta["traceparent"].startswith(f"00-{trace_id}-{span_id}-") and meta["progressToken"] == 1
    remote = trace.get_current_span(extract(meta)).get_span_context()
    assert (format(remote.trace_id, "032x"), format(remote.span_id, "016x")) == (trace_id, span_id)
    assert remote.is_remote


def test_extract_keeps_tracestate_and_baggage() -> None:
    meta = {"traceparent": PARENT, "tracestate": "vendor=abc,other=1", "baggage": "tenant=t1"}
    context = extract(meta)
    span_context = trace.get_current_span(context).get_span_context()
    assert format(span_context.trace_id, "032x") == TRACE_ID
    assert dict(span_context.trace_state) == {"vendor": "abc", "other": "1"}
    assert baggage.get_baggage("tenant", context) == "t1"
    again: dict[str, Any] = {}
    inject(again, context)  # handed on unchanged
    assert again == meta


@pytest.mark.parametrize("meta", [
    {"traceparent": PARENT},
    {"traceparent": PARENT, "tracestate": "vendor=abc,other=1", "progressToken": 3},
    {"traceparent": PARENT[:-2] + "00"},  # not sampled
    {"traceparent": PARENT, "tracestate": 5},  # a tracestate that is not a string is absent
    {"traceparent": PARENT, "tracestate": "not a tracestate !"},
    {"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"},
    {"traceparent": f"00-{TRACE_ID}-0000000000000000-01"},
    {"traceparent": f"01-{TRACE_ID}-b7ad6b7169203331-01"},  # a later version, in 55 characters
    {"traceparent": f"00-{TRACE_ID.upper()}-b7ad6b7169203331-01"},
])
def test_extract_reads_a_traceparent_as_the_w3c_propagator_does(meta: dict[str, Any]) -> None:
    """`extract`'s shortcut for a plain version-00 `traceparent` builds the very context the W3C
    propagator would: same ids, flags, tracestate and remoteness, or none at all."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    strings = {key: value for key, value in meta.items() if isinstance(value, str)}
    ours = trace.get_current_span(extract(meta)).get_span_context()
    theirs = trace.get_current_span(TraceContextTextMapPropagator().extract(strings)).get_span_context()
    assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote, ours.is_valid) == (
        theirs.trace_id, theirs.span_id, theirs.trace_flags, theirs.is_remote, theirs.is_valid)
    assert dict(ours.trace_state or {}) == dict(theirs.trace_state or {})


@pytest.mark.parametrize("meta", [
    {"traceparent": "not a traceparent"},
    {"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"},  # all-zero trace id
    {"traceparent": 17},
    {"traceparent": ["00-" + TRACE_ID + "-b7ad6b7169203331-01"]},
    {"tracestate": "vendor=abc"},
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    None,
])
def test_an_invalid_carrier_is_ignored_never_an_error(meta: Any) -> None:
    """A peer's malformed `_meta` leaves the current context as it was: the span nests where it would have."""
    with tracer.start_as_current_span("ours"):
        ours = trace.get_current_span()
        assert trace.get_current_span(extract(meta)) is ours
    assert not trace.get_current_span(extract(meta)).get_span_context().is_valid


WELL_FORMED_STATE = ",".join(f"k{n}=v{n}" for n in range(32))


@pytest.mark.parametrize(("meta", "kept"), [
    ({"traceparent": PARENT, "tracestate": "x" * 900_000}, {"traceparent"}),  # once logged whole
    ({"traceparent": PARENT, "tracestate": "vendor=" + "a" * 506}, {"traceparent"}),  # 513 characters
    ({"traceparent": PARENT, "tracestate": WELL_FORMED_STATE + ",k32=v"}, {"traceparent"}),  # 33 members
    ({"traceparent": PARENT, "tracestate": "vendor=abc,vendor=def"}, {"traceparent"}),  # a key twice
    ({"traceparent": PARENT, "tracestate": "Vendor=abc"}, {"traceparent"}),
    ({"traceparent": PARENT, "tracestate": WELL_FORMED_STATE}, {"traceparent", "tracestate"}),
    ({"traceparent": PARENT, "tracestate": "vendor=" + "a" * 255}, {"traceparent", "tracestate"}),
    ({"traceparent": f" {PARENT} "}, set()),  # 57 characters
    ({"traceparent": f"01-{TRACE_ID}-b7ad6b7169203331-01-later"}, set()),  # past 55 characters
    ({"traceparent": PARENT + "\u202e"}, set()),
    ({"traceparent": f"ff-{TRACE_ID}-b7ad6b7169203331-01"}, set()),
    ({"tracestate": "vendor=abc"}, set()),  # a tracestate alone says nothing
    ({"baggage": "tenant=t1;p=1, user=u%201"}, {"baggage"}),
    ({"baggage": "\t"}, set()),  # no member: the propagator warned of it (found by the log-lines fuzz)
    ({"baggage": "tenant=" + "x" * 8190}, set()),  # past 8,192 bytes
    ({"baggage": ",".join(f"k{n}=v" for n in range(65))}, set()),  # 65 members
    ({"baggage": "tenant=t1,\x9b=x"}, set()),
    ({"baggage": "tenant=t\u00fc"}, set()),
    ({"baggage": "x" * 5000 + "=1"}, set()),  # one member past 4,096: the propagator would log its key
])
def test_trace_context_is_dropped_unless_well_formed_and_within_w3c_limits(meta: dict[str, Any], kept: set[str]) -> None:
    """`peer_trace_context` keeps each key only when well-formed and within W3C's limits, and
    OpenTelemetry, handed what it keeps, logs nothing (it logged a 900 KB tracestate whole)."""
    from oubliette_runtime.telemetry import ENV_CARRIERS, guard_sdk_extraction, peer_trace_context
    from oubliette_runtime.trace_spans import turn_environment

    assert set(peer_trace_context(meta)) == kept
    guard_sdk_extraction()
    from opentelemetry import propagate

    otel = logging.getLogger("opentelemetry")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    otel.addHandler(handler)
    try:
        extract(meta)
        propagate.extract(meta)  # the MCP SDK's own extraction, through guard_sdk_extraction
        turn_environment(meta)  # the guest runtime: a user.message payload's `_meta`
        context_from_env({name: meta[key] for key, name in ENV_CARRIERS.items() if isinstance(meta.get(key), str)})
    finally:
        otel.removeHandler(handler)
    assert records == []


def test_traceparent_env_hands_the_span_to_a_child_process() -> None:
    assert traceparent_env() == {}  # outside a span: nothing to hand on
    with tracer.start_as_current_span("turn"):
        trace_id, span_id = _current_ids()
        token = otel_context.attach(baggage.set_baggage("tenant", "t1"))
        try:
            env = traceparent_env()
        finally:
            otel_context.detach(token)
    assert env.keys() == {"TRACEPARENT", "BAGGAGE"} and env["BAGGAGE"] == "tenant=t1"
    assert env["TRACEPARENT"].startswith(f"00-{trace_id}-{span_id}-")
    child = trace.get_current_span(context_from_env(env)).get_span_context()
    assert format(child.trace_id, "032x") == trace_id
    state = traceparent_env(extract({"traceparent": PARENT, "tracestate": "vendor=abc"}))
    assert state == {"TRACEPARENT": PARENT, "TRACESTATE": "vendor=abc"}


@pytest.mark.parametrize(("environ", "asked"), [
    ({}, None),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None),
])
def test_only_an_exporter_variable_turns_tracing_on(environ: dict[str, str], asked: str | None) -> None:
    assert tracing_requested(environ) == asked


# -- the JSON log line ----------------------------------------------------------------------------


def test_a_json_line_carries_fields_and_the_span_it_was_written_in() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("oubliette.access", logging.INFO, __file__, 1, "a %s", ("b\nc",), None)
    record.peer = "unix"
    outside = json.loads(formatter.format(record))
    assert outside["level"] == "INFO" and outside["logger"] == "oubliette.access" and outside["message"] == "a b\\nc"
    assert outside["peer"] == "unix" and outside["time"].endswith("Z") and "trace_id" not in outside
    with tracer.start_as_current_span("call"):
        trace_id, span_id = _current_ids()
        inside = json.loads(formatter.format(record))
    assert (inside["trace_id"], inside["span_id"]) == (trace_id, span_id)
    with tracer.start_as_current_span("under a caller's span", context=extract({"traceparent": PARENT})):
        assert json.loads(formatter.format(record))["trace_id"] == TRACE_ID
    assert "\n" not in formatter.format(record)


# -- the SDK only when asked ----------------------------------------------------------------------

SERVER_MAIN = "oubliette_server.program.cli"


def _probe(deployment: Deployment, env: dict[str, str], block: bool = False) -> subprocess.CompletedProcess[str]:
    argv = ["--relay", deployment.relay, "--data-dir", str(deployment.data_dir), "--log-level", "WARNING"]
    done = subprocess.run(
        [PYTHON, "-c", PROBE.format(block=block, argv=argv, main=SERVER_MAIN)], input=CALLER_LINES,
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert '"serverInfo"' in done.stdout, done.stdout  # it served the caller
    return done


def test_with_no_otel_variable_the_sdk_is_never_imported(deployment: Deployment) -> None:
    """Nothing set: not one SDK module is loaded. The same server with the variable imports them
    (so the probe would see them)."""
    done = _probe(deployment, _env_without_otel())
    assert "MODULES []" in done.stderr, done.stderr
    done = _probe(deployment, _env_without_otel(OTEL_TRACES_EXPORTER="console"))
    assert "'opentelemetry.sdk.trace'" in done.stderr, done.stderr


def test_grpc_is_the_other_protocol(deployment: Deployment) -> None:
    """`OTEL_EXPORTER_OTLP_PROTOCOL=grpc`: the server exports its spans with the gRPC exporter (not
    the HTTP one) to an OTLP/gRPC receiver on loopback, which decodes them with opentelemetry-proto."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[Any] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the service's method name)
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    try:
        done = _probe(deployment, _env_without_otel(
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc"))
    finally:
        receiver.stop(grace=None)
    assert "'opentelemetry.exporter.otlp.proto.grpc.trace_exporter'" in done.stderr, done.stderr
    assert "'opentelemetry.exporter.otlp.proto.http.trace_exporter'" not in done.stderr
    exported = {
        (attribute.value.string_value, span.name)
        for request in received for resource_spans in request.resource_spans
        for attribute in resource_spans.resource.attributes if attribute.key == "service.name"
        for scope in resource_spans.scope_spans for span in scope.spans
    }
    assert {("oubliette-server", "initialize"), ("oubliette-server", "tools/list")} <= exported, (exported, done.stderr)


def test_without_the_extra_one_warning_names_the_pip_command(deployment: Deployment) -> None:
    done = _probe(deployment, _env_without_otel(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9"), block=True)
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, done.stderr
    assert "OTEL_EXPORTER_OTLP_ENDPOINT is set" in warnings[0] and "pip install -e '.[otel]'" in warnings[0]
    assert "MODULES []" in done.stderr


def test_a_collector_that_never_answers_delays_exit_by_the_deadline_only(deployment: Deployment) -> None:
    """Spans queued at exit, a collector that accepts the connection and never answers, an export
    timeout of 30 s: the server still exits after its 2 s deadline, saying what it dropped."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections wait in its backlog, unread
        env = _env_without_otel(
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}",
            OTEL_EXPORTER_OTLP_TIMEOUT="30", OTEL_BSP_SCHEDULE_DELAY="60000",
        )
        began = time.monotonic()
        done = _probe(deployment, env)
        elapsed = time.monotonic() - began
    assert "spans not exported within 2 s at exit were dropped" in done.stderr, done.stderr
    assert elapsed < 25, elapsed


# -- both programs export over OTLP/HTTP ----------------------------------------------------------


async def _drain(stream: Any, into: bytearray) -> None:
    while chunk := await stream.receive_some(65536):
        into.extend(chunk)


async def test_both_programs_export_their_spans_with_the_configured_service_name(deployment: Deployment) -> None:
    """The server (OTEL_SERVICE_NAME) and the client's stdio server (service.name from
    OTEL_RESOURCE_ATTRIBUTES) export the MCP SDK's request spans at exit; a caller's
    `traceparent` in `_meta` parents the server's span; the server's `--log-format json` lines
    parse, and one written inside a span names that exported span."""
    receiver = OtlpReceiver()
    server_err, client_err = bytearray(), bytearray()
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(receiver.serve)
        otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "60000"}  # all at exit
        server = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_server", "--relay", deployment.relay, "--data-dir", str(deployment.data_dir),
             "--log-level", "DEBUG", "--log-format", "json"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_env_without_otel(**otel, OTEL_SERVICE_NAME="test-oubliette-server"),
        )
        nursery.start_soon(_drain, server.stderr, server_err)
        caller = HandMcp(server)
        with trio.fail_after(30):
            await caller.send(json.loads(CALLER_LINES.splitlines()[0]))
            await caller.response(1)
            await caller.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            await caller.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {"_meta": {"traceparent": PARENT}}})
            await caller.response(2)

            client = await trio.lowlevel.open_process(
                [PYTHON, "-m", "oubliette_client", "--log-format", "json"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=_env_without_otel(**otel, **deployment.client_env("box1", session="claude:s1"),
                                      OTEL_RESOURCE_ATTRIBUTES="service.name=test-oubliette-client,deployment.environment=test"),
            )
            nursery.start_soon(_drain, client.stderr, client_err)
            agent = HandMcp(client)
            await agent.send(json.loads(CALLER_LINES.splitlines()[0]))
            await agent.response(1)
            await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            await agent.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "no_such_tool", "arguments": {}}})
            assert (await agent.response(2))["result"]["isError"] is True
            await client.stdin.aclose()
            assert await client.wait() == 0, client_err.decode()

            await server.stdin.aclose()
            assert await server.wait() == 0, server_err.decode()
        nursery.cancel_scope.cancel()

    assert {path for path, _ in receiver.exports} == {"/v1/traces"}
    spans = receiver.spans_by_service()
    assert {"test-oubliette-server", "test-oubliette-client"} <= set(spans), (spans.keys(), server_err.decode()[-2000:])
    server_spans = {span.name: span for span in spans["test-oubliette-server"]}
    assert {"initialize", "tools/list"} <= set(server_spans), server_spans.keys()
    assert server_spans["tools/list"].trace_id.hex() == TRACE_ID  # the caller's traceparent, from _meta
    assert "tools/call no_such_tool" in {span.name for span in spans["test-oubliette-client"]}

    # Every log line is JSON; the ready line (`oubliette-server ready {...}`) is the program's own.
    lines = [json.loads(line) for line in server_err.decode().splitlines() if not line.startswith("oubliette-server ready ")]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    in_span = [line for line in lines if "trace_id" in line]
    assert in_span, "no line was written inside a span"
    exported = {(span.trace_id.hex(), span.span_id.hex()) for span in spans["test-oubliette-server"]}
    assert all((line["trace_id"], line["span_id"]) in exported for line in in_span), in_span
    access = [line for line in lines if line["logger"] == "oubliette.access"]
    assert [line["event"] for line in access] == ["connected", "closed"], access
    assert access[0]["role"] == "client" and access[0]["instance"] == "box1" and access[0]["session"] == "claude:s1"
    assert all(json.loads(line) for line in client_err.decode().splitlines())
    assert deployment.token("box1") not in server_err.decode()


def test_export_docs_name_every_variable() -> None:
    """docs/OBSERVABILITY.md says how to export: each variable the code reads is documented there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "OBSERVABILITY.md").read_text()
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_EXPORTER",
                 "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED", "pip install -e '.[otel]'"):
        assert name in text, name
