#!/bin/sh
# The reference action-contract endpoint of seed 001 (see mcp_echo.py).
exec python3 "$(dirname "$0")/mcp_echo.py" "$@"
