"""protocol/fast_accept.py: an acceptor never passes a value its validator refuses, and the
relay's own messages do take the fast path (else the fast path's gain is silently gone).

The property is checked with generated schemas (the subset the module reads, plus keywords it
must refuse to vouch for) and values generated from those schemas, some valid and some a
little off, against three validators: jsonschema's 2020-12, the protocol's (an integer is not
1.0) and the server's (a `pattern`'s `$` is the end of the string, as in ECMA-262).
"""

from __future__ import annotations

import collections
import gc
import json
import re
import weakref
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oubliette_server.doors.caller_api import schemas as caller_schemas
from oubliette_server.core.ids import strict_validator
from protocol import schema_check
from protocol.fast_accept import compile_accept
from protocol.schema_check import certainly_valid, compile_schema, first_problem, protocol_validator
from protocol.schemas import SCHEMAS, validate_params, validator_for

VALIDATORS = {
    "2020-12": lambda schema: jsonschema.Draft202012Validator(schema),
    "protocol": protocol_validator,
    "server": strict_validator,
}

# -- generated schemas -------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "id", "name", "x-y", ""])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.0, 1.5, -2.5]), st.sampled_from(["", "a", "ab", "1"])
)
TYPE_NAMES = st.sampled_from(["object", "array", "string", "boolean", "null", "integer", "number"])
PATTERNS = st.sampled_from(["^a", "a$", "^[a-z]+$", "b", "^$", "^[0-9]{1,2}$"])
# Keywords the acceptor does not read: their subschemas must never be vouched for.
UNREAD = st.sampled_from([
    {"not": {"type": "string"}}, {"format": "email"}, {"$ref": "#"}, {"multipleOf": 2},
    {"patternProperties": {"^a": {"type": "integer"}}}, {"uniqueItems": True}, {"exclusiveMinimum": True},
    {"if": {"type": "string"}, "then": {"minLength": 2}}, {"dependentRequired": {"a": ["b"]}}, {"x-custom": 1},
    {"items": [{"type": "string"}]}, {"prefixItems": [{"type": "integer"}]}, {"contains": {"type": "null"}},
])


def _leaf() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just({}), st.booleans(),
        st.builds(lambda t: {"type": t}, st.one_of(TYPE_NAMES, st.lists(TYPE_NAMES, min_size=1, max_size=3, unique=True))),
        st.builds(lambda v: {"enum": v}, st.lists(SCALARS, min_size=1, max_size=4)),
        st.builds(lambda v: {"const": v}, SCALARS),
        st.builds(lambda n: {"type": "string", "minLength": n}, st.integers(0, 3)),
        st.builds(lambda n: {"maxLength": n}, st.integers(0, 3)),
        st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
        st.builds(lambda p: {"pattern": p}, PATTERNS),
        st.builds(lambda k, n: {k: n}, st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
                  st.sampled_from([0, 1, -1, 0.5, 2.0])),
        UNREAD,
        st.builds(lambda d: {"description": "a note", **d}, st.just({"type": "integer"})),
    )


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(
            lambda props, req, extra, counts: {
                "type": "object", "properties": props, "required": req, **extra, **counts,
            },
            st.dictionaries(NAMES, children, max_size=3),
            st.lists(NAMES, max_size=2, unique=True),
            st.one_of(st.just({}), st.builds(lambda a: {"additionalProperties": a}, st.one_of(st.booleans(), children))),
            st.one_of(st.just({}), st.builds(lambda k, n: {k: n}, st.sampled_from(["minProperties", "maxProperties"]),
                                              st.integers(0, 2))),
        ),
        st.builds(lambda p: {"properties": p}, st.dictionaries(NAMES, children, max_size=2)),
        st.builds(lambda i, extra: {"type": "array", "items": i, **extra}, children,
                  st.one_of(st.just({}), st.builds(lambda k, n: {k: n}, st.sampled_from(["minItems", "maxItems"]),
                                                    st.integers(0, 2)))),
        st.builds(lambda k, subs: {k: subs}, st.sampled_from(["anyOf", "allOf", "oneOf"]),
                  st.lists(children, min_size=1, max_size=3)),
    )


SCHEMA_STRATEGY = st.recursive(_leaf(), _extend, max_leaves=8)

# -- generated values: mostly shaped by the schema, some anything ------------------------------

