"""Integrations with frameworks, each importable only when its framework is installed.

- ``outbox_relay.contrib.sqlalchemy``: events recorded on an ORM session are written by its flushes,
  in its transaction (the ``outbox-relay[sqlalchemy]`` extra).
"""
