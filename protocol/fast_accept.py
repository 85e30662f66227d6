"""A fast, conservative "certainly valid" test for JSON Schemas, in front of `jsonschema`.

Checking a small message with `jsonschema` costs 25-35 µs, nearly all of it the library's
machinery (a new validator object per property it descends into), and the relay checks
several messages on every call: the `caller_tool` params, the caller's `caller_tool_response`
arguments, the agent's arguments against the tool's input schema. Almost every
value is valid, so `compile_accept` turns a schema into a plain function that answers one
question quickly: is this value *certainly* valid?

- `True` means valid: the caller may skip `jsonschema`.
- `False` means "not shown valid", not "invalid": the caller runs the full check, which
  gives the verdict and the error message. So a refused value, and any schema this module
  does not understand, is checked exactly as before.

The one rule that makes this safe: **an acceptor never returns True for a value the full
validator rejects** (tests/protocol/test_fast_accept.py checks it with generated schemas and values).
So it understands only a subset and is stricter than JSON Schema wherever that is simpler:
- keywords: `type`, `enum`, `const`, `properties`, `required`, `additionalProperties`,
  `minProperties`, `maxProperties`, `items` (one schema), `minItems`, `maxItems`,
  `minLength`, `maxLength`, `pattern` (through the validator's own rule, so ECMA-262 anchoring
  stays as the server defines it), `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`
  (numbers), `allOf`, `anyOf`, and `oneOf` whose branches differ by type; annotations
  (`title`, `description`, `default`, `examples`, `$comment`, `$schema`, `deprecated`,
  `readOnly`, `writeOnly`) are ignored. Any other keyword (`$ref`, `format`, `not`,
  `patternProperties`, `if`, a draft-4 boolean `exclusiveMinimum`…) makes its subschema
  "never certain".
- types are exact Python classes of decoded JSON: an `integer` is an `int` (not a `bool`, not
  `1.0`), a `number` an `int` or `float`, an `object` a `dict`, an `array` a `list`; `enum` and
  `const` match only a scalar of the same class.

Pure functions, no I/O; `jsonschema` is not imported here.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Acceptor", "PatternRule", "compile_accept"]

#: `acceptor(value) -> bool`: True only when `value` is certainly valid.
Acceptor = Callable[[Any], bool]
#: `rule(pattern) -> test`: how the validator matches `pattern` (test(text) -> matched).
PatternRule = Callable[[str], Callable[[str], bool]]

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "deprecated", "readOnly", "writeOnly"}
)
_NUMBER_CLASSES = (int, float)
# The JSON types jsonschema may see in a value of each decoded class (a float like 2.0 is an
# "integer" to the default type checker, and an int is also a "number").
_JSON_TYPES: dict[type, frozenset[str]] = {
    dict: frozenset({"object"}),
    list: frozenset({"array"}),
    str: frozenset({"string"}),
    bool: frozenset({"boolean"}),
    type(None): frozenset({"null"}),
    int: frozenset({"integer", "number"}),
    float: frozenset({"integer", "number"}),
}
# The classes this module accepts for each type name (exact classes: see the module docstring).
_CLASSES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
    "integer": (int,),
    "number": (int, float),
}


def _never(value: Any) -> bool:
    return False


def _always(value: Any) -> bool:
    return True


class _Unsupported(Exception):
    """A schema (or part) this module does not understand: it is never certain."""


def compile_accept(schema: Any, pattern_rule: PatternRule) -> Acceptor:
    """The acceptor of `schema` (see the module docstring); never raises: a schema it cannot
    read, or one that is not a schema at all, gives an acceptor that is never certain."""
    try:
        return _compile(schema, pattern_rule)
    except (_Unsupported, TypeError, ValueError, RecursionError):
        return _never


def _compile(schema: Any, pattern_rule: PatternRule) -> Acceptor:
    if schema is True:
        return _always
    if schema is False or not isinstance(schema, dict):
        raise _Unsupported
    tests: list[Acceptor] = []
    for keyword, arg in schema.items():
        if keyword in _ANNOTATIONS:
            continue
        build = _KEYWORDS.get(keyword)
        if build is None:
            raise _Unsupported
        tests.append(build(arg, schema, pattern_rule))
    if not tests:
        return _always
    if len(tests) == 1:
        return tests[0]
    return lambda value: all(test(value) for test in tests)


def _type(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    names = [arg] if isinstance(arg, str) else arg
    if not isinstance(names, list) or not names or any(name not in _CLASSES for name in names):
        raise _Unsupported
    classes = frozenset(cls for name in names for cls in _CLASSES[name])
    return lambda value: value.__class__ in classes


def _scalar_equal(expected: list[Any]) -> Acceptor:
    allowed = [(e.__class__, e) for e in expected if e.__class__ in (str, int, float, bool, type(None))]
    return lambda value: any(value.__class__ is cls and value == e for cls, e in allowed)


def _enum(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    if not isinstance(arg, list):
        raise _Unsupported
    return _scalar_equal(arg)


def _const(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    return _scalar_equal([arg])


def _only_for(cls: type, test: Callable[[Any], bool]) -> Acceptor:
    """A keyword that applies to one JSON type: a value of exactly `cls` is tested, a value of
    another decoded JSON class passes (the keyword does not apply), any other class (a dict
    subclass, a tuple…) is not certain."""

    def accept(value: Any) -> bool:
        if value.__class__ is cls:
            return test(value)
        return value.__class__ in _JSON_TYPES

    return accept


def _properties(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    if not isinstance(arg, dict):
        raise _Unsupported
    subs = [(name, _compile(sub, pattern_rule)) for name, sub in arg.items()]
    return _only_for(dict, lambda value: all(sub(value[name]) for name, sub in subs if name in value))


def _required(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    if not isinstance(arg, list) or not all(isinstance(name, str) for name in arg):
        raise _Unsupported
    names = tuple(arg)
    return _only_for(dict, lambda value: all(name in value for name in names))


def _additional_properties(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    if "patternProperties" in schema:
        raise _Unsupported
    declared = schema.get("properties", {})
    if not isinstance(declared, dict):
        raise _Unsupported
    known = frozenset(declared)
    if arg is False:
        return _only_for(dict, lambda value: known.issuperset(value))
    sub = _compile(arg, pattern_rule)
    return _only_for(dict, lambda value: all(sub(v) for k, v in value.items() if k not in known))


def _count(cls: type, compare: Callable[[int, int], bool]) -> Callable[[Any, dict[str, Any], PatternRule], Acceptor]:
    def build(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
        if arg.__class__ is not int or arg < 0:
            raise _Unsupported
        return _only_for(cls, lambda value: compare(len(value), arg))

    return build


def _bound(compare: Callable[[Any, Any], bool]) -> Callable[[Any, dict[str, Any], PatternRule], Acceptor]:
    def build(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
        if arg.__class__ not in _NUMBER_CLASSES:  # a draft-4 boolean exclusiveMinimum, or junk
            raise _Unsupported

        def accept(value: Any) -> bool:
            if value.__class__ in _NUMBER_CLASSES:
                return compare(value, arg)
            return value.__class__ in _JSON_TYPES  # not a number: the keyword does not apply

        return accept

    return build


def _items(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    if isinstance(arg, list) or "prefixItems" in schema:  # tuple validation (draft 2019 and older)
        raise _Unsupported
    sub = _compile(arg, pattern_rule)
    return _only_for(list, lambda value: all(sub(item) for item in value))


def _pattern(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    if not isinstance(arg, str):
        raise _Unsupported
    matches = pattern_rule(arg)
    return _only_for(str, matches)


def _all_of(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    subs = _branches(arg, pattern_rule)
    return lambda value: all(sub(value) for sub in subs)


def _any_of(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    subs = _branches(arg, pattern_rule)
    return lambda value: any(sub(value) for sub in subs)


def _one_of(arg: Any, schema: dict[str, Any], pattern_rule: PatternRule) -> Acceptor:
    """Certain only when the value's JSON type leaves one branch: each other branch's `type`
    rejects it, so "exactly one is valid" holds when that one accepts."""
    if not isinstance(arg, list) or not arg:
        raise _Unsupported
    branches: list[tuple[frozenset[str] | None, Acceptor]] = []
    for sub in arg:
        types = sub.get("type") if isinstance(sub, dict) else None
        names = None if types is None else frozenset([types] if isinstance(types, str) else types)
        branches.append((names, _compile(sub, pattern_rule)))

    def accept(value: Any) -> bool:
        seen_as = _JSON_TYPES.get(value.__class__)
        if seen_as is None:
            return False
        candidates = [sub for names, sub in branches if names is None or names & seen_as]
        return len(candidates) == 1 and candidates[0](value)

    return accept


def _branches(arg: Any, pattern_rule: PatternRule) -> list[Acceptor]:
    if not isinstance(arg, list) or not arg:
        raise _Unsupported
    return [_compile(sub, pattern_rule) for sub in arg]


_KEYWORDS: dict[str, Callable[[Any, dict[str, Any], PatternRule], Acceptor]] = {
    "type": _type,
    "enum": _enum,
    "const": _const,
    "properties": _properties,
    "required": _required,
    "additionalProperties": _additional_properties,
    "minProperties": _count(dict, lambda n, limit: n >= limit),
    "maxProperties": _count(dict, lambda n, limit: n <= limit),
    "items": _items,
    "minItems": _count(list, lambda n, limit: n >= limit),
    "maxItems": _count(list, lambda n, limit: n <= limit),
    "minLength": _count(str, lambda n, limit: n >= limit),
    "maxLength": _count(str, lambda n, limit: n <= limit),
    "pattern": _pattern,
    "minimum": _bound(lambda value, limit: value >= limit),
    "maximum": _bound(lambda value, limit: value <= limit),
    "exclusiveMinimum": _bound(lambda value, limit: value > limit),
    "exclusiveMaximum": _bound(lambda value, limit: value < limit),
    "allOf": _all_of,
    "anyOf": _any_of,
    "oneOf": _one_of,
}