JSON_ANY = st.recursive(
    SCALARS | st.text(max_size=3) | st.sampled_from(["a\n", "abc", "12", "b", 2.0, True, 10**20]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(NAMES, children, max_size=3),
    max_leaves=6,
)


@st.composite
def value_for(draw: st.DrawFn, schema: Any, depth: int = 0) -> Any:
    """A value near `schema`'s shape: the one that would pass if all goes well, or a nudge off."""
    if depth > 4 or not isinstance(schema, dict) or draw(st.integers(0, 9)) == 0:
        return draw(JSON_ANY)
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema and isinstance(schema[key], list) and schema[key]:
            return draw(value_for(draw(st.sampled_from(schema[key])), depth + 1))
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if "const" in schema:
        return schema["const"]
    if "pattern" in schema:
        return draw(st.one_of(st.from_regex(schema["pattern"]), st.sampled_from(["a", "a\n", "ab\n", "12\n", ""])))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = draw(st.sampled_from(kind))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        out = {}
        for name, sub in props.items():
            if draw(st.booleans()) or name in schema.get("required", []):
                out[name] = draw(value_for(sub, depth + 1))
        if draw(st.integers(0, 3)) == 0:
            out[draw(NAMES)] = draw(JSON_ANY)
        return out
    if kind == "array" or "items" in schema:
        return [draw(value_for(schema.get("items", {}), depth + 1)) for _ in range(draw(st.integers(0, 3)))]
    if kind == "string" or "minLength" in schema or "maxLength" in schema:
        return draw(st.text(max_size=4))
    if kind in ("integer", "number") or any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum")):
        return draw(st.one_of(st.integers(-3, 3), st.floats(-3, 3, allow_nan=False), st.sampled_from([1.0, True])))
    if kind == "boolean":
        return draw(st.booleans())
    if kind == "null":
        return None
    return draw(JSON_ANY)


@st.composite
def schema_and_values(draw: st.DrawFn) -> tuple[Any, list[Any]]:
    schema = draw(SCHEMA_STRATEGY)
    return schema, [draw(value_for(schema)) for _ in range(6)]


def _assert_never_wrong(kind: str, schema: Any, values: list[Any]) -> None:
    try:
        validator = VALIDATORS[kind](schema)
    except jsonschema.SchemaError:
        return  # not a schema: nothing is ever checked against it
    for value in values:
        if certainly_valid(validator, value):
            assert validator.is_valid(value), (kind, schema, value)


@pytest.mark.parametrize("kind", sorted(VALIDATORS))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=schema_and_values())
def test_an_acceptor_never_passes_a_value_its_validator_refuses(kind: str, case: tuple[Any, list[Any]]) -> None:
    _assert_never_wrong(kind, *case)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SCHEMAS)), data=st.data())
def test_for_the_protocols_own_schemas_too(name: str, data: st.DataObject) -> None:
    schema = SCHEMAS[name]
    values = [data.draw(value_for(schema)) for _ in range(8)]
    validator = validator_for(name)
    for value in values:
        if certainly_valid(validator, value):
            assert validator.is_valid(value), (name, value)


# -- the relay's messages take the fast path ---------------------------------------------------

CALLER_TOOL_PARAMS = {"tool": "bench_echo", "arguments": {"text": "hello"}, "caller_id": "bench", "progress_ref": "p-1"}
CALLER_TOOL_RESPONSE_ARGS = [
    {"session_id": "mcp:s1", "request_id": "r-1", "result": {"echo": "hello"}},
    {"session_id": "mcp:s1", "request_id": "r-1", "error": "it broke", "wait": True},
    {"session_id": "mcp:s1", "request_id": "r-1", "result": [1, {"deep": None}], "wait": 2.5},
]


def test_the_hot_messages_are_certainly_valid() -> None:
    assert certainly_valid(validator_for("caller_tool"), CALLER_TOOL_PARAMS)
    caller_validator = strict_validator(caller_schemas.CALLER_TOOL_RESPONSE)
    for args in CALLER_TOOL_RESPONSE_ARGS:
        assert certainly_valid(caller_validator, args), args
        assert caller_validator.is_valid(args)


