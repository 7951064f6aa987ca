"""What JetStream holds for a NATS sink: ``read_back(fields)`` -> ``[(event id, partition key, subject), ...]``.

Every message under the sink's subjects (``<prefix>.>``, or ``<prefix>.<topic>.*`` per topic asked for), from
every stream that takes them, in stream order (one stream: the order the server stored them in). Read by an
ephemeral consumer that acknowledges nothing (``AckPolicy.NONE``) and is deleted afterwards: nothing is
consumed on a limits or interest stream; a work-queue stream refuses such a consumer, and ``read_back`` says so.
Messages without a ``Nats-Msg-Id`` that is a UUID (not the relay's) are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from .connection import ConnectOptions, check_url, client_library, read_secret
from .message import MSG_ID
from .subjects import topic_filter

if TYPE_CHECKING:
    from ...nats_settings import NatsFields

FETCH = 512  # messages per fetch


def read_back(fields: NatsFields, *, topics: Collection[str] | None = None,
              timeout_seconds: float = 5.0) -> list[tuple[uuid.UUID, str, str]]:
    """(event id, partition key, subject) of every message the streams hold for the sink ``fields`` describe."""
    if not fields.nats_url:
        raise ConfigurationError("no NATS URL: pass --nats-url or set OUTBOX_NATS_URL")
    options = ConnectOptions(
        check_url(fields.nats_url), user=fields.nats_user,
        password=(read_secret(fields.nats_password_file, "password") if fields.nats_password_file
                  else fields.nats_password.get_secret_value() if fields.nats_password else None),
        token=(read_secret(fields.nats_token_file, "token") if fields.nats_token_file
               else fields.nats_token.get_secret_value() if fields.nats_token else None),
        creds_file=fields.nats_creds_file, nkey_seed_file=fields.nats_nkey_seed_file, ca_file=fields.nats_ca_file,
        client_cert=fields.nats_client_cert, client_key=fields.nats_client_key, tls_verify=fields.nats_tls_verify,
        connect_timeout_seconds=min(fields.nats_connect_timeout_seconds, timeout_seconds))
    filters = ([topic_filter(fields.nats_subject_prefix)] if topics is None
               else [topic_filter(fields.nats_subject_prefix, t) for t in sorted(topics)])
    return asyncio.run(_read(options, fields.nats_stream, filters, timeout_seconds))


async def _read(options: ConnectOptions, stream: str | None, filters: list[str],
                timeout: float) -> list[tuple[uuid.UUID, str, str]]:
    nats = client_library()
    api = nats.js.api
    args = options.arguments()
    args["max_reconnect_attempts"] = 0
    nc = await nats.connect(**args)
    try:
        js = nc.jetstream(timeout=timeout)
        found: list[tuple[uuid.UUID, str, str]] = []
        for subject in filters:
            streams = [stream] if stream else await _streams(nc, subject, timeout)
            for name in streams:
                found.extend(await _read_stream(js, api, name, subject, timeout))
        return found
    finally:
        await nc.close()


async def _streams(nc: Any, subject: str, timeout: float) -> list[str]:
    """The streams whose subjects overlap ``subject`` (JetStream's STREAM.NAMES request)."""
    reply = await nc.request("$JS.API.STREAM.NAMES", json.dumps({"subject": subject}).encode(), timeout=timeout)
    answer = json.loads(reply.data)
    if "error" in answer:
        raise ConfigurationError(f"nats: can not list the streams of {subject}: {answer['error']}")
    return sorted(answer.get("streams") or [])


async def _read_stream(js: Any, api: Any, stream: str, subject: str,
                       timeout: float) -> list[tuple[uuid.UUID, str, str]]:
    config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
                                filter_subject=subject, inactive_threshold=max(timeout * 4, 30.0), mem_storage=True)
    try:
        sub = await js.pull_subscribe(subject, stream=stream, config=config)
    except client_library().js.errors.APIError as exc:
        raise ConfigurationError(f"nats: can not read stream {stream!r} without consuming it: "
                                 f"{getattr(exc, 'description', None) or exc}") from None
    found: list[tuple[uuid.UUID, str, str]] = []
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        while pending > 0:
            for msg in await sub.fetch(min(pending, FETCH), timeout=timeout):
                pending = msg.metadata.num_pending
                event = _event(msg)
                if event is not None:
                    found.append(event)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, (await sub.consumer_info()).name)
    return found


def _event(msg: Any) -> tuple[uuid.UUID, str, str] | None:
    headers = msg.headers or {}
    try:
        event_id = uuid.UUID(headers.get(MSG_ID, ""))
    except ValueError:
        return None
    key = urllib.parse.unquote(headers.get("ce-partitionkey", ""))
    return event_id, key, str(msg.subject)


__all__ = ["read_back"]
