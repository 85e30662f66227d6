"""The frame log's hash chain: its one recipe, the checkpoints that carry it, their signatures.

Why: the log is the record of what every agent and caller did (docs/AUDIT.md). A chain makes a
change to it visible: every frame's hash covers its content, its seq and the hash before it, so
an edited, deleted or moved frame breaks the link after it. A checkpoint (`Checkpoint`) says
"after seq N the chain's hash was H"; retention writes one where it deletes, so the chain goes
on across the gap, and, signed with the deployment's Ed25519 key, it is what someone holding the
database cannot forge: a log rewritten and hashed again no longer matches the signed hashes.

The recipe (docs/AUDIT.md shows it in a few lines of Python, and tests check the two agree):

    digest = sha256(canonical_json(the frame's wire JSON without "seq" and "v"))
    hash   = sha256(prev + seq as 8 bytes big-endian + digest)

`prev` is the previous frame's hash, `GENESIS` (32 zero bytes) before an instance's first
frame. The stores compute it as they store a frame (PostgreSQL in the append statement, under
the instance row's lock, so appends by several servers chain in commit order).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

import attrs

from protocol.frames import Frame

from .api import canonical_json

__all__ = [
    "GENESIS",
    "Checkpoint",
    "ChainBreak",
    "ChainCheck",
    "ChainedFrame",
    "ChainedLog",
    "Signer",
    "content_digest",
    "frame_hash",
    "link",
    "load_public_key",
    "value_digest",
]

#: The `prev` of an instance's first frame (and of the first frame stored after the upgrade that
#: brought the chain: the frames before it have no hash).
GENESIS = bytes(32)
#: Checkpoint reasons: retention deleted frames up to its seq, every `checkpoint_every` frames,
#: or asked for (`oubliette-server audit checkpoint`).
RETENTION, EVERY, DEMAND = "retention", "every", "demand"
#: An approval's decision binds the hash of the arguments its request showed (`value_digest`).
ARGUMENTS_DIGEST_KEY = "arguments_sha256"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def value_digest(value: Any) -> str:
    """The SHA-256 (hex) of a JSON value's canonical text: what a decision binds (approved arguments)."""
    return hashlib.sha256(_utf8(canonical_json(value))).hexdigest()


def content_digest(
    instance: str, ts: str, channel: str, session_id: str, type: str, msg_id: str, reply_to: str | None,
    payload: dict[str, Any],
) -> bytes:
    """The digest of one frame's content: its wire JSON (`Frame.to_wire`) without `seq` and `v`."""
    wire: dict[str, Any] = {
        "ts": ts, "instance": instance, "session": {"channel": channel, "id": session_id}, "type": type,
        "msg_id": msg_id, "payload": payload,
    }
    if reply_to is not None:
        wire["reply_to"] = reply_to
    return hashlib.sha256(_utf8(canonical_json(wire))).digest()


def link(prev: bytes, seq: int, digest: bytes) -> bytes:
    """The hash of the frame at `seq` whose content digest is `digest`, after `prev`."""
    return hashlib.sha256(prev + seq.to_bytes(8, "big") + digest).digest()


def frame_hash(prev: bytes, frame: Frame) -> bytes:
    """The hash `frame` must have after `prev`."""
    return link(prev, frame.seq, content_digest(
        frame.instance, frame.ts, frame.channel, frame.session_id, frame.type, frame.msg_id, frame.reply_to,
        frame.payload,
    ))


@attrs.frozen
class ChainedFrame:
    """A stored frame with the hash stored beside it (None: stored before the chain existed)."""

    frame: Frame
    hash: bytes | None


@attrs.frozen
class Checkpoint:
    """The chain's hash after frame `seq` of `instance`, as a store wrote it (`reason`), signed or not."""

    instance: str
    seq: int
    hash: bytes
    ts: str
    reason: str
    signature: bytes | None = None

    def message(self) -> bytes:
        """The bytes a signature covers: canonical JSON of instance, seq, hash (hex) and ts."""
        return _utf8(canonical_json({"instance": self.instance, "seq": self.seq, "hash": self.hash.hex(), "ts": self.ts}))

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as `audit export` writes it (hashes and signature in hex)."""
        return {
            "instance": self.instance, "seq": self.seq, "hash": self.hash.hex(), "ts": self.ts, "reason": self.reason,
            "signature": None if self.signature is None else self.signature.hex(),
        }


@runtime_checkable
class ChainedLog(Protocol):
    """What `oubliette-server audit` reads and writes of a store's chain (both stores)."""

    async def chained_frames(self, instance: str, after_seq: int, limit: int) -> list[ChainedFrame]:
        """The stored frames of `instance` after `after_seq`, at most `limit`, with their hashes."""
        ...

    async def checkpoints(self, instance: str) -> list[Checkpoint]:
        """Every checkpoint of `instance`, by seq."""
        ...

    async def add_checkpoint(self, instance: str) -> Checkpoint | None:
        """A checkpoint after the last stored frame of `instance`, now (None: it has none)."""
        ...

    async def chain_head(self, instance: str) -> bytes | None:
        """The chain hash the store keeps apart from the frames (PostgreSQL's per-instance head), or None."""
        ...


