"""A local OTLP/HTTP trace collector for measurements: receives, counts, and renders one trace.

    python bench/otlp_sink.py [--port 4318] [--tree NAME [--nth N] [--mermaid]]

It listens on 127.0.0.1:PORT, decodes every `POST /v1/traces` (protobuf, gzip or not) with
opentelemetry-proto and answers 200, as a collector would. On Ctrl-C or SIGTERM it prints how
many spans each service sent and, with `--tree NAME`, the trace whose span named like NAME took
the median time (with `--nth N`: the Nth such span received) as a tree of span names with
durations (docs/OBSERVABILITY.md, "Traces: one call across the boundary"), and with `--mermaid`
the same trace as a Mermaid gantt chart, a span waterfall that GitHub renders (docs/OBSERVABILITY.md,
"One relayed call as a picture"). Point the programs at it with
`OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT`. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import signal
import sys
from typing import Any

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


class OtlpReceiver:
    """A tiny OTLP/HTTP trace receiver on loopback: it decodes each export and answers 200 (the
    tests' receiver too, tests/runtime/test_telemetry.py)."""

    def __init__(self) -> None:
        self.exports: list[tuple[str, ExportTraceServiceRequest]] = []

    async def serve(self, port: int = 0, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1:`port` (0: a free one); started: its base URL."""
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                headers = {name.strip().lower(): value.strip() for name, value in (h.split(":", 1) for h in header_lines)}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                body, buffer = buffer[:length], buffer[length:]
                if headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                self.exports.append((request_line.split(" ")[1], export))
                answer = ExportTraceServiceResponse().SerializeToString()
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                    + f"Content-Length: {len(answer)}\r\n\r\n".encode() + answer)

    def spans_by_service(self) -> dict[str, list[Any]]:
        """Every exported span, under its resource's `service.name`."""
        found: dict[str, list[Any]] = {}
        for _path, export in self.exports:
            for resource_spans in export.resource_spans:
                attributes = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                spans = [span for scope in resource_spans.scope_spans for span in scope.spans]
                found.setdefault(attributes.get("service.name", ""), []).extend(spans)
        return found

    @property
    def spans(self) -> list[tuple[str, Any]]:
        """Every span received, with its service's name."""
        return [(service, span) for service, spans in self.spans_by_service().items() for span in spans]

    def summary(self) -> str:
        """Spans received by service."""
        counts = collections.Counter(service for service, _ in self.spans)
        return "\n".join(f"{service}: {count} spans" for service, count in sorted(counts.items()))

    def _chosen(self, name: str, nth: int | None) -> tuple[str, list[tuple[int, str, Any]]] | None:
        """The trace `tree` and `mermaid` show: (its heading, its spans depth-first as (depth,
        service, span), children in start order), or None when no span is named like `name`."""
        received = [(span.end_time_unix_nano - span.start_time_unix_nano, span.trace_id)
                    for _, span in self.spans if name in span.name]
        if not received:
            return None
        matching = sorted(received)
        chosen = matching[len(matching) // 2][1] if nth is None else received[min(nth, len(received) - 1)][1]
        trace = [(service, span) for service, span in self.spans if span.trace_id == chosen]
        ids = {span.span_id for _, span in trace}
        children: dict[bytes, list[tuple[str, Any]]] = collections.defaultdict(list)
        for service, span in trace:
            children[span.parent_span_id if span.parent_span_id in ids else b""].append((service, span))
        ordered: list[tuple[int, str, Any]] = []

        def walk(parent: bytes, depth: int) -> None:
            for service, span in sorted(children[parent], key=lambda item: item[1].start_time_unix_nano):
                ordered.append((depth, service, span))
                walk(span.span_id, depth + 1)

        walk(b"", 1)
        return f"trace {chosen.hex()} ({'the median' if nth is None else f'number {nth}'} of {len(matching)})", ordered

    def tree(self, name: str, nth: int | None = None) -> str:
        """The trace whose span named like `name` took the median time of all such spans (or
        the `nth` such span received, from 0), one span a line, children indented under their
        parent, with each span's service, kind and duration."""
        found = self._chosen(name, nth)
        if found is None:
            return f"(no span named like {name!r} received)"
        heading, ordered = found
        lines = [heading]
        for depth, service, span in ordered:
            took = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
            lines.append(f"{'  ' * depth}{span.name}  [{service}, {KINDS.get(span.kind, '?')}] {took:.2f} ms")
        return "\n".join(lines)

    def mermaid(self, name: str, nth: int | None = None) -> str:
        """The trace `tree` shows, as a Mermaid gantt chart: one bar per span from its start to
        its end, a section per service in the order the trace reaches them. Mermaid's gantt
        counts whole milliseconds, so each microsecond is written as one of its milliseconds and
        the axis prints seconds.milliseconds as `ms.µs`: the bars and the axis read in ms."""
        found = self._chosen(name, nth)
        if found is None:
            return f"%% no span named like {name!r} received"
        heading, ordered = found
        origin = min(span.start_time_unix_nano for _, _, span in ordered)
        lines = ["gantt", f"    title {heading.split(' (')[0]}, one relayed call span by span",
                 "    dateFormat x", "    axisFormat %S.%L ms", "    todayMarker off"]
        for service in dict.fromkeys(service for _, service, _ in ordered):
            lines.append(f"    section {service}")
            for _, where, span in ordered:
                if where != service:
                    continue
                start = (span.start_time_unix_nano - origin) // 1000
                end = max((span.end_time_unix_nano - origin) // 1000, start + 1)
                took = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
                label = f"{span.name} ({KINDS.get(span.kind, '?')}) {took:.2f} ms".replace(":", " ")
                lines.append(f"    {label} :{start}, {end}")
        return "\n".join(lines)


async def serve(sink: OtlpReceiver, port: int) -> None:
    """Listen on 127.0.0.1:`port` until SIGINT or SIGTERM (a background job ignores SIGINT)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(sink.serve, port)
            print(f"otlp sink listening on {url}", file=sys.stderr, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main() -> None:
    """Run until Ctrl-C (or SIGTERM), then print what arrived."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--tree", metavar="NAME", help="render the median trace with a span named like NAME")
    parser.add_argument("--nth", type=int, help="with --tree: the trace of the NTH such span received (from 0), not the median")
    parser.add_argument("--mermaid", action="store_true", help="with --tree: also print that trace as a Mermaid gantt chart")
    args = parser.parse_args()
    sink = OtlpReceiver()
    trio.run(serve, sink, args.port)
    print(sink.summary())
    if args.tree:
        print(sink.tree(args.tree, args.nth))
        if args.mermaid:
            print(sink.mermaid(args.tree, args.nth))


if __name__ == "__main__":
    main()
