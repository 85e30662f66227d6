"""How both programs write their log lines on stderr: `text` for people, `json` for log shippers.

`--log-format text` (the default) is the line both programs always wrote
(`2026-11-26 12:00:01,234 INFO oubliette.access: ...`). `--log-format json` writes one JSON
object per line: `time` (UTC, ISO 8601), `level`, `logger`, `message`, the record's extra fields
(`logger.info(..., extra={...})`), `exception` for a traceback, and `trace_id` / `span_id` when
the line is written inside a recording OpenTelemetry span (docs/OBSERVABILITY.md, "Logs"), so a
log line leads to its trace. Only the JSON format reads the current span, and it imports
`opentelemetry.trace` (the API, always installed with the MCP SDK) only when it is chosen.

Both formats hold every record to one rule, whoever logged it (ours, or a library on our behalf:
OpenTelemetry, the MCP SDK, hypercorn, psycopg): a log line never carries an unbounded or
unescaped peer string. The message is escaped and cut at `peer_text.MESSAGE_CHARS` (a newline
in it cannot forge a line), a JSON line's fields likewise, a traceback's lines each bounded
(oubliette_runtime/peer_text.py; docs/SECURITY.md, "Peer strings in log lines and on the terminal").
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from protocol.timestamps import format_ms

from .peer_text import MESSAGE_CHARS, bounded, bounded_lines, json_text

__all__ = ["LOG_FORMATS", "TEXT_FORMAT", "TextFormatter", "JsonFormatter", "add_log_format_option", "configure_logging"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The `text` line: what both programs wrote before `--log-format` existed."""

#: A LogRecord's own attributes; anything else on a record came from `extra=` and is written too.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT` lines whose message is one escaped, bounded line, and whose traceback's lines are bounded."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line, with the record's message escaped and cut at `MESSAGE_CHARS`."""
        record.message = bounded(record.message, MESSAGE_CHARS)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        """The traceback, each line bounded (an exception's message may quote a peer's value)."""
        return bounded_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        """The stack, each line bounded."""
        return bounded_lines(super().formatStack(stack_info))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: the message and string fields escaped and bounded as
    `TextFormatter`'s, and any character not printable written as a JSON escape."""

    def __init__(self) -> None:
        super().__init__()
        import json  # not at module import: `--help` and the text format never need it

        self._dumps = json.dumps
        try:
            from opentelemetry import trace
        except ImportError:  # the API comes with the MCP SDK; without it there are no spans to name
            self._current_span = None
        else:
            self._current_span = trace.get_current_span

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON object: time, level, logger, message, extra fields, trace ids."""
        line: dict[str, Any] = {
            "time": format_ms(int(record.created) * 1000 + int(record.msecs)),
            "level": record.levelname,
            "logger": record.name,
            "message": bounded(record.getMessage(), MESSAGE_CHARS),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in line:
                line[key] = value if value is None or isinstance(value, (bool, int, float)) else bounded(
                    value if isinstance(value, str) else self._dumps(value, default=str), MESSAGE_CHARS)
        if self._current_span is not None:
            span = self._current_span()
            context = span.get_span_context()
            if context.is_valid and span.is_recording():
                line["trace_id"] = format(context.trace_id, "032x")
                line["span_id"] = format(context.span_id, "016x")
        if record.exc_info:
            line["exception"] = bounded_lines(self.formatException(record.exc_info))
        elif record.exc_text:
            line["exception"] = bounded_lines(record.exc_text)
        if record.stack_info:
            line["stack"] = bounded_lines(self.formatStack(record.stack_info))
        return json_text(self._dumps(line, default=str, ensure_ascii=False))


def add_log_format_option(parser: argparse.ArgumentParser) -> None:
    """`--log-format text|json`: the same flag and help in both programs."""
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text",
        help="stderr log lines: text (default) or json (one object per line, with trace_id/span_id inside a span)",
    )


def configure_logging(level: str | int, log_format: str = "text") -> None:
    """Send the root logger's records to stderr at `level`, as `text` or `json` lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
