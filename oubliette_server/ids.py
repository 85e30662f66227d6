"""Identifier rules: the instance ids, channels, session ids and caller ids the server accepts.

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

from protocol.frames import DEFAULT_CHANNEL

INSTANCE_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
CHANNEL = r"[A-Za-z0-9_.-]{1,64}"
SESSION_ID = r"[A-Za-z0-9_.:@-]{1,128}"
CALLER_ID = r"[A-Za-z0-9_-]{1,32}"
TOOL_NAME = r"[A-Za-z0-9_.-]{1,128}"

_INSTANCE_ID_RE = re.compile(INSTANCE_ID)
_CHANNEL_RE = re.compile(CHANNEL)
_SESSION_ID_RE = re.compile(SESSION_ID)


def schema_pattern(rule: str) -> str:
    """The rule as an anchored JSON Schema `pattern` (validate it with :func:`strict_validator`)."""
    return f"^{rule}$"


def instance_id_problem(value: object) -> str | None:
    """Why `value` is not a valid instance id, or None."""
    if isinstance(value, str) and _INSTANCE_ID_RE.fullmatch(value):
        return None
    return (
        f"invalid instance id {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
        "starting with a letter or digit"
    )


def session_id_problem(value: object) -> str | None:
    """Why `value` is not a valid session id, or None."""
    if isinstance(value, str) and _SESSION_ID_RE.fullmatch(value):
        return None
    return f"invalid session_id {value!r}: use 1-128 of A-Z a-z 0-9 _ . : @ -"


def channel_problem(value: object) -> str | None:
    """Why `value` is not a valid channel name, or None."""
    if isinstance(value, str) and _CHANNEL_RE.fullmatch(value):
        return None
    return f"invalid channel {value!r}: use 1-64 of A-Z a-z 0-9 _ . -"


def session_key_problem(key: object) -> str | None:
    """Why `key` is not a valid session key (`channel:id`, or a bare id in channel `mcp`), or None."""
    if not isinstance(key, str):
        return f"invalid session {key!r}: want 'channel:id'"
    channel, sep, sid = key.partition(":")
    if not sep:
        channel, sid = DEFAULT_CHANNEL, key
    if not channel or not sid:
        return f"invalid session {key!r}: want 'channel:id' with a non-empty channel and id"
    problem = channel_problem(channel) or session_id_problem(sid)
    return f"invalid session {key!r}: {problem}" if problem else None


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
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, validators={"pattern": _pattern_keyword},
)


def strict_validator(schema: dict[str, Any]) -> Any:
    """A 2020-12 validator for one of the server's own schemas, `pattern` anchored as in ECMA-262."""
    _StrictValidator.check_schema(schema)
    return _StrictValidator(schema)