def test_a_refused_value_gets_the_same_error_as_without_the_fast_path() -> None:
    validator = strict_validator(caller_schemas.CALLER_TOOL_RESPONSE)
    bad = {"session_id": "mcp:s1", "request_id": "", "wait": -1}
    assert not certainly_valid(validator, bad)
    error = jsonschema.exceptions.best_match(validator.iter_errors(bad))
    assert first_problem(validator, bad, "invalid arguments") == f"invalid arguments at {'/'.join(map(str, error.absolute_path))}: {error.message}"
    with pytest.raises(Exception, match="invalid caller_tool params"):
        validate_params("caller_tool", {"tool": ""})


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "integer"}, 1.0),  # an integer to jsonschema's default checker, not to ours: not vouched for
        ({"type": "number"}, True),  # a bool is not a number
        ({"enum": [1]}, True),  # True == 1 in Python, not in JSON
        ({"const": 1}, 1.0),
        ({"enum": [{"a": 1}]}, {"a": True}),  # equal dicts in Python, not in JSON: containers are never matched
        ({"required": ["a"]}, collections.OrderedDict()),  # jsonschema sees an object missing "a"
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 5),  # both branches match: invalid
        ({"oneOf": [{"minimum": 0}, {"maximum": 10}]}, 5),  # branches without types: never certain
        ({"$ref": "#/$defs/x", "$defs": {"x": {}}}, 1),
        ({"type": "object"}, collections.OrderedDict()),  # not exactly a dict
        ({"type": "string", "format": "email"}, "x"),
        ({"type": "string", "pattern": "^a$"}, "a\n"),  # the server's `$` ends the string
    ],
)
def test_corners_are_left_to_the_validator(schema: dict[str, Any], value: Any) -> None:
    assert not certainly_valid(strict_validator(schema), value)


def test_a_schema_it_cannot_read_is_never_certain() -> None:
    rule = lambda pattern: lambda text: True  # noqa: E731
    for schema in (None, [], "string", {"type": "any"}, {"required": "a"}, {"minLength": -1}, {"enum": "ab"},
                   {"items": {"$ref": "#"}}, {"type": "string", "description": "d", "x-vendor": True}):
        assert compile_accept(schema, rule)(json.loads('"a"')) is False, schema
    assert compile_accept(True, rule)(object()) is True
    assert compile_accept({}, rule)(None) is True


def test_the_pattern_is_the_validators_own() -> None:
    schema = {"type": "string", "pattern": "^a$"}
    assert certainly_valid(compile_schema(schema), "a")
    assert not certainly_valid(compile_schema(schema), "b")
    # Python's re.search lets "$" match before a final newline; jsonschema's default follows it,
    # and so does its acceptor. The server's validator does not, and neither does its acceptor.
    assert certainly_valid(compile_schema(schema), "a\n") == compile_schema(schema).is_valid("a\n")
    assert not certainly_valid(strict_validator(schema), "a\n")


def test_a_schema_that_breaks_at_check_time_breaks_as_it_did_without_the_fast_path() -> None:
    # Not a regex: compile_schema refuses it (the metaschema checks the format), a validator made
    # without that check meets it only when it validates.
    validator = jsonschema.Draft202012Validator({"type": "string", "pattern": "("})
    with pytest.raises(re.error):
        validator.is_valid("x")
    assert not certainly_valid(validator, "x")
    with pytest.raises(re.error):
        first_problem(validator, "x")


def test_the_acceptor_cache_is_bounded_and_keyed_by_the_validator_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema_check, "_ACCEPTORS", {})
    monkeypatch.setattr(schema_check, "_ACCEPTORS_MAX", 3)
    validators = [jsonschema.Draft202012Validator({"type": "string", "maxLength": n}) for n in range(5)]
    for n, validator in enumerate(validators):
        assert certainly_valid(validator, "x" * n)
        assert not certainly_valid(validator, "x" * (n + 1))
    assert len(schema_check._ACCEPTORS) == 3
    assert [entry[0]() for entry in schema_check._ACCEPTORS.values()] == validators[2:]


def test_the_acceptor_cache_keeps_no_validator_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema_check, "_ACCEPTORS", {})
    validator = jsonschema.Draft202012Validator({"type": "string", "maxLength": 1})
    assert certainly_valid(validator, "x")
    gone = weakref.ref(validator)
    del validator
    gc.collect()
    assert gone() is None
    # A later validator that gets a freed one's id is not taken for it.
    ids = set()
    for n in range(200):
        other = jsonschema.Draft202012Validator({"type": "string", "maxLength": n})
        assert certainly_valid(other, "x" * n)
        assert not certainly_valid(other, "x" * (n + 1))
        ids.add(id(other))
    assert len(ids) < 200  # ids were reused, so the checks above met a reused one
