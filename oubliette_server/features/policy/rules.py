"""A deployment's policy set, parsed and validated once, and the decisions it makes: on one
agent's tool call, and on one HTTP principal's request (which instances it may message, answer
and read, which operator endpoints it may use).

The policies are Cedar (docs/POLICY.md), evaluated by `cedarpy` (the Cedar project's engine):
this module only builds the request and reads the answer. The request is fixed by
`schema.cedarschema` beside this file: principal the agent (`Oubliette::Agent`), action
`call_tool`, resource the tool (`Oubliette::Tool`, in its `Caller` or `Toolset`), and the call in
`context`. A `PolicyRules` is immutable: a reload builds a new one and swaps it (gate.py), so a
call in flight keeps the set it was decided by.

What a decision means here, beside Cedar's allow or deny:

- a permit policy annotated `@requireApproval` that decides an allowed call sends it to the
  session owner's approval first; so does the tool's own `requires_approval` flag, always (a
  deployment's policy may add an approval or forbid a call, never drop the approval a tool's
  owner asked for);
- a forbid's `@reason("...")` is what the agent is told; a denial with no forbid says no policy
  permits the tool;
- a forbid policy that fails to evaluate (an argument of another type than the policy expects)
  forbids the call: Cedar skips a policy in error, and a forbid skipped so would let the call run.

A principal's request (`PolicyRules.permits`) depends on nothing but (principal, action,
resource), so its answer is kept for the life of the set: a caller's request costs a dict lookup
after the first. So is a tool call's ruling when the policies that can apply to the tool (their
resource scope admits it) read neither `context.arguments` nor `context` whole: it then depends
only on the call's facts other than its arguments and on the parts of `context.time` they read,
which are its key (`_Policy.reads`, `PolicyRules.decide`). Every set carries `ADMIN_PERMIT`: the HTTP admin may do everything unless a
forbid says otherwise; any other principal only what a policy permits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, TypeVar

import attrs
import cedarpy
from cedarpy import pst

from ...core.ids import ADMIN_PRINCIPAL

SCHEMA_PATH = Path(__file__).with_name("schema.cedarschema")
ACTION = {"type": "Oubliette::Action", "id": "call_tool"}
REQUIRE_APPROVAL = "requireApproval"
REASON = "reason"

DEFAULT_POLICIES = """\
// Every tool call runs; a tool whose owner set requires_approval waits for the approval.
@id("default-permit")
permit(principal, action == Oubliette::Action::"call_tool", resource);
"""
"""The policy set of a server given no policy file: today's behaviour, as policy."""
_DEFAULT_IDS = ("default-permit",)

ADMIN = ADMIN_PRINCIPAL
"""The principal of the HTTP admin token (`oubliette-server http-token`), of a stdio caller and of
a Unix socket listener (file access is its credential)."""
CALLER_ACTIONS = ("message", "answer", "read")
"""What a principal does to an instance (resource `Oubliette::Instance`)."""
OPERATE = "operate"
"""A principal's use of an operator endpoint (resource `Oubliette::Endpoint`: "metrics", "health")."""
ADMIN_PERMIT = f"""
@id("admin-may-do-everything")
permit(principal == Oubliette::Principal::"{ADMIN}", action in [
  Oubliette::Action::"message", Oubliette::Action::"answer", Oubliette::Action::"read", Oubliette::Action::"{OPERATE}"
], resource);
"""
"""Added to every set for principals' requests (after the deployment's policies, so their
`policy0`... names stay): the admin token keeps reaching everything; a forbid still binds it."""
_DECISIONS_KEPT = 100_000
"""Principals' decisions a set keeps (then it starts over): a few principals times every instance.
So many tool calls' rulings too: sessions times tools."""
ARGUMENTS, TIME = "arguments", "time"
TIME_PARTS = ("hour", "minute", "weekday", "unix")
"""`context.time`'s attributes (`_time_of`)."""
_CONTEXT = pst.Var("context")
_TOOL = pst.EntityType("Tool", ("Oubliette",))

Effect = Literal["permit", "approval", "forbid"]

_ERRORED_POLICY = re.compile(r"policy `([^`]+)`")


class PolicyError(ValueError):
    """A policy set that cannot be used: a parse error, a schema violation, a misplaced annotation."""


