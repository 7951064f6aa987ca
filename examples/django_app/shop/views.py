"""POST /orders {"customer": ..., "total": ...}: 201 with the order and its event, 422 when refused."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from .services import CreditLimitExceeded, place_order


@require_POST
def orders(request: HttpRequest) -> JsonResponse:
    try:
        body = json.loads(request.body)
        customer, total = str(body["customer"]), Decimal(str(body["total"]))
    except (ValueError, KeyError, TypeError, InvalidOperation):
        return JsonResponse({"error": 'expected {"customer": str, "total": number}'}, status=400)
    try:
        order, published = place_order(customer, total)
    except CreditLimitExceeded as exc:
        return JsonResponse({"error": str(exc)}, status=422)
    return JsonResponse({"order": order.pk, "event": str(published.id)}, status=201)
