"""Declarative policy over the agents' tool calls, in Cedar (docs/POLICY.md): the rules and their gate."""

from .gate import PolicyCheck, PolicyGate, as_declared, owner_principal
from .rules import DEFAULT_POLICIES, SCHEMA_PATH, PolicyError, PolicyRules, Ruling, ToolCall

__all__ = [
    "DEFAULT_POLICIES", "SCHEMA_PATH", "PolicyCheck", "PolicyError", "PolicyGate", "PolicyRules", "Ruling", "ToolCall",
    "as_declared", "owner_principal",
]
