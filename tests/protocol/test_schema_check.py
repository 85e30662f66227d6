"""Once per schema (protocol/schema_check.py): a tool schema declared again is not compiled again."""

from __future__ import annotations

from protocol.schema_check import _compile_text, compile_schema


def test_same_schema_is_compiled_once() -> None:
    """Declaring the same tool schema twice (any key order) reuses one validator: one metaschema check."""
    schema = {"type": "object", "properties": {"perf_once_marker": {"type": "string"}}, "required": ["perf_once_marker"]}
    same = {"required": ["perf_once_marker"], "properties": {"perf_once_marker": {"type": "string"}}, "type": "object"}
    misses = _compile_text.cache_info().misses
    first = compile_schema(schema)
    assert _compile_text.cache_info().misses == misses + 1
    assert compile_schema(same) is first
    assert _compile_text.cache_info().misses == misses + 1