@functools.cache
def schema() -> cedarpy.Schema:
    """The shipped schema, parsed once."""
    return cedarpy.Schema.from_str(SCHEMA_PATH.read_text())


@attrs.frozen
class ToolCall:
    """The facts of one agent's tool call, as the Cedar request carries them."""

    instance: str
    session: str
    """`channel:id`, or "" for a client bound to no session."""
    tool: str
    """The published name the agent called."""
    kind: Literal["caller", "toolset"]
    owner: str
    """The declaring caller's id (caller tools) or the toolset's id."""
    arguments: dict[str, Any]
    requires_approval: bool = False
    """The tool's own flag (the caller's declaration, the toolset's registration)."""
    caller_principal: str = ""
    """The identity of the session's owning caller, "" when none."""

    @property
    def declared_approval(self) -> tuple[str, ...]:
        """What asks for an approval whatever the policies say: the tool's own flag, if set."""
        return ("requires_approval",) if self.requires_approval else ()

    def request(self, now: float, keys: frozenset[str] | None = None) -> dict[str, Any]:
        """The Cedar request of this call at `now` (seconds since the epoch), its context limited
        to `keys` when given (what the policies read: Cedar parses the whole context of every
        request, and most sets read a few of its attributes)."""
        agent = f"{self.instance}/{self.session}" if self.session else self.instance
        return {
            "principal": {"type": "Oubliette::Agent", "id": agent},
            "action": ACTION,
            "resource": {"type": "Oubliette::Tool", "id": self.tool},
            "context": self.context(now, keys),
        }

    def context(self, now: float, keys: frozenset[str] | None = None) -> dict[str, Any]:
        """The request's `context`: every attribute of the schema, or those of `keys` (the local
        time is computed only when a policy reads it)."""
        facts: dict[str, Callable[[], Any]] = {
            "instance": lambda: self.instance, "session": lambda: self.session,
            "caller_id": lambda: self.owner if self.kind == "caller" else "",
            "caller_principal": lambda: self.caller_principal,
            "tool": lambda: self.tool, "kind": lambda: self.kind,
            "toolset": lambda: self.owner if self.kind == "toolset" else "",
            "requires_approval": lambda: self.requires_approval,
            "arguments": lambda: self.arguments,
            "time": lambda: _time_of(now),
        }
        return {key: fact() for key, fact in facts.items() if keys is None or key in keys}


def _time_of(now: float) -> dict[str, int]:
    """`context.time` at `now`, in the server's local time."""
    local = time.localtime(now)
    return {"hour": local.tm_hour, "minute": local.tm_min, "weekday": local.tm_wday + 1, "unix": int(now)}


@functools.lru_cache(maxsize=4096)
def _tool_entities(tool: str, kind: str, owner: str) -> cedarpy.Entities:
    """The tool as an entity in its caller or toolset (so `resource in Oubliette::Toolset::"fs"`
    holds), parsed once per tool."""
    parent = {"type": "Oubliette::Caller" if kind == "caller" else "Oubliette::Toolset", "id": owner}
    return cedarpy.Entities.from_json_str(json.dumps([
        {"uid": {"type": "Oubliette::Tool", "id": tool}, "attrs": {}, "parents": [parent]},
        {"uid": parent, "attrs": {}, "parents": []},
    ]))


_NO_ENTITIES = cedarpy.Entities.from_json_str("[]")
"""A principal's request needs no entity data: its policies name principals and instances by id."""


@attrs.frozen
class Ruling:
    """What the policies decided for one call."""

    effect: Effect
    policies: tuple[str, ...]
    """The deciding policies: their `@id`, else Cedar's position id (`policy0`, ...)."""
    reason: str = ""
    """Why a call is forbidden (a forbid's `@reason`), for the agent."""
    approval_by: tuple[str, ...] = ()
    """What asks for the approval: `@requireApproval` policies' ids, `requires_approval` for the tool's flag."""
    stored: bool = False
    """Already stored in a `policy_decision` frame of its own (gate.py): the call's request frame carries nothing."""

    @property
    def record(self) -> dict[str, Any]:
        """The ruling as a frame's payload and a log line's fields."""
        record: dict[str, Any] = {"effect": self.effect, "policies": list(self.policies)}
        if self.reason:
            record["reason"] = self.reason
        if self.approval_by:
            record["approval_by"] = list(self.approval_by)
        return record

    @property
    def to_carry(self) -> dict[str, Any] | None:
        """What the call's request frame carries under `POLICY_KEY` (core/server_owned.py): the record, unless stored already."""
        return None if self.stored else self.record


