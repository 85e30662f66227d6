"""Checking values against JSON Schemas that come from outside (callers, toolsets, endpoints).

One place for what both programs do with a tool's input or result schema:
compile it once (draft from its `$schema`, 2020-12 by default; an invalid
schema is a clear error) and describe the first problem of a value in one line.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

__all__ = ["InvalidSchema", "compile_schema", "first_problem", "schema_problem"]


class InvalidSchema(ValueError):
    """The schema itself is not a valid JSON Schema."""


def compile_schema(schema: dict[str, Any]) -> Any:
    """A validator for `schema`; `InvalidSchema` when the schema is broken."""
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidSchema(f"the schema itself is invalid: {exc.message}") from None
    return validator_class(schema)


def first_problem(validator: Any, value: Any, what: str = "invalid value") -> str | None:
    """The most relevant reason `value` fails, as "WHAT at PATH: message"; None when valid."""
    error = best_match(validator.iter_errors(value))
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
