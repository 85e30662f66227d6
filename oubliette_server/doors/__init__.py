"""The doors: how callers, guests and operators reach the server — the relay socket (`relay`),
the caller's MCP server over stdio and Streamable HTTP (`caller_api`, `http_api`), health and
the limits every connection is checked against.

Doors translate: they check what a peer sent and call a feature service; no rule of the
product is decided here.
"""
