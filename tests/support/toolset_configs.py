"""Helpers of tests/e2e/test_toolsets.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mcp_types as types

from harness import Deployment
from oubliette_server.core.auth import TokenAuthority


def toml_value(value: Any) -> str:
    """A TOML literal for a string, number, list of strings, or a table of strings (JSON's syntax fits)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def write_config(
    deployment: Deployment,
    toolsets: dict[str, dict[str, Any]],
    allowlists: dict[str, list[str]],
    separator: str | None = None,
) -> Path:
    lines: list[str] = []
    if separator is not None:
        lines += ["[server]", f"tool_separator = {toml_value(separator)}", ""]
    for toolset_id, table in toolsets.items():
        lines.append(f"[toolsets.{json.dumps(toolset_id)}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
        lines.append("")
    lines.append("[allowlists]")
    lines += [f"{json.dumps(instance)} = {toml_value(ids)}" for instance, ids in allowlists.items()]
    path = deployment.root / "toolsets.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def agent_token(deployment: Deployment, instance: str) -> str:
    """The instance's token, from the secret the running server keeps in its data directory."""
    return TokenAuthority.for_data_dir(deployment.data_dir).token_for(instance)


def tool_names(listing: types.ListToolsResult) -> set[str]:
    """The relayed tools listed (without the client's built-in `permission_prompt`, tests/server/features/test_connection_approvals.py)."""
    return {tool.name for tool in listing.tools} - {"permission_prompt"}
