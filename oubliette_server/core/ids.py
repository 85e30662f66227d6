"""Identifier rules: the instance ids, caller ids, HTTP principals and tool names the server accepts.

Session keys (channel and session id) have their one home in `protocol.session_keys`,
which every door uses.

Every check here is a full match. Python's `$` also matches just before a final
newline, so `re.match(r"^[a-z]+$", "box\\n")` succeeds, and so does a JSON Schema
`pattern` (jsonschema runs it with `re.search`). An id like `"boxA\\n"` would then
pass as valid while naming a different instance, token and log than it shows.
So ids are checked with `fullmatch`, and the server's own JSON Schemas are
validated with ECMA-262 anchors (`$` is the end of the string), which is what
their `^…$` patterns mean to every other JSON Schema implementation.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterator

import jsonschema
from jsonschema.exceptions import ValidationError

from protocol.session_keys import shown

INSTANCE_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
CALLER_ID = r"[A-Za-z0-9_-]{1,32}"
TOOL_NAME = r"[A-Za-z0-9_.-]{1,128}"

ADMIN_PRINCIPAL = "admin"
"""The HTTP principal of the admin token; also a stdio caller's and a Unix socket listener's.
Other principals' names take an instance id's grammar (`auth.principal_problem`)."""

_INSTANCE_ID_RE = re.compile(INSTANCE_ID)


def instance_id_problem(value: object) -> str | None:
    """Why `value` is not a valid instance id, or None."""
    if isinstance(value, str) and _INSTANCE_ID_RE.fullmatch(value):
        return None
    return (
        f"invalid instance id {shown(value)}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
        "starting with a letter or digit"
    )


# -- JSON Schema patterns with ECMA-262 anchors ------------------------------------------


def ecma_regex(pattern: str) -> str:
    """`pattern` for Python's `re` with ECMA-262 meaning of `$`: the end of the string only.

    Each `$` outside a character class and not escaped becomes `\\Z`; everything else is
    left as written.
    """
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":  # a leading "]" is a literal inside the class
                out.append("[]")
                i += 2
                continue
        elif char == "$":
            char = r"\Z"
        out.append(char)
        i += 1
    return "".join(out)


@lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(ecma_regex(pattern))


def _pattern_keyword(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _compiled(pattern).search(instance):
        yield ValidationError(f"{shown(instance)} does not match {pattern!r}")


_StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, validators={"pattern": _pattern_keyword},
)


def strict_validator(schema: dict[str, Any]) -> Any:
    """A 2020-12 validator for one of the server's own schemas, `pattern` anchored as in ECMA-262."""
    _StrictValidator.check_schema(schema)
    return _StrictValidator(schema)
