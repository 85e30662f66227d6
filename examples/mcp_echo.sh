#!/bin/sh
# The reference endpoint of the action contract, docs/TOOLSETS.md (see mcp_echo.py).
exec python3 "$(dirname "$0")/mcp_echo.py" "$@"
