"""Peer strings in log lines and on the operator's terminal (docs/SECURITY.md): oubliette_runtime/peer_text.py
escapes and bounds them, and both log formats (oubliette_runtime/log_format.py) hold every record to it,
whichever logger wrote it — ours or a library's on our behalf."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from oubliette_runtime.log_format import TEXT_FORMAT, JsonFormatter, TextFormatter
from oubliette_runtime.peer_text import MESSAGE_CHARS, bounded, bounded_lines, escape, json_text

#: What a peer may put in a string to forge a log line or drive a terminal: a newline and a forged
#: line, CR, ESC and an 8-bit CSI (U+009B), C1 controls, the bidi overrides and isolates, a line
#: separator, NUL, DEL, a lone surrogate and a tag character.
HOSTILE = "a\n2026-11-28 00:00:00,000 INFO oubliette.access: forged\r\x1b[31m\x9b31m\x85\u202a\u202e\u2066\u2069\u2028\x00\x7f\ud800\U000e0001z"
UNSAFE = {"\n", "\r", "\x1b", "\x9b", "\x85", "\u202a", "\u202e", "\u2066", "\u2069", "\u2028", "\x00", "\x7f", "\ud800", "\U000e0001"}


def unsafe_in(text: str) -> set[str]:
    """The characters of `text` that a terminal or a log reader would act on (a newline too)."""
    return {char for char in text if not char.isprintable()}


def test_escape_writes_every_unprintable_character_as_an_escape_and_keeps_the_rest() -> None:
    escaped = escape(HOSTILE + " é€日本")
    assert unsafe_in(escaped) == set()
    assert "\\x9b" in escaped and "\\u202e" in escaped and "\\n" in escaped and "\\U000e0001" in escaped
    assert escaped.endswith("z é€日本")  # printable text, accents and all, as it was
    assert escape("plain text") == "plain text"


def test_bounded_cuts_a_value_and_says_how_long_it_was() -> None:
    assert bounded("x" * 900_000) == "x" * 200 + "… (900000 characters)"
    assert bounded("\x9b" * 100, 50) == "\\x9b" * 12 + "\\x… (100 characters)"
    assert bounded(17) == "17"
    block = bounded_lines("Traceback\n" + "\n".join([HOSTILE] * 100_000) + "\nValueError: the end", 1000)
    assert len(block) < 1100 and block.startswith("Traceback\na\n2026-11-28") and block.endswith("\nValueError: the end")
    assert unsafe_in(block) == {"\n"}


def test_json_text_escapes_what_json_dumps_leaves_raw_and_stays_the_same_json() -> None:
    value = {"type": HOSTILE, "text": "é€ ok", "n": [1, 2]}
    for indent in (None, 2):
        document = json.dumps(value, ensure_ascii=False, indent=indent)
        assert unsafe_in(document) - {"\n"}, "json.dumps writes C1 and bidi controls raw"
        safe = json_text(document)
        assert unsafe_in(safe) <= ({"\n"} if indent else set())
        assert json.loads(safe) == value
        assert "é€ ok" in safe


@pytest.mark.parametrize("formatter", [TextFormatter(TEXT_FORMAT), JsonFormatter()], ids=["text", "json"])
def test_a_log_line_never_carries_an_unbounded_or_unescaped_peer_string(formatter: logging.Formatter) -> None:
    """A library's record quoting a peer's 900 KB value (OpenTelemetry's, before the trace context
    was dropped at the door): the message escaped and cut, the extra fields and the traceback too."""
    try:
        raise ValueError(HOSTILE * 10_000)
    except ValueError:
        failure = sys.exc_info()
    record = logging.LogRecord("opentelemetry.trace.span", logging.WARNING, __file__, 1,
                               "Member doesn't match the w3c identifiers format %s", (HOSTILE + "x" * 900_000,), failure)
    record.peer = HOSTILE * 1000
    line = formatter.format(record)
    assert len(line) < 7 * MESSAGE_CHARS, len(line)
    if isinstance(formatter, JsonFormatter):
        assert unsafe_in(line) == set()
        parsed = json.loads(line)
        assert len(parsed["message"]) <= MESSAGE_CHARS + 30 and "900" in parsed["message"]
        assert parsed["message"].startswith("Member doesn't match the w3c identifiers format a\\n2026")
        assert len(parsed["peer"]) <= MESSAGE_CHARS + 30 and unsafe_in(parsed["exception"]) <= {"\n"}
    else:
        message, _, traceback = line.partition("\n")
        assert unsafe_in(message) == set() and "forged\\r\\x1b[31m\\x9b31m" in message
        assert unsafe_in(traceback) == {"\n"} and traceback.startswith("Traceback")
        assert all(len(part) <= MESSAGE_CHARS + 30 for part in traceback.split("\n"))
