"""Testing kit for code that publishes events and for projection handlers (no relay needed).

    from outbox_relay.testing import FakeOutbox, assert_published, published
    from projections.testing import apply_projection

One module per product:

- ``published.py``: ``published(conn, key=..., type=..., topic=...)`` (``apublished`` for async
  connections), ``assert_published(conn, [("OrderPlaced", {...}), "OrderPaid"], key="order:1")``
  and ``assert_not_published``: what the test's connection can see, in the relay's order.
- ``apply_projection`` and ``aapply_projection`` live with the projections (``projections.testing``,
  ``projections.testing_async``): the engine's package does not import the projections'.
- ``recording.py``: ``RecordingSink``, a sink a real relay (``Worker``) delivers to in a test,
  recording each event (and failing the ones you say); subclass it for more bookkeeping.
- ``fake.py``: ``FakeOutbox``, an ``Outbox`` that keeps events in memory, for code tested without
  PostgreSQL. It validates exactly as ``Outbox`` does (tests/integration/test_outbox_contract.py
  runs the same scenarios against both).

- ``sink_contract.py``: ``SinkContract``, a pytest class that runs a sink (yours, or one the project
  ships) through the relay's real runner against PostgreSQL: order, retries, dead letters, holds,
  the time limit, redelivery after a crash (docs/writing-a-sink.md). Imported on first use, since it
  needs pytest and the engine.

The helpers take a psycopg connection or cursor (sync or async), a SQLAlchemy Connection or Session
(sync or async), a ``FakeOutbox``, or a list of ``PublishedEvent``. Reading needs no transaction:
unlike ``publish``, an autocommit connection is fine.
"""

from typing import TYPE_CHECKING, Any

from .fake import FakeOutbox
from .published import PublishedEvent, apublished, assert_not_published, assert_published, published
from .recording import Delivery, RecordingSink

if TYPE_CHECKING:
    from .sink_contract import SinkContract


_MOVED = {"apply_projection": "projections.testing", "aapply_projection": "projections.testing_async"}


def __getattr__(name: str) -> Any:
    if name == "SinkContract":
        from .sink_contract import SinkContract

        return SinkContract
    if name in _MOVED:
        raise AttributeError(f"{name} moved to the projections package: from {_MOVED[name]} import {name}")
    raise AttributeError(f"module 'outbox_relay.testing' has no attribute {name!r}")


__all__ = [
    "Delivery",
    "FakeOutbox",
    "PublishedEvent",
    "RecordingSink",
    "SinkContract",
    "apublished",
    "assert_not_published",
    "assert_published",
    "published",
]
