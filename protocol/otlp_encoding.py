"""Finished spans as the bytes of an OTLP `ExportTraceServiceRequest`, written directly.

Why: the OTLP exporters encode a batch by building a protobuf message object per span, per
attribute and per value (opentelemetry-exporter-otlp-proto-common's `encode_spans`), ~31 µs a
span (this module: ~9) — as much as making the span, and once the larger part of what a
relayed call costs with tracing on (docs/OBSERVABILITY.md, "The cost of tracing"). This module
writes the same message in protobuf's wire format straight from the `ReadableSpan`s: the same
fields, the same values (the span flags, the status, `None` as an empty value), so that a
collector decodes exactly what `encode_spans` would have sent (tests/test_otlp_encoding.py
parses both and compares). Resource and scope are encoded once per object, and an attribute
whose value is a string once per key and value.

`encode_request(spans)` returns the bytes; `EncodedRequest` wraps them in what the OTLP/HTTP
exporter calls on `encode_spans`'s result (`SerializePartialToString`, `SerializeToString`), so
telemetry.py can hand the exporter this encoder (`use_in_http_exporter`).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EncodedRequest", "encode_request", "use_in_http_exporter"]

_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack
_SPAN_FLAGS_HAS_IS_REMOTE = 0x100
_SPAN_FLAGS_IS_REMOTE = 0x200
_CACHE_LIMIT = 4096

_string_attributes: dict[tuple[str, str], bytes] = {}
_encoded_once: dict[int, tuple[Any, bytes]] = {}


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return bytes((value,))
    if value < 0:
        value += 1 << 64  # int64 as protobuf writes it: two's complement, ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _string(tag: bytes, value: str | None) -> bytes:
    """A string field, left out when empty (proto3's default)."""
    return _field(tag, value.encode()) if value else b""


def _any_value(value: Any) -> bytes:
    """An `AnyValue`'s fields (as `_encode_value` of the OTLP encoder picks them)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(item)) for item in value))
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join(_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items()))
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    return _string(b"\x0a", key) + _field(b"\x12", _any_value(value))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a `KeyValue` field `tag`; a string attribute's bytes are kept for reuse."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        if type(value) is str:
            encoded = _string_attributes.get((key, value))
            if encoded is None:
                if len(_string_attributes) >= _CACHE_LIMIT:
                    _string_attributes.clear()
                encoded = _string_attributes[(key, value)] = _field(tag, _key_value(key, value))
            parts.append(encoded)
        else:
            parts.append(_field(tag, _key_value(key, value)))
    return b"".join(parts)


def _once(thing: Any, encode: Any) -> bytes:
    """`encode(thing)`, computed once per object (a resource or an instrumentation scope)."""
    cached = _encoded_once.get(id(thing))
    if cached is not None and cached[0] is thing:
        return cached[1]
    if len(_encoded_once) >= _CACHE_LIMIT:
        _encoded_once.clear()
    encoded = encode(thing)
    _encoded_once[id(thing)] = (thing, encoded)
    return encoded


def _resource(resource: Any) -> bytes:
    return _attributes(b"\x0a", resource.attributes)


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    return _string(b"\x0a", scope.name) + _string(b"\x12", scope.version) + _attributes(b"\x1a", scope.attributes)


def _flags(parent: Any) -> int:
    return _SPAN_FLAGS_HAS_IS_REMOTE | (_SPAN_FLAGS_IS_REMOTE if parent is not None and parent.is_remote else 0)


def _span(span: Any) -> bytes:
    context = span.get_span_context()
    parent = span.parent
    parts = [
        b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
        b"\x12\x08", context.span_id.to_bytes(8, "big"),
    ]
    if context.trace_state:
        parts.append(_string(b"\x1a", ",".join(f"{key}={value}" for key, value in context.trace_state.items())))
    if parent:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    parts += (
        _string(b"\x2a", span.name),
        b"\x30", _varint(span.kind.value + 1),  # the SDK's SpanKind counts from 0, OTLP's (unspecified = 0) from 1
        b"\x39", _FIXED64(span.start_time or 0),
        b"\x41", _FIXED64(span.end_time or 0),
        _attributes(b"\x4a", span.attributes),
    )
    if span.dropped_attributes:
        parts += (b"\x50", _varint(span.dropped_attributes))
    for event in span.events:
        parts.append(_field(b"\x5a", b"\x09" + _FIXED64(event.timestamp) + _string(b"\x12", event.name)
                            + _attributes(b"\x1a", event.attributes)
                            + (b"\x20" + _varint(event.dropped_attributes) if event.dropped_attributes else b"")))
    if span.dropped_events:
        parts += (b"\x60", _varint(span.dropped_events))
    for link in span.links:
        parts.append(_field(b"\x6a", b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big")
                            + b"\x12\x08" + link.context.span_id.to_bytes(8, "big")
                            + _attributes(b"\x22", link.attributes)
                            + (b"\x28" + _varint(link.dropped_attributes) if link.dropped_attributes else b"")
                            + b"\x35" + _FIXED32(_flags(link.context))))
    if span.dropped_links:
        parts += (b"\x70", _varint(span.dropped_links))
    status = span.status
    if status is not None:
        code = status.status_code.value
        parts.append(_field(b"\x7a", _string(b"\x12", status.description) + (b"\x18" + _varint(code) if code else b"")))
    parts += (b"\x85\x01", _FIXED32(_flags(parent)))
    return b"".join(parts)


def encode_request(spans: Sequence[Any]) -> bytes:
    """`spans` (the SDK's `ReadableSpan`s) as an OTLP `ExportTraceServiceRequest`, grouped by
    resource and instrumentation scope in the order first seen, as `encode_spans` groups them."""
    grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        scopes = grouped.setdefault(id(resource), (resource, {}))[1]
        scopes.setdefault(id(scope), (scope, []))[1].append(_field(b"\x12", _span(span)))
    out = []
    for resource, scopes in grouped.values():
        scope_spans = b"".join(
            _field(b"\x12", _field(b"\x0a", _once(scope, _scope)) + b"".join(encoded)
                   + _string(b"\x1a", scope.schema_url if scope is not None else None))
            for scope, encoded in scopes.values()
        )
        out.append(_field(b"\x0a", _field(b"\x0a", _once(resource, _resource)) + scope_spans
                          + _string(b"\x1a", resource.schema_url)))
    return b"".join(out)


class EncodedRequest:
    """Bytes from `encode_request`, answering the calls the OTLP/HTTP exporter makes on the
    message `encode_spans` returns."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializePartialToString(self) -> bytes:  # noqa: N802 - protobuf's name
        """The encoded request (what protobuf's message method returns)."""
        return self.data

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        """The encoded request (older exporters call this one)."""
        return self.data


def _encode_spans(spans: Sequence[Any]) -> EncodedRequest:
    return EncodedRequest(encode_request(spans))


def use_in_http_exporter() -> bool:
    """Have the OTLP/HTTP span exporter encode with `encode_request`: its module looks
    `encode_spans` up by name at each export, and only serializes what that returns. False (and
    nothing changed) if that module does not look as expected; the gRPC exporter, which hands
    protobuf messages to grpc, keeps its own encoder."""
    try:
        from opentelemetry.exporter.otlp.proto.http import trace_exporter
    except ImportError:
        return False
    if not callable(getattr(trace_exporter, "encode_spans", None)):
        return False
    trace_exporter.encode_spans = _encode_spans  # type: ignore[attr-defined]
    return True
