"""Declarative policy over the agents' tool calls and the HTTP principals' requests, in Cedar
(docs/POLICY.md): the rules and their gate."""

from .gate import PolicyCheck, PolicyGate, as_declared, owner_principal
from .rules import ADMIN, CALLER_ACTIONS, DEFAULT_POLICIES, OPERATE, SCHEMA_PATH, PolicyError, PolicyRules, Ruling, ToolCall

__all__ = [
    "ADMIN", "CALLER_ACTIONS", "DEFAULT_POLICIES", "OPERATE", "SCHEMA_PATH", "PolicyCheck", "PolicyError", "PolicyGate", "PolicyRules", "Ruling", "ToolCall",
    "as_declared", "owner_principal",
]