_DEFAULT_PERMIT = Ruling("permit", _DEFAULT_IDS)
_DEFAULT_APPROVAL = Ruling("approval", _DEFAULT_IDS, approval_by=("requires_approval",))
"""The default policy's two rulings: a call, and a call of a tool whose own flag asks for an approval."""


@attrs.frozen
class _Policy:
    name: str
    effect: str
    annotations: dict[str, str]
    resource: Any = pst.ScopeAny()
    """The policy's resource scope: which tools it can apply to (`may_apply`)."""
    reads: frozenset[str] | None = frozenset()
    """The `context` attributes its conditions read (None: `context` whole)."""
    time_parts: frozenset[str] = frozenset()
    """The parts of `context.time` they read (`TIME_PARTS`)."""

    def may_apply(self, tool: pst.EntityUid, parent: pst.EntityUid) -> bool:
        """Whether the resource scope admits `tool` (a member of `parent`), as Cedar matches it: a
        policy it does not admit is false for that tool whatever its conditions (Cedar evaluates
        the scope first and stops there)."""
        scope = self.resource
        if isinstance(scope, pst.ScopeEq):
            return scope.entity == tool
        if isinstance(scope, pst.ScopeIn):
            return scope.entity in (tool, parent)
        if isinstance(scope, pst.ScopeIs):
            return scope.entity_type == _TOOL
        if isinstance(scope, pst.ScopeIsIn):
            return scope.entity_type == _TOOL and scope.entity in (tool, parent)
        return True  # any resource, or a scope this code does not know: it may apply


