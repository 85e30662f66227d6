"""CPU of the spans one relayed call makes, in one process, tracing off and on.

    python bench/bench_trace_spans.py [--calls N] [--rounds R]

bench/bench_relay.py measures the whole call with the real programs, where a tracing run's extra
CPU (~0.2–0.8 ms per call, docs/OBSERVABILITY.md) is hard to tell from a shared machine's noise.
This script runs only the tracing work of one relayed call, as both programs do it, N times in a
row and reports the CPU µs per call (`time.process_time`: every thread of the process, so the
batch span processor's export thread is counted):

- oubliette-client: the fast path's `tools/call {tool}` span under the agent's `_meta`
  (`fast_call_span`), and the `_meta` the relay request sends: that span's context (`current_meta`);
- oubliette-server: the relay request's span under that `_meta` (`traced_relay_handler`), the
  `_meta` for the caller's pending entry (`current_meta`), and the caller's
  `caller_tool_response` on the fast path under the `_meta` it was given (`fast_call_span`).

Four modes, alternating round by round so that load drifting hits all alike: `off` (no SDK: the
path the programs take without `OTEL_*`), `make` (the SDK set up with an exporter that drops
every batch: making and ending spans), `export` (the SDK exporting over OTLP/HTTP to
bench/otlp_sink.py, started here as a process of its own, with the programs' setup,
oubliette_runtime/telemetry.py), and `sdk` (the SDK's floor: the same three spans, names, kinds,
attributes and parents, made straight through the OpenTelemetry API and exported as `export`
does, with none of the programs' code: no `_meta` read or written, no relay params parsed).
`export − off` is what tracing costs the programs per call; `sdk` is the part of it that is the
SDK's own work, which no change to the programs can remove while every span is exported.
Each mode runs in a fresh process (the provider is set once per process).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = ("off", "make", "export", "sdk")


def one_call(trace_spans: Any, parse_params: Any, connection: Any) -> None:
    """The tracing work of one relayed call in both programs, in the order they do it."""
    agent_meta = {"progressToken": 7, "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    # oubliette-client: the agent's tools/call on the fast path, then the relay request
    with trace_spans.fast_call_span("bench_echo", 12, agent_meta) as ended:
        relay_meta = trace_spans.current_meta()
        ended({"content": [], "isError": False})
    # oubliette-server: the relay request's span, the caller's pending entry, the caller's answer
    params = parse_params("caller_tool", {"tool": "echo", "arguments": {"text": "x"},
                                           **({"_meta": relay_meta} if relay_meta else {})})
    handed: list[Any] = []

    async def handler(connection: Any, got: Any) -> None:
        handed.append(trace_spans.current_meta())

    coroutine = trace_spans.traced_relay_handler("caller_tool", handler)(connection, params)
    try:
        coroutine.send(None)
    except StopIteration:
        pass
    answer_meta = dict(handed[0] or {})
    with trace_spans.fast_call_span("caller_tool_response", 13, answer_meta) as ended:
        ended({"content": [], "isError": False})


def sdk_call(tracer: Any, trace: Any, agent_context: Any) -> None:
    """The three spans of one relayed call (client, server, the caller's answer), each under the
    one before as in the programs, made and ended with the API alone: the SDK's share of
    `one_call` with tracing on."""
    kind = trace.SpanKind.SERVER
    client = tracer.start_span("tools/call bench_echo", context=agent_context, kind=kind, attributes={
        "mcp.method.name": "tools/call", "jsonrpc.request.id": "12",
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "bench_echo"})
    server = tracer.start_span("tools/call echo", context=trace.set_span_in_context(client), kind=kind, attributes={
        "mcp.method.name": "tools/call", "gen_ai.tool.name": "echo", "gen_ai.operation.name": "execute_tool",
        "mcp.session.id": "mcp:bench-s1", "oubliette.relay.method": "caller_tool", "oubliette.instance": "bench"})
    answer = tracer.start_span("tools/call caller_tool_response", context=trace.set_span_in_context(server),
                               kind=kind, attributes={
                                   "mcp.method.name": "tools/call", "jsonrpc.request.id": "13",
                                   "gen_ai.operation.name": "execute_tool",
                                   "gen_ai.tool.name": "caller_tool_response"})
    answer.end()
    server.end()
    client.end()


class _Connection:
    session_key = "mcp:bench-s1"
    instance = "bench"


def run_mode(mode: str, calls: int, endpoint: str) -> dict[str, float]:
    """In this (fresh) process: set tracing up as `mode` says, run `calls` calls, report CPU µs per call."""
    if mode in ("export", "sdk"):
        os.environ.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "bench"})
        from oubliette_runtime import telemetry

        assert telemetry.configure_tracing("bench")
    elif mode == "make":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        class Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(Drop()))
        trace.set_tracer_provider(provider)
        from oubliette_runtime import telemetry

        telemetry._provider = provider
    from oubliette_runtime import telemetry, trace_spans
    from protocol import parse_params

    if mode == "sdk":
        from opentelemetry import trace

        tracer = trace.get_tracer("oubliette")
        agent_context = telemetry.extract({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})

        def call() -> None:
            sdk_call(tracer, trace, agent_context)
    else:
        connection = _Connection()

        def call() -> None:
            one_call(trace_spans, parse_params, connection)
    for _ in range(min(calls, 500)):  # warm-up: imports, caches
        call()
    if telemetry._provider is not None:
        telemetry._provider.force_flush()
    started, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    if telemetry._provider is not None:
        telemetry._provider.force_flush()  # the export of these calls' spans is counted
    return {"cpu_us": (time.process_time() - started) / calls * 1e6, "wall_us": (time.perf_counter() - wall) / calls * 1e6}


def main() -> int:
    """Alternate the modes for `--rounds` rounds, each in a fresh process; print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.calls, args.endpoint)))
        return 0
    sink = subprocess.Popen([sys.executable, str(HERE / "otlp_sink.py"), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sink.stderr is not None
        endpoint = sink.stderr.readline().split("listening on ", 1)[1].split()[0]
        results: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--mode", mode, "--calls", str(args.calls),
                                      "--endpoint", endpoint], check=True, capture_output=True, text=True)
                figures = json.loads(out.stdout.strip().splitlines()[-1])
                results[mode].append(figures["cpu_us"])
                print(f"round {round_ + 1} {mode:<6} {figures['cpu_us']:8.1f} µs CPU per call", file=sys.stderr, flush=True)
    finally:
        sink.terminate()
        summary, _ = sink.communicate(timeout=30)
    print(f"\ntracing work of one relayed call (client + server), {args.calls} calls, {args.rounds} rounds; "
          f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for mode in MODES:
        print(f"  {mode:<6} median {statistics.median(results[mode]):8.1f} µs CPU per call  "
              f"({', '.join(f'{x:.1f}' for x in results[mode])})")
    cost = statistics.median(results["export"]) - statistics.median(results["off"])
    floor = statistics.median(results["sdk"])
    print(f"  tracing's cost (export - off) {cost:.1f} µs per call; the SDK's own work (sdk) {floor:.1f} µs, "
          f"{floor / cost * 100:.0f} % of it")
    print("  collector received: " + "; ".join(summary.strip().splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
