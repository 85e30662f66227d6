"""protocol/otlp_encoding.py writes the OTLP request the exporter's own encoder would: both are
decoded with opentelemetry-proto and compared, for spans with every feature a span can have."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from protocol import otlp_encoding, telemetry
from protocol.otlp_encoding import EncodedRequest, encode_request

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _spans() -> list[Any]:
    """Finished spans of two resources and three scopes: remote and local parents, roots, every
    kind, attributes of every type, events, links, each status, a tracestate."""
    exporter = InMemorySpanExporter()
    spans = []
    for resource in (Resource.create({"service.name": "one", "n": 3}), Resource({"service.name": "two"}, "https://schema")):
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        ours = provider.get_tracer("oubliette", "1.2", schema_url="https://scope")
        other = provider.get_tracer("other", attributes={"scope.attr": "x"})
        remote = telemetry.extract({"traceparent": PARENT, "tracestate": "vendor=abc,x=y"})
        with ours.start_as_current_span("tools/call echo", context=remote, kind=SpanKind.SERVER, attributes={
            "s": "text", "empty": "", "i": -5, "big": 2**40, "f": 1.5, "t": True, "no": False,
            "strings": ["a", "b"], "ints": [1, 2], "floats": [0.5], "bools": [True],
        }) as span:
            span.add_event("event", {"k": "v"})
            span.add_event("bare")
            with other.start_as_current_span("relay", kind=SpanKind.CLIENT, links=[Link(span.get_span_context(), {"l": 1})]) as child:
                child.set_status(Status(StatusCode.ERROR, "boom"))
            with ours.start_as_current_span("ok", kind=SpanKind.PRODUCER) as child:
                child.set_status(Status(StatusCode.OK))
            with ours.start_as_current_span("plain error", kind=SpanKind.CONSUMER) as child:
                child.set_status(StatusCode.ERROR)
        with ours.start_as_current_span("a root of its own"):
            pass
        spans += exporter.get_finished_spans()
        exporter.clear()
    return spans


def test_the_bytes_decode_to_what_the_exporters_encoder_builds() -> None:
    spans = _spans()
    ours = ExportTraceServiceRequest.FromString(encode_request(spans))
    theirs = ExportTraceServiceRequest.FromString(encode_spans(spans).SerializePartialToString())
    assert ours == theirs
    assert [len(rs.scope_spans) for rs in ours.resource_spans] == [2, 2]
    assert encode_request([]) == b""


def test_encoding_twice_gives_the_same_bytes() -> None:
    """The caches (resource, scope, string attributes) change nothing in what is written."""
    spans = _spans()
    assert encode_request(spans) == encode_request(spans) == encode_request(list(spans))


def test_the_http_exporter_encodes_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_in_http_exporter` swaps the encoder the OTLP/HTTP exporter looks up at each export;
    what it serializes is the request's bytes."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    monkeypatch.setattr(trace_exporter, "encode_spans", trace_exporter.encode_spans)
    assert otlp_encoding.use_in_http_exporter()
    spans = _spans()
    encoded = trace_exporter.encode_spans(spans)
    assert isinstance(encoded, EncodedRequest)
    assert encoded.SerializePartialToString() == encoded.SerializeToString() == encode_request(spans)
