"""What a config file value should have been: one sentence for a value of the wrong TOML type.

Used by every part of the config file (`[server]`, `[store]`, `[toolsets.*]`), so a mistyped
value always says the type expected and the one found, in TOML's words.
"""

from __future__ import annotations

import json
from typing import Any

#: TOML's names for the Python types `tomllib` produces.
_NAMES: dict[type, str] = {
    bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table",
}


def _expected_name(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(_NAMES.get(kind, kind.__name__) for kind in kinds)


def _found_name(value: Any) -> str:
    for kind in (bool, int, float, str, list, dict):  # bool first: it is an int to Python
        if isinstance(value, kind):
            return _NAMES[kind]
    return type(value).__name__  # dates and times


def wrong_type(what: str, value: Any, expected: type | tuple[type, ...]) -> str | None:
    """`what must be <expected>, not <found> (<value>)`, or None when `value` has the type.

    A boolean is never taken for a number (Python's bool is an int; TOML's is not).
    """
    if isinstance(value, expected) and not (isinstance(value, bool) and bool not in (
            expected if isinstance(expected, tuple) else (expected,))):
        return None
    shown = json.dumps(value, default=str)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{what} must be {_expected_name(expected)}, not {_found_name(value)} ({shown})"
