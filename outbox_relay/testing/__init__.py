"""Testing kit for code that publishes events and for projection handlers (no relay needed).

    from outbox_relay.testing import FakeOutbox, apply_projection, assert_published, published

One module per product:

- ``published.py``: ``published(conn, key=..., type=..., topic=...)`` (``apublished`` for async
  connections), ``assert_published(conn, [("OrderPlaced", {...}), "OrderPaid"], key="order:1")``
  and ``assert_not_published``: what the test's connection can see, in the relay's order.
- ``projection.py``: ``apply_projection(conn, projection)`` (``aapply_projection``): the
  projection's handler run in the test's transaction over events published in it, by the relay's
  own batch walk (projections/walk.py), each ``ProjectionEvent`` built as the relay builds it.
- ``recording.py``: ``RecordingSink``, a sink a real relay (``Worker``) delivers to in a test,
  recording each event (and failing the ones you say); subclass it for more bookkeeping.
- ``fake.py``: ``FakeOutbox``, an ``Outbox`` that keeps events in memory, for code tested without
  PostgreSQL. It validates exactly as ``Outbox`` does (tests/integration/test_outbox_contract.py
  runs the same scenarios against both).

(A sink-contract suite for user-written sinks joins the package as one more module.)

The helpers take a psycopg connection or cursor (sync or async), a SQLAlchemy Connection or Session
(sync or async), a ``FakeOutbox``, or a list of ``PublishedEvent``. Reading needs no transaction:
unlike ``publish``, an autocommit connection is fine.
"""

from .fake import FakeOutbox
from .projection import aapply_projection, apply_projection
from .published import PublishedEvent, apublished, assert_not_published, assert_published, published
from .recording import Delivery, RecordingSink

__all__ = [
    "Delivery",
    "FakeOutbox",
    "PublishedEvent",
    "RecordingSink",
    "aapply_projection",
    "apply_projection",
    "apublished",
    "assert_not_published",
    "assert_published",
    "published",
]
