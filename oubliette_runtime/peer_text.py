"""Text a peer chose, made fit for a log line or an operator's terminal: escaped and bounded.

Why one module: a sandbox, a caller or an HTTP client chooses strings that end up in the
server's log lines (an access line's fields, a library's warning about a header) and on an
operator's terminal (`oubliette-server tail` and `status`). Written raw, a newline forges a log
line, an 8-bit CSI (U+009B) or ESC drives the terminal, a right-to-left override (U+202E) makes
text read backwards, and a 900 KB value is 900 KB of log per request (docs/SECURITY.md, "Peer
strings in log lines and on the terminal"). Every such output goes through this module:

- `escape`: every character that is not printable (`str.isprintable`: C0 and C1 controls, DEL,
  the bidi overrides and isolates U+202A–U+202E and U+2066–U+2069 and other format characters,
  line and paragraph separators, lone surrogates) written as its Python escape (`\\x9b`,
  `\\u202e`, `\\n`); printable text, accents and all, is left as it is;
- `bounded`: `escape` of at most `limit` characters, and how long the value was;
- `json_text`: a JSON document (from `json.dumps(..., ensure_ascii=False)`) with the same
  characters as JSON escapes (`\\u009b`), so it stays valid JSON.

It imports nothing of the project: both programs' log formats (oubliette_runtime/log_format.py) and the
operator's view (oubliette_server/program/operator_view.py) use it.
"""

from __future__ import annotations

import re

__all__ = ["VALUE_CHARS", "MESSAGE_CHARS", "escape", "bounded", "bounded_lines", "json_text"]

VALUE_CHARS = 200
"""How much of one value a log line's field shows (`bounded`'s default)."""
MESSAGE_CHARS = 4096
"""How long one log record's message may be (oubliette_runtime/log_format.py): ours are far shorter; a
library's warning that quotes a peer's value is cut here."""

_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: Every character but printable ASCII: the candidates, each then asked `str.isprintable` (a text
#: that is printable as a whole never reaches the expression).
_NOT_ASCII_PRINTABLE = re.compile(r"[^\x20-\x7e]")
#: Whitespace that JSON writes only between its tokens (inside a string it is always escaped).
_JSON_WHITESPACE = frozenset("\n\r\t")


def _python_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable():
        return char
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _json_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable() or char in _JSON_WHITESPACE:
        return char
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def escape(text: str) -> str:
    """`text` with every character that is not printable written as its Python escape."""
    return text if text.isprintable() else _NOT_ASCII_PRINTABLE.sub(_python_escape, text)


def bounded(value: object, limit: int = VALUE_CHARS) -> str:
    """`value` (its `str`) escaped, on one line, in at most `limit` characters and a note of its
    length when it was longer: `aaaa… (900000 characters)`."""
    text = value if isinstance(value, str) else str(value)
    shown = escape(text[:limit])
    if len(text) <= limit and len(shown) <= limit:
        return shown
    return f"{shown[:limit]}… ({len(text)} characters)"


def bounded_lines(text: str, limit: int = 4 * MESSAGE_CHARS) -> str:
    """A block of lines (a traceback) kept as lines, each escaped, in at most about `limit`
    characters: past that, its first and last halves, which say where it began and what was raised."""

    def cut(block: str) -> str:
        if len(block) <= limit:
            return block
        half = limit // 2
        return f"{block[:half]}\n… ({len(block) - 2 * half} characters left out) …\n{block[-half:]}"

    return cut("\n".join(escape(line) for line in cut(text).split("\n")))


def json_text(document: str) -> str:
    """A JSON document with its unprintable characters as JSON escapes: `json.dumps` escapes C0
    controls itself, and the rest (C1, bidi controls, separators) can only be inside its strings."""
    return document if document.isprintable() else _NOT_ASCII_PRINTABLE.sub(_json_escape, document)
