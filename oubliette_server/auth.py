"""Instance tokens: HMAC-SHA256 of the instance id under a server secret.

Deriving tokens from one secret means there is nothing to register per
instance: whoever starts a sandbox asks `oubliette-server token INSTANCE` and
hands the token to it. The secret lives in the data directory with mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

SECRET_FILE_NAME = "secret"
HTTP_ADMIN = "http:admin"
"""The reserved name the HTTP API's own bearer token is derived under (not a valid instance id)."""
INSTANCE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) readable only by the owner when new."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def load_or_create_secret(data_dir: Path) -> bytes:
    """Return the server secret, creating it (0600) on first use."""
    ensure_private_dir(data_dir)
    secret_path = data_dir / SECRET_FILE_NAME
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = os.open(secret_path, flags, 0o600)
    except FileExistsError:
        secret = secret_path.read_bytes().strip()
        if len(secret) < 32:
            raise ValueError(f"server secret {secret_path} is too short; delete it to make a new one")
        return secret
    secret = secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret + b"\n")
    return secret


def check_instance_id(instance: str) -> str | None:
    """Return a reason why `instance` is not a valid instance id, or None."""
    if not isinstance(instance, str) or not INSTANCE_ID_PATTERN.match(instance):
        return (
            f"invalid instance id {instance!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
            "starting with a letter or digit"
        )
    return None


class TokenAuthority:
    """Derives and checks instance tokens under one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> "TokenAuthority":
        return cls(load_or_create_secret(data_dir))

    def token_for(self, instance: str) -> str:
        return hmac.new(self._secret, instance.encode(), hashlib.sha256).hexdigest()

    def verify(self, instance: str, token: object) -> bool:
        if not isinstance(token, str):
            return False
        return hmac.compare_digest(self.token_for(instance), token)
