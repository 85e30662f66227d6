"""The store: the durable frame log on SQLite (`sqlite`) or PostgreSQL (`postgres`), the
interface both keep (`api`) and the one place a configuration picks between them (`opener`).

The bottom layer: it imports no other part of the server.
"""
