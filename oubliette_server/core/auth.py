"""Instance tokens: HMAC-SHA256 of the instance id under a server secret.

Deriving tokens from one secret means there is nothing to register per
instance: whoever starts a sandbox asks `oubliette-server token INSTANCE` and
hands the token to it. The secret lives in the data directory with mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Callable

from protocol import PROTOCOL_VERSION, RelayError, errors, messages
from protocol.session_keys import check_session_key

from .ids import ADMIN_PRINCIPAL, instance_id_problem

SECRET_FILE_NAME = "secret"
def principal_key(principal: str) -> str:
    """The name an HTTP principal's token is derived under: `http:NAME`, never a valid instance id."""
    return f"http:{principal}"


HTTP_ADMIN = principal_key(ADMIN_PRINCIPAL)
"""The reserved name the HTTP API's own bearer token is derived under (not a valid instance id)."""


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) readable only by the owner when new."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def load_or_create_secret(data_dir: Path) -> bytes:
    """Return the server secret, creating it (0600) on first use.

    The secret is written to a private temporary file and linked into place whole, so a second
    process starting at the same moment (a server and `oubliette-server token`) reads either no
    file or the complete secret, never a half-written one; whoever links first wins.
    """
    ensure_private_dir(data_dir)
    secret_path = data_dir / SECRET_FILE_NAME
    if not secret_path.exists():
        secret = secrets.token_hex(32).encode()
        temporary = data_dir / f".{SECRET_FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secret + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, secret_path)
            except FileExistsError:
                pass  # another process created it first: use theirs
        finally:
            os.unlink(temporary)
    secret = secret_path.read_bytes().strip()
    if len(secret) < 32:
        raise ValueError(f"server secret {secret_path} is too short; delete it to make a new one")
    return secret

def check_instance_id(instance: object) -> str | None:
    """Return a reason why `instance` is not a valid instance id (full match), or None."""
    return instance_id_problem(instance)


