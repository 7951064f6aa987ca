"""The parts of a relay process that ``worker.Worker`` composes, one per file.

Services, each a thread with ``start`` / ``stop`` / ``join`` (River's ``internal/maintenance`` keeps one
per file the same way):

- ``membership.py``: ``Membership``, heartbeats, each sink's stored assignment -> each runner's
  ``desired`` buckets, lease renewal.
- ``housekeeper.py``: ``Housekeeper``, claims a housekeeping pass (housekeeping.py) every interval.
- ``listener.py``: ``Listener``, LISTEN for wake-ups; on one relay per deployment it also watches for
  commits (wakeups.py).
- ``signals.py``: ``SignalWatch``, SIGTERM/SIGINT for ``outbox-relay run``.

What they share, each in its own file: ``pool.py`` (the relay's connection pool, opened when the
database is there), ``registration.py`` (this relay's entry in ``outbox.workers``) and ``wake.py``
(waking the sink runners). Arrows run one way: worker -> services -> relay, store.
"""
