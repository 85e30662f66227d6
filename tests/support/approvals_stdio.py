"""Helpers of tests/e2e/test_approvals.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

DELETE = {
    "name": "delete_file",
    "description": "Delete a file on the host",
    "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    "requires_approval": True,
}
