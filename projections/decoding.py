"""A stored event's text columns as its handler gets them: the payload decoded from JSON (fast), the
headers as a JSON object of strings, or the non-retriable failure that says why they can not be. One home
for both readers: ``Projection.prepare`` (declare.py: live processing, key rebuilds) and bulk rebuilds
(bulk.py)."""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from typing import Any

from outbox_relay.dsn import describe_error
from outbox_relay.sinks.engine import Failure

# The C scanner json.loads uses, with its settings (typeshed types the decoder it takes too narrowly).
_SCAN_JSON = json.scanner.make_scanner(json.decoder.JSONDecoder())  # type: ignore[arg-type]


def decode_json(text: str) -> Any:
    """``json.loads(text)``, in about half the time for the text PostgreSQL prints a jsonb as.

    ``json.loads`` wraps the C scanner in Python (whitespace skipping, an end check) that costs as
    much as scanning a small payload; a rebuild decodes every stored payload. Anything but one JSON
    value with no whitespace around it goes to ``json.loads``, which decodes it or raises its own error."""
    try:
        value, end = _SCAN_JSON(text, 0)
    except StopIteration:  # not a value at 0 (leading whitespace, or not JSON)
        return json.loads(text)
    if end != len(text):  # trailing whitespace or extra data
        return json.loads(text)
    return value


_JSON_KINDS = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def _json_kind(value: Any) -> str:
    return "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)


def decode_headers(text: str) -> dict[str, str] | Failure:
    """An event's headers as the handler gets them, or why they can not be (a JSON object of strings)."""
    if text == "{}":
        return {}
    try:
        value = decode_json(text)
    except (ValueError, RecursionError) as exc:
        return Failure(f"the event's headers can not be decoded: {describe_error(exc)}", retriable=False)
    if not isinstance(value, dict):
        return Failure(f"the event's headers must be a JSON object of strings, not a JSON {_json_kind(value)}",
                       retriable=False)
    for name, v in value.items():
        if not isinstance(v, str):
            return Failure(f"the event's headers must be a JSON object of strings: the value of {name[:200]!r} "
                           f"is a JSON {_json_kind(v)}", retriable=False)
    return value