@attrs.frozen
class PolicyRules:
    """A validated policy set, ready to decide. Immutable; build it with `load`.

    Raises: `PolicyError` from `load` for a set that cannot be used; `decide` raises nothing
    for a call (an evaluation problem is a denial with the reason).
    """

    source: str
    """Where the set came from (its files, or "the default policy")."""
    _set: cedarpy.PolicySet
    _policies: dict[str, _Policy]
    _context_keys: frozenset[str] | None
    """The context attributes the policies read (None: all, a policy reads `context` whole)."""
    _principals_set: cedarpy.PolicySet
    """The set with `ADMIN_PERMIT`, for principals' requests."""
    _decisions: dict[tuple[str, str, str], str | None] = attrs.field(factory=dict, init=False, eq=False)
    """(principal, action, resource) -> None (permitted) or why not: the set never changes."""
    _permits_all: bool = False
    """The default policy (no policy file): its one permit decides every call without asking Cedar."""
    _keys: dict[tuple[str, str, str], tuple[str, ...] | None] = attrs.field(factory=dict, init=False, eq=False)
    """(tool, kind, owner) -> the parts of `context.time` its rulings are kept by, or None: every
    call of the tool goes to Cedar (a policy that may apply reads its arguments or `context` whole)."""
    _rulings: dict[tuple[Any, ...], Ruling] = attrs.field(factory=dict, init=False, eq=False)
    """A tool call's facts but its arguments, and those time parts -> the ruling: the set never changes."""

    @classmethod
    def load(cls, text: str, source: str) -> PolicyRules:
        """Parse and validate `text` against the shipped schema."""
        try:
            policy_set = cedarpy.PolicySet.from_str(text)
            parsed = policy_set.to_pst()
        except ValueError as exc:
            raise PolicyError(f"{source}: {_one_line(str(exc))}") from None
        if parsed.templates:
            raise PolicyError(f"{source}: templates (?principal, ?resource) are not supported")
        result = cedarpy.validate_policies(text, schema())
        if not result.validation_passed:
            names = result.id_annotations_by_policy_id
            problems = [
                f"{names.get(e.policy_id) or e.policy_id}: {e.error}" if e.policy_id else e.error for e in result.errors
            ]
            raise PolicyError(f"{source}: {'; '.join(_one_line(p) for p in problems)}")
        policies = {
            key: _Policy(
                dict(template.annotations).get("id") or key, template.effect, dict(template.annotations),
                template.resource, *_reads(template),
            )
            for key, template in parsed.static_policies.items()
        }
        for policy in policies.values():
            if policy.effect == "forbid" and REQUIRE_APPROVAL in policy.annotations:
                raise PolicyError(f"{source}: {policy.name}: @{REQUIRE_APPROVAL} belongs on a permit policy, not a forbid")
        principals_set = cedarpy.PolicySet.from_str(text + ADMIN_PERMIT)
        read = [policy.reads for policy in policies.values() if policy.reads is not None]
        context_keys = frozenset().union(*read) if len(read) == len(policies) else None
        return cls(source, policy_set, policies, context_keys, principals_set)

    @classmethod
    def default(cls) -> PolicyRules:
        """The policy of a server without a policy file: every call runs, gated as its tool asks."""
        return attrs.evolve(cls.load(DEFAULT_POLICIES, "the default policy"), permits_all=True)

    @classmethod
    def from_files(cls, paths: Iterable[Path]) -> PolicyRules:
        """The policies of `paths`, read and validated as one set. Raises: `PolicyError` (an
        unreadable file too)."""
        paths = list(paths)
        texts = []
        for path in paths:
            try:
                texts.append(path.read_text())
            except (OSError, UnicodeDecodeError) as exc:
                raise PolicyError(f"cannot read policy file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        return cls.load("\n".join(texts), ", ".join(str(p) for p in paths))

    def __len__(self) -> int:
        return len(self._policies)

    def decide(self, call: ToolCall, now: float) -> Ruling:
        """The policies' ruling on `call` made at `now` (seconds since the epoch).

        The default policy's ruling is known without Cedar (its one permit applies to every
        call): it is still the decision, recorded with that policy's id. Otherwise Cedar decides
        a call once per set and key (the module's docstring), a call whose arguments or whole
        context a policy may read every time."""
        if self._permits_all:
            return _DEFAULT_APPROVAL if call.requires_approval else _DEFAULT_PERMIT
        tool = (call.tool, call.kind, call.owner)
        parts = _kept(self._keys, tool, lambda: self._time_key(call))
        if parts is None:
            return self._evaluate(call, now)
        key: tuple[Any, ...] = (call.instance, call.session, *tool, call.requires_approval, call.caller_principal)
        if parts:
            when = _time_of(now)
            key += tuple(when[part] for part in parts)
        return _kept(self._rulings, key, lambda: self._evaluate(call, now))

    def _time_key(self, call: ToolCall) -> tuple[str, ...] | None:
        """The parts of `context.time` the policies that may apply to the call's tool read (in
        `TIME_PARTS` order), or None when one reads its arguments or `context` whole."""
        tool = pst.EntityUid(_TOOL, call.tool)
        parent = pst.EntityUid(pst.EntityType("Caller" if call.kind == "caller" else "Toolset", ("Oubliette",)), call.owner)
        parts: set[str] = set()
        for policy in self._policies.values():
            if not policy.may_apply(tool, parent):
                continue
            if policy.reads is None or ARGUMENTS in policy.reads:
                return None
            parts |= policy.time_parts
        return tuple(part for part in TIME_PARTS if part in parts)

    def _evaluate(self, call: ToolCall, now: float) -> Ruling:
        """Cedar's ruling on `call` at `now`."""
        answer = cedarpy.is_authorized(
            call.request(now, self._context_keys), self._set, _tool_entities(call.tool, call.kind, call.owner),
        )
        diagnostics = answer.diagnostics
        failed = self._failed_forbids(diagnostics.errors)
        if failed:
            return Ruling("forbid", tuple(p.name for p, _ in failed), "; ".join(
                f"policy {p.name} could not be evaluated ({why})" for p, why in failed))
        reasons = set(diagnostics.reasons)
        deciding = [policy for key, policy in self._policies.items() if key in reasons]  # in the set's order
        names = tuple(p.name for p in deciding)
        if not answer.allowed:
            if not deciding:
                return Ruling("forbid", (), f"no policy permits '{call.tool}'")
            why = [p.annotations.get(REASON) or f"forbidden by policy {p.name}" for p in deciding]
            return Ruling("forbid", names, "; ".join(dict.fromkeys(why)))
        approval_by = tuple(p.name for p in deciding if REQUIRE_APPROVAL in p.annotations) + call.declared_approval
        return Ruling("approval" if approval_by else "permit", names, approval_by=approval_by)

    def permits(self, principal: str, action: str, resource: str) -> str | None:
        """None when the policies let `principal` do `action` (`message`, `answer`, `read` an
        instance; `operate` an endpoint) to `resource`, else why not (a forbid's `@reason`, or
        that no policy permits it). Decided once per set: the request carries nothing else."""
        return _kept(self._decisions, (principal, action, resource), lambda: self._ask_permits(principal, action, resource))

    def _ask_permits(self, principal: str, action: str, resource: str) -> str | None:
        """Cedar's answer to `permits`."""
        kind, attribute = ("Endpoint", "endpoint") if action == OPERATE else ("Instance", "instance")
        answer = cedarpy.is_authorized({
            "principal": {"type": "Oubliette::Principal", "id": principal},
            "action": {"type": "Oubliette::Action", "id": action},
            "resource": {"type": f"Oubliette::{kind}", "id": resource},
            "context": {attribute: resource},
        }, self._principals_set, _NO_ENTITIES)
        reason = None
        if not answer.allowed:
            reasons = set(answer.diagnostics.reasons)
            why = [p.annotations.get(REASON) or f"forbidden by policy {p.name}"
                   for key_, p in self._policies.items() if key_ in reasons]
            reason = "; ".join(dict.fromkeys(why)) or "no policy permits it"
            if answer.diagnostics.errors:
                reason += f" ({_one_line('; '.join(answer.diagnostics.errors))})"
        return reason

    def _failed_forbids(self, errors: list[str]) -> list[tuple[_Policy, str]]:
        """The forbid policies among those Cedar could not evaluate, with its message (an error
        that names no policy of the set counts as a forbid's: it fails closed)."""
        failed = []
        for error in errors:
            match = _ERRORED_POLICY.search(error)
            policy = self._policies.get(match.group(1)) if match else None
            if policy is None:
                policy = _Policy(match.group(1) if match else "(unknown)", "forbid", {})
            if policy.effect == "forbid":
                failed.append((policy, _one_line(error.split(": ", 1)[-1])))
        return failed


_K = TypeVar("_K")
_V = TypeVar("_V")
_MISSING: Any = object()


def _kept(memo: dict[_K, _V], key: _K, decide: Callable[[], _V]) -> _V:
    """`memo[key]`, decided by `decide` the first time and kept (a set never changes, nor do its
    answers); a memo grown to `_DECISIONS_KEPT` entries starts over."""
    value = memo.get(key, _MISSING)
    if value is _MISSING:
        if len(memo) >= _DECISIONS_KEPT:
            memo.clear()
        value = memo[key] = decide()
    return value


def _reads(policy: pst.Template) -> tuple[frozenset[str] | None, frozenset[str]]:
    """What of `context` a policy's conditions read: its attributes (`context.x`, `context has x`),
    or None when it uses `context` otherwise (whole: every attribute must be there); and the parts
    of `context.time` (`context.time.hour`; `context.time` used otherwise: all of them)."""
    keys: set[str] = set()
    parts: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, pst.GetAttr) and node.base == pst.GetAttr(_CONTEXT, TIME) and node.attr in TIME_PARTS:
            keys.add(TIME)
            parts.add(node.attr)
            return True
        if isinstance(node, (pst.GetAttr, pst.HasAttr)) and node.base == _CONTEXT:
            key = node.attr if isinstance(node, pst.GetAttr) else node.attrs[0]
            keys.add(key)
            if key == TIME:
                parts.update(TIME_PARTS)
            return True
        if node == _CONTEXT:
            return False
        if dataclasses.is_dataclass(node):
            return all(visit(getattr(node, field.name)) for field in dataclasses.fields(node))
        if isinstance(node, (tuple, list)):
            return all(visit(item) for item in node)
        if isinstance(node, Mapping):
            return all(visit(value) for value in node.values())
        return True

    if not visit(policy.clauses):
        return None, frozenset(TIME_PARTS)
    return frozenset(keys), frozenset(parts)


def _one_line(text: str) -> str:
    return " ".join(text.split())
