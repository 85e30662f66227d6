"""The one UTC timestamp format of both programs: ISO-8601 with milliseconds and ``Z``.

Frames (``ts``, a request's ``expires_at``), the stores' retention cut and the JSON log lines
all write ``2026-11-22T10:00:00.123Z`` (fixed width, so such strings also sort as times).
The text up to the second is kept for the last second formatted: the store writes one per append.
"""

from __future__ import annotations

import calendar
import time
from datetime import datetime, timezone

__all__ = ["format_ms", "format_ts", "utc_timestamp"]

_last_second: tuple[int, str] = (-1, "")


def format_ms(epoch_ms: int) -> str:
    """The timestamp of `epoch_ms` milliseconds since the epoch."""
    global _last_second
    secs, ms = divmod(epoch_ms, 1000)
    cached_secs, prefix = _last_second
    if secs != cached_secs:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
        _last_second = (secs, prefix)
    return f"{prefix}.{ms:03d}Z"


def format_ts(epoch: float) -> str:
    """The timestamp of `epoch` seconds (`time.time()`), rounded to the millisecond."""
    return format_ms(round(epoch * 1000))


def utc_timestamp(when: datetime | None = None) -> str:
    """The timestamp of `when` (default now; a naive datetime is taken to be UTC), milliseconds truncated."""
    if when is None:
        when = datetime.now(timezone.utc)
    elif when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return format_ms(calendar.timegm(when.utctimetuple()) * 1000 + when.microsecond // 1000)
