"""``outbox-relay verify``: what reached a sink, read back, against the stored history per key.

``check.py`` (the check, sans IO: lost, reordered, phantoms, duplicates), ``stored.py`` (what the
sink should have received, from the store, in pages), ``readers.py`` (who reads a sink back, by kind),
``kafka_reader.py`` (the Kafka one), ``run.py`` (``verify``: the reads in the order that makes the
check sound on a live system).
"""

from .check import Lost, Phantom, Received, Reordered, Report, Stored
from .run import verify

__all__ = ["Lost", "Phantom", "Received", "Reordered", "Report", "Stored", "verify"]
