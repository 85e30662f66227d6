"""The features: what the server does for a session — turns, the tether, caller tool relay,
host toolsets, guests, approvals — and `cluster`, what several servers on one store do together.

Features use the core services and the store, never the doors above them.
"""
