"""Helpers of tests/server/features/test_approval_elicitation.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import sys
from pathlib import Path

from harness import Deployment


def forms_config(deployment: Deployment) -> Path:
    server = Path(__file__).with_name("elicit_toolset_server.py")
    path = deployment.root / "forms.toml"
    path.write_text(
        '[instances.box1]\n'
        f'[toolsets.forms]\nkind = "mcp"\nprefix = "forms"\ncommand = "{sys.executable}"\nargs = ["{server}"]\n'
        '[allowlists]\nbox1 = ["forms"]\n'
    )
    return path
