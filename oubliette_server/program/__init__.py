"""The program: its command line, its configuration, and the one place every service is built and wired (`app`).

The top layer (docs/ARCHITECTURE.md): it may import every layer below — doors, features, core
services, store — and nothing imports it but `oubliette_server/__init__.py` (the embedding API).
"""
