"""Read models kept by the relay: ``@projection`` handlers with exactly-once effects, and rebuilds.

    from projections import projection

    @projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals"])
    def apply(event, tx):
        tx.execute("INSERT INTO order_totals ... ON CONFLICT (customer) DO UPDATE ...", ...)

Run it with ``outbox-relay run --projections myapp.read_models --projection order_totals``;
rebuild it with ``outbox-relay rebuild order_totals --projections myapp.read_models``.
"""

from outbox_relay.errors import NonRetriableDelivery
from outbox_relay.upcast import Upcasters

from .declare import Projection, Registry, load_registry, projection
from .event import FenceToken, ProjectionEvent
from .fencing import fenced_upsert
from .fencing_async import fenced_upsert_async
from .sink import ProjectionSink

__all__ = [
    "FenceToken",
    "NonRetriableDelivery",
    "Projection",
    "ProjectionEvent",
    "ProjectionSink",
    "Registry",
    "Upcasters",
    "fenced_upsert",
    "fenced_upsert_async",
    "load_registry",
    "projection",
]