class Signer:
    """Signs checkpoints with the deployment's Ed25519 private key (a PEM file, `audit_key`).

    Raises: `ValueError` naming the file when it cannot be read or is not an unencrypted Ed25519
    private key in PEM."""

    def __init__(self, path: str | Path) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(Path(path).read_bytes(), password=None)
        except OSError as exc:
            raise ValueError(f"audit key {path}: cannot read it ({exc.strerror})") from None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"audit key {path}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"audit key {path}: not an Ed25519 key")
        self._key = key

    def __call__(self, message: bytes) -> bytes:
        """The signature of `message`."""
        return self._key.sign(message)


def load_public_key(path: str | Path) -> Any:
    """The Ed25519 public key in PEM at `path` (`ValueError` naming the file if it is not one)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(Path(path).read_bytes())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"public key {path}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"public key {path}: not an Ed25519 key")
    return key


def _signature_ok(public_key: Any, checkpoint: Checkpoint) -> bool:
    from cryptography.exceptions import InvalidSignature

    if checkpoint.signature is None:
        return False
    try:
        public_key.verify(checkpoint.signature, checkpoint.message())
    except InvalidSignature:
        return False
    return True


@attrs.frozen
class ChainBreak:
    """The first broken link of an instance's chain: at `seq`, `what` differs."""

    instance: str
    seq: int
    what: str

    def __str__(self) -> str:
        return f"instance {self.instance!r}: broken at seq {self.seq}: {self.what}"


class ChainCheck:
    """Checks one instance's chain as its frames are fed in seq order (`audit verify`).

    Needs: the seq retention deleted up to (`pruned_below`), the instance's checkpoints and, to
    trust them, the deployment's public key; then every kept frame through `feed`, then `end`.
    Each returns the first `ChainBreak` met (None while the chain holds); after a break, stop.
    """

    def __init__(
        self, instance: str, pruned_below: int, checkpoints: Iterable[Checkpoint], public_key: Any = None,
    ) -> None:
        self.instance = instance
        self.checked = 0
        self.unchained = 0
        self._checkpoints = {c.seq: c for c in sorted(checkpoints, key=lambda c: c.seq)}
        self._public_key = public_key
        self._next = pruned_below + 1
        self._prev = GENESIS
        self._chained = False
        self._requests: dict[str, str] = {}
        self.start: ChainBreak | None = self._start(pruned_below)

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The instance's checkpoints, by seq."""
        return list(self._checkpoints.values())

    def _break(self, seq: int, what: str) -> ChainBreak:
        return ChainBreak(self.instance, seq, what)

    def _start(self, pruned_below: int) -> ChainBreak | None:
        if self._public_key is not None:
            for checkpoint in self._checkpoints.values():
                if not _signature_ok(self._public_key, checkpoint):
                    state = "has no signature" if checkpoint.signature is None else "has a signature the public key refuses"
                    return self._break(checkpoint.seq, f"the checkpoint at seq {checkpoint.seq} ({checkpoint.reason}) {state}")
        if pruned_below:
            anchor = self._checkpoints.get(pruned_below)
            if anchor is None:
                return self._break(pruned_below + 1, f"frames up to seq {pruned_below} were deleted without a checkpoint")
            self._prev = anchor.hash
            self._chained = anchor.hash != GENESIS
        return None

    def feed(self, item: ChainedFrame) -> ChainBreak | None:
        """Check the next kept frame."""
        frame = item.frame
        if frame.seq != self._next:
            return self._break(self._next, f"the frame is missing (the next stored frame is seq {frame.seq})")
        self._next += 1
        if item.hash is None:
            if self._chained:
                return self._break(frame.seq, "the frame has no hash (it is after frames that have one)")
            self.unchained += 1
            return None
        expected = frame_hash(self._prev, frame)
        if expected != item.hash:
            return self._break(frame.seq, "the frame does not match its hash (its content, seq or the link before it changed)")
        checkpoint = self._checkpoints.get(frame.seq)
        if checkpoint is not None and checkpoint.hash != item.hash:
            return self._break(frame.seq, f"the checkpoint at seq {frame.seq} ({checkpoint.reason}) holds another hash than the frame")
        self._prev, self._chained = item.hash, True
        self.checked += 1
        return self._approval_binding(frame)

    def _approval_binding(self, frame: Frame) -> ChainBreak | None:
        """An `approval_resolved` binds the arguments its `approval_request` showed (`ARGUMENTS_DIGEST_KEY`)."""
        payload = frame.payload
        request_id = payload.get("request_id")
        if not isinstance(request_id, str):
            return None
        if frame.type == "approval_request":
            self._requests[request_id] = value_digest(payload.get("arguments"))
        elif frame.type == "approval_resolved":
            requested = self._requests.pop(request_id, None)
            bound = payload.get(ARGUMENTS_DIGEST_KEY)
            if requested is not None and bound is not None and bound != requested:
                return self._break(frame.seq, f"the decision on approval {request_id!r} binds other arguments than its request showed")
        return None

    def end(self, last_seq: int, head: bytes | None = None) -> ChainBreak | None:
        """After the last kept frame: frames missing at the end, checkpoints past it, a head that differs."""
        if self._next <= last_seq:
            return self._break(self._next, f"frames {self._next}..{last_seq} are missing (the log's last seq is {last_seq})")
        beyond = [seq for seq in self._checkpoints if seq >= self._next]
        if beyond:
            return self._break(self._next, f"a checkpoint at seq {beyond[0]} is past the last kept frame (frames were deleted)")
        if head is not None and head != self._prev:
            return self._break(last_seq, "the instance's chain head differs from its last frame's hash")
        return None
