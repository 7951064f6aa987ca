"""The unit of work: the order and its event in one ``transaction.atomic()``."""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction

from outbox_relay import Published
from outbox_relay.contrib.django import publish

from .models import Order

CREDIT_LIMIT = Decimal("1000")


class CreditLimitExceeded(Exception):
    """The customer's open orders would pass the limit: the order is refused."""


def place_order(customer: str, total: Decimal) -> tuple[Order, Published]:
    with transaction.atomic():
        order = Order.objects.create(customer=customer, total=total)
        published = publish(type="OrderPlaced", key=f"order:{order.pk}",
                            payload={"customer": customer, "total": str(total)},
                            idempotency_key=f"order:{order.pk}:placed")
        # A check after the event was written: failing here rolls back the order and the event together.
        owed = sum(o.total for o in Order.objects.filter(customer=customer))
        if owed > CREDIT_LIMIT:
            raise CreditLimitExceeded(f"{customer} would owe {owed}, over the limit of {CREDIT_LIMIT}")
    return order, published
