"""Checking values against JSON Schemas: the protocol's own, and those that come from outside.

One place for what both programs do with a tool's input or result schema:
compile it once (draft from its `$schema`, 2020-12 by default; an invalid
schema is a clear error) and describe the first problem of a value in one line.
The protocol's own schemas (next to their models in `protocol/`) compile with
`protocol_validator`, which is stricter about integers. This module imports
nothing from the rest of `protocol/` but `errors` and `fast_accept` (which import nothing),
so every model module may use it. Before running a validator, every check asks
`fast_accept` whether the value is certainly valid (25-35 µs → a few µs for the relay's
messages; a value it cannot vouch for is checked as before).

`jsonschema` (with `referencing`, about 30 ms to import) is imported when a schema is
first compiled or a value first checked, not with this module: `oubliette-client`
answers `initialize` before it needs a validator (its cold start).
"""

from __future__ import annotations

import functools
import json
import weakref
from types import ModuleType
from typing import Any, Callable

from .errors import INVALID_PARAMS, RelayError
from .fast_accept import Acceptor, PatternRule, compile_accept

__all__ = [
    "InvalidSchema",
    "best_match",
    "certainly_valid",
    "compile_schema",
    "first_error",
    "first_problem",
    "protocol_validator",
    "require_valid",
    "schema_problem",
]


def _is_strict_integer(checker: Any, instance: Any) -> bool:
    # JSON Schema counts 1.0 as an integer; the converter does not, so neither do we.
    return isinstance(instance, int) and not isinstance(instance, bool)


@functools.cache
def _jsonschema() -> ModuleType:
    """The `jsonschema` package, imported on first use (why: see the module docstring)."""
    import jsonschema

    return jsonschema


@functools.cache
def _protocol_validator_class() -> Any:
    jsonschema = _jsonschema()
    return jsonschema.validators.extend(
        jsonschema.Draft202012Validator,
        type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_strict_integer),
    )


def best_match(errors: Any) -> Any:
    """`jsonschema.exceptions.best_match`: the most relevant of a validator's errors, or None."""
    from jsonschema.exceptions import best_match as jsonschema_best_match

    return jsonschema_best_match(errors)


def protocol_validator(schema: dict[str, Any]) -> Any:
    """A validator for one of the protocol's own schemas: draft 2020-12, and ``1.0`` is not an
    integer (as for the converter). Raises ``jsonschema.SchemaError`` for a broken schema (a bug)."""
    validator_class = _protocol_validator_class()
    validator_class.check_schema(schema)
    return validator_class(schema)


class InvalidSchema(ValueError):
    """The schema itself is not a valid JSON Schema."""


def compile_schema(schema: dict[str, Any]) -> Any:
    """A validator for `schema`; `InvalidSchema` when the schema is broken.

    Compiled once per distinct schema (checking a schema against its metaschema costs
    milliseconds; a tool's schema is used for every call): validators are cached by the
    schema's canonical JSON text.
    """
    return _compile_text(json.dumps(schema, sort_keys=True, separators=(",", ":")))


@functools.lru_cache(maxsize=1024)
def _compile_text(text: str) -> Any:
    schema = json.loads(text)
    jsonschema = _jsonschema()
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidSchema(f"the schema itself is invalid: {exc.message}") from None
    return validator_class(schema)


# validator -> its acceptor (protocol/fast_accept.py), keyed by the validator's identity. The
# entry holds the validator weakly, so it keeps no validator (and no schema) alive longer than
# its owner does, and an id reused by a later validator is told apart. Validators are long-lived
# (the protocol's are cached, tools' are compiled once), so the bound only matters for a peer
# that declares many schemas; the oldest entry goes first.
_ACCEPTORS: dict[int, tuple[weakref.ref[Any], Acceptor]] = {}
_ACCEPTORS_MAX = 4096


def certainly_valid(validator: Any, value: Any) -> bool:
    """True when `value` is certainly valid for `validator` without running it (the common
    case, in microseconds); False means "run the validator" (see protocol/fast_accept.py)."""
    entry = _ACCEPTORS.get(id(validator))
    if entry is None or entry[0]() is not validator:
        entry = (weakref.ref(validator), compile_accept(validator.schema, _pattern_rule(validator)))
        if len(_ACCEPTORS) >= _ACCEPTORS_MAX:
            del _ACCEPTORS[next(iter(_ACCEPTORS))]
        _ACCEPTORS[id(validator)] = entry
    try:
        return entry[1](value)
    except Exception:  # e.g. a broken `pattern`: the validator meets it as it did before
        return False


def _pattern_rule(validator: Any) -> PatternRule:
    """`pattern` as this validator matches it: its own keyword function (the server anchors `$`
    as ECMA-262 does; jsonschema's default is Python's `re.search`)."""
    keyword = type(validator).VALIDATORS.get("pattern")
    if keyword is None:  # a draft without `pattern`: the keyword is ignored
        return lambda pattern: lambda text: True

    def rule(pattern: str) -> Callable[[str], bool]:
        schema = {"pattern": pattern}
        return lambda text: next(iter(keyword(validator, pattern, text, schema) or ()), None) is None

    return rule


def first_error(validator: Any, value: Any) -> Any:
    """The most relevant of `value`'s errors against `validator` (a jsonschema `ValidationError`),
    or None when it is valid; the one place every check runs a validator (fast path first)."""
    if certainly_valid(validator, value):
        return None
    return best_match(validator.iter_errors(value))


def first_problem(validator: Any, value: Any, what: str = "invalid value") -> str | None:
    """The most relevant reason `value` fails, as "WHAT at PATH: message"; None when valid."""
    error = first_error(validator, value)
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"{what} at {where}: {error.message}" if where else f"{what}: {error.message}"


def schema_problem(schema: dict[str, Any], value: Any, what: str = "invalid value") -> str | None:
    """`first_problem` for a schema used once; a broken schema is reported as the problem."""
    try:
        return first_problem(compile_schema(schema), value, what)
    except InvalidSchema as exc:
        return f"{what}: {exc}"


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def require_valid(validator: Any, value: Any, label: str) -> None:
    """Raise ``RelayError(INVALID_PARAMS)`` "invalid LABEL at PATH: problem" (``data.path`` is
    the JSON path) unless ``value`` is valid; how untrusted input to the protocol is refused."""
    error = first_error(validator, value)
    if error is None:
        return
    path = error.json_path
    raise RelayError(INVALID_PARAMS, f"invalid {label} at {path}: {_shorten(error.message)}", {"path": path})
