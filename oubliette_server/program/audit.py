"""`oubliette-server audit verify|export|checkpoint [INSTANCE]`: the frame log's hash chain, for an operator.

Why a command beside the server: the proof of what was done must be checkable by someone who
does not trust the server's own answers, from the database itself (`verify`), or outside it
altogether (`export` writes every frame with its hash and the checkpoints as JSON lines, which
a few lines of Python verify, docs/AUDIT.md). The rules of the chain are store/chain.py's;
this module reads the store page by page and reports.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, TextIO

from ..store.api import FrameStoreAPI
from ..store.chain import GENESIS, ChainBreak, ChainCheck, ChainedLog

__all__ = ["AuditedStore", "checkpoint", "export", "verify"]

#: Frames read per query while walking an instance's chain.
PAGE = 500


class AuditedStore(FrameStoreAPI, ChainedLog, Protocol):
    """A frame store with its chain (both stores are)."""


async def _instances(store: AuditedStore, instance: str | None) -> list[str]:
    return [instance] if instance is not None else await store.instances()


async def verify_instance(store: AuditedStore, instance: str, public_key: Any = None) -> tuple[ChainBreak | None, ChainCheck]:
    """Walk `instance`'s chain from its oldest kept frame: its first broken link (None: it holds)."""
    pruned = await store.pruned_below(instance)
    check = ChainCheck(instance, pruned, await store.checkpoints(instance), public_key)
    if check.start is not None:
        return check.start, check
    after = pruned
    while True:
        page = await store.chained_frames(instance, after, PAGE)
        for item in page:
            broken = check.feed(item)
            if broken is not None:
                return broken, check
        if len(page) < PAGE:
            break
        after = page[-1].frame.seq
    return check.end(await store.last_seq(instance), await store.chain_head(instance)), check


async def verify(store: AuditedStore, instance: str | None, public_key: Any, out: TextIO) -> bool:
    """One line per instance (its first broken link, or how much of it holds); True when every chain holds."""
    held = True
    for name in await _instances(store, instance):
        broken, check = await verify_instance(store, name, public_key)
        if broken is not None:
            held = False
            print(str(broken), file=out)
            continue
        signed = "signed and checked" if public_key is not None else "signatures not checked"
        before = f", {check.unchained} stored before the chain (not covered)" if check.unchained else ""
        print(f"instance {name!r}: the chain holds: {check.checked} frame(s){before}; "
              f"{len(check.checkpoints)} checkpoint(s), {signed}", file=out)
    return held


async def export(store: AuditedStore, instance: str | None, out: TextIO) -> None:
    """Per instance: a line of where its kept log begins and ends, its checkpoints, then each frame
    with its hash and the hash before it (`prev`), as JSON lines (docs/AUDIT.md)."""
    for name in await _instances(store, instance):
        pruned = await store.pruned_below(name)
        checkpoints = await store.checkpoints(name)
        _line(out, {"instance": name, "pruned_below": pruned, "last_seq": await store.last_seq(name)})
        for c in checkpoints:
            _line(out, {"checkpoint": c.to_json()})
        anchor = next((c.hash for c in checkpoints if c.seq == pruned), GENESIS) if pruned else GENESIS
        prev, after = anchor, pruned
        while True:
            page = await store.chained_frames(name, after, PAGE)
            for item in page:
                _line(out, {"frame": item.frame.to_wire(), "hash": None if item.hash is None else item.hash.hex(),
                            "prev": prev.hex()})
                prev = GENESIS if item.hash is None else item.hash
            if len(page) < PAGE:
                break
            after = page[-1].frame.seq


async def checkpoint(store: AuditedStore, instance: str | None, out: TextIO) -> None:
    """A checkpoint after each instance's last stored frame now, signed when the store has the key."""
    for name in await _instances(store, instance):
        made = await store.add_checkpoint(name)
        if made is None:
            print(f"instance {name!r}: no frame to checkpoint", file=out)
        else:
            signed = "signed" if made.signature is not None else "unsigned (no audit key)"
            print(f"instance {name!r}: checkpoint at seq {made.seq}, {signed}: {made.hash.hex()}", file=out)


def _line(out: TextIO, value: dict[str, Any]) -> None:
    out.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")