class TokenAuthority:
    """Derives and checks instance tokens under one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._shared = False

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> "TokenAuthority":
        """The authority of the secret in `data_dir`, created (mode 0600) on first use.

        Raises: `ValueError` when the stored secret is too short; `OSError` when the directory
        cannot be created or read.
        """
        return cls(load_or_create_secret(data_dir))

    @property
    def secret(self) -> bytes:
        """The secret tokens are derived from (offered to a shared store by the first server)."""
        return self._secret

    def use_secret(self, secret: bytes) -> None:
        """Derive tokens from `secret` from now on (the deployment's shared one, kept by the PostgreSQL store)."""
        if len(secret) < 32:
            raise ValueError("the shared server secret is too short")
        self._secret = secret
        self._shared = True

    def token_hint(self, instance: str) -> str:
        """How a person gets `instance`'s token from this server, for a refused hello.

        A deployment on PostgreSQL derives tokens from the store's secret, so the command needs the
        server's `--store` (without it, it prints the data directory's token, which this server
        refuses). The store URL itself is not sent: the sandbox must not learn it.
        """
        if self._shared:
            return f"`oubliette-server token {instance} --store URL` prints it, URL being the server's --store"
        return f"`oubliette-server token {instance}` prints it, with the server's --data-dir if it has one"

    def token_for(self, instance: str) -> str:
        """The instance's token: hex HMAC-SHA256 of its id under the secret (the same every time)."""
        return hmac.new(self._secret, instance.encode(), hashlib.sha256).hexdigest()

    def verify(self, instance: str, token: object) -> bool:
        """Whether `token` is the instance's token; False (never an exception) for any other value.

        Compared as bytes: `hmac.compare_digest` raises TypeError on non-ASCII str, and a
        lone surrogate does not encode as UTF-8 without `surrogatepass`.
        """
        if not isinstance(token, str):
            return False
        expected = self.token_for(instance).encode()
        return hmac.compare_digest(expected, token.encode("utf-8", "surrogatepass"))


def principal_problem(name: object) -> str | None:
    """Why `name` cannot be a named HTTP principal (it takes an instance id's grammar; `admin` is
    the admin token's), or None."""
    if name == ADMIN_PRINCIPAL:
        return f"'{ADMIN_PRINCIPAL}' is the HTTP admin token's principal; name the principal otherwise"
    problem = instance_id_problem(name)
    return problem.replace("instance id", "principal name") if problem else None


class HttpPrincipals:
    """Which HTTP principal a bearer token is (docs/POLICY.md, "HTTP principals").

    Needs: the token authority (derived tokens: `admin`'s and those of `names`, HMAC of the
    deployment's secret and `http:NAME`, as `oubliette-server http-token --principal NAME` prints
    them; read at each check, so a shared store's secret adopted at start counts) and the token
    files of the principals given one (`token_files`, read once here: one token, its first line).
    Raises: `ValueError` for a bad name or an unreadable or empty token file.
    """

    def __init__(self, authority: TokenAuthority, names: list[str], token_files: dict[str, Path]) -> None:
        for name in [*names, *token_files]:
            problem = principal_problem(name)
            if problem:
                raise ValueError(f"HTTP principal {name!r}: {problem}")
        self.authority = authority
        self.names = [name for name in dict.fromkeys(names) if name not in token_files]
        self._file_tokens: list[tuple[bytes, str]] = []
        for name, path in token_files.items():
            try:
                token = Path(path).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the token file of HTTP principal {name!r}, {path}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
            if len(token) < 32:
                raise ValueError(f"the token file of HTTP principal {name!r}, {path}, holds no token of 32 characters or more")
            self._file_tokens.append((token.encode(), name))
        self._derived: tuple[bytes, list[tuple[bytes, str]]] | None = None

    def principal_of(self, token: str) -> str | None:
        """The principal `token` is the bearer token of, or None (an instance's token, or none at all)."""
        given = token.encode("utf-8", "surrogatepass")
        for expected, name in self._derived_tokens():
            if hmac.compare_digest(expected, given):
                return name
        for expected, name in self._file_tokens:
            if hmac.compare_digest(expected, given):
                return name
        return None

    def _derived_tokens(self) -> list[tuple[bytes, str]]:
        """`admin`'s token and those of `names`, derived once per secret (an HMAC each: every HTTP
        request is checked against them) and again when the authority adopts another."""
        secret = self.authority.secret
        if self._derived is None or self._derived[0] is not secret:
            derive = self.authority.token_for
            tokens = [(derive(HTTP_ADMIN).encode(), ADMIN_PRINCIPAL)]
            tokens += [(derive(principal_key(name)).encode(), name) for name in self.names]
            self._derived = (secret, tokens)
        return self._derived[1]


def check_hello(
    hello: messages.Hello, verify_token: Callable[[str, str], bool],
    token_hint: Callable[[str], str] | None = None,
) -> None:
    """Refuse a `hello` that the server must not accept, with the error its peer gets
    (a wrong token's says how to print the right one, when `token_hint` is given).

    Raises RelayError: INVALID_REQUEST for another protocol; INVALID_PARAMS for an unknown
    role or a malformed session key; NOT_FOUND for a malformed instance id; UNAUTHORIZED for
    a wrong token. Nothing else: every check here is total over the hello's field types.
    """
    if hello.protocol != PROTOCOL_VERSION:
        raise RelayError(
            errors.INVALID_REQUEST,
            f"unsupported protocol {hello.protocol!r}; this server speaks {PROTOCOL_VERSION!r}",
        )
    if hello.role not in messages.ROLES:
        raise RelayError(errors.INVALID_PARAMS, f"unknown role {hello.role!r}; use 'client' or 'guest'")
    reason = instance_id_problem(hello.instance)
    if reason:
        raise RelayError(errors.NOT_FOUND, reason)
    if hello.session is not None:
        check_session_key(hello.session)
    if not verify_token(hello.instance, hello.token):
        # A token opens one instance: the instance's name may be the mistake (bxo1 for box1).
        hint = f"; check OUBLIETTE_TOKEN: {token_hint(hello.instance)}" if token_hint else ""
        raise RelayError(errors.UNAUTHORIZED, (
            f"wrong token for instance '{hello.instance}' (the token was checked for that instance: check "
            f"OUBLIETTE_INSTANCE{hint})"
        ))
