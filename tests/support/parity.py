"""What a fast path's parity test compares: an answer with what differs between two runs of the
same requests (where in the log, when, fresh ids) replaced by placeholders."""

from __future__ import annotations

import json
import re
from typing import Any

#: Keys whose values differ between two runs of the same requests.
VOLATILE_KEYS = frozenset({
    "seq", "ts", "msg_id", "reply_to", "expires_at", "ingress_seq", "last_seq", "next_seq",
})
#: Fresh ids in text: request ids, the runs' session names, callers' names.
VOLATILE_TEXT = re.compile(r"ctr-[0-9a-f]+|s-(on|off)|caller-\d+|m-[0-9a-f]{8,}")


def masked(value: Any) -> Any:
    """`value` with what differs between runs replaced by placeholders (a text block holding JSON: inside it too)."""
    if isinstance(value, dict):
        return {key: f"<{key}>" if key in VOLATILE_KEYS else masked(item) for key, item in value.items()}
    if isinstance(value, list):
        return [masked(item) for item in value]
    if isinstance(value, str) and value.startswith("{"):  # a text content block holding the JSON result
        try:
            return masked(json.loads(value))
        except ValueError:
            pass
    if isinstance(value, str):
        return VOLATILE_TEXT.sub("<id>", value)
    return value


def masked_text(text: str) -> str:
    """Raw response text with fresh ids and every number masked: what is left is its layout
    (key order, separators, escaping), which two runs must share byte for byte."""
    return re.sub(r"\d+", "0", VOLATILE_TEXT.sub("<id>", text))
