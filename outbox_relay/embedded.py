"""The first name of ``outbox_relay.private_servers`` (the CHANGELOG and users' code import it from here).

New code imports ``outbox_relay.private_servers``; this module only keeps the announced import path working.
"""

from .private_servers import EmbeddedKafka, EmbeddedPostgres, EmbeddedUnavailable, free_port

__all__ = ["EmbeddedKafka", "EmbeddedPostgres", "EmbeddedUnavailable", "free_port"]
