"""Server settings, with the defaults a user gets when passing no flags."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

DEFAULT_CALLER_TIMEOUT = 60.0
DEFAULT_SESSION_WAIT = 600.0


def default_data_dir() -> Path:
    """`$OUBLIETTE_DATA_DIR`, else the XDG data home's `oubliette` folder."""
    env = os.environ.get("OUBLIETTE_DATA_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "oubliette"


@attrs.define
class ServerConfig:
    """Everything `OublietteServer` needs; the CLI builds one from flags."""

    data_dir: Path = attrs.field(factory=default_data_dir, converter=Path)
    relay: str | None = None
    """`unix:PATH` or `tcp:HOST:PORT`; None means `unix:<data_dir>/relay.sock`."""
    caller_timeout: float = DEFAULT_CALLER_TIMEOUT
    """Seconds a relayed caller tool call waits for the caller (per tool: `timeout_ms`)."""
    store_path: str | None = None
    """SQLite file of the frame log; None means `<data_dir>/frames.sqlite3`."""
    retention_frames: int | None = 100_000
    session_wait_limit: float = DEFAULT_SESSION_WAIT

    @property
    def relay_address(self) -> str:
        return self.relay or f"unix:{self.data_dir / 'relay.sock'}"

    @property
    def frame_store_path(self) -> str:
        return self.store_path or str(self.data_dir / "frames.sqlite3")
