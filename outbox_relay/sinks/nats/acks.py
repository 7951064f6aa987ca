"""JetStream publishes and their PubAcks over one reply subscription per client.

``js.publish()`` makes each publish a request: a fresh inbox token, a future, an ``asyncio.wait_for`` task and a
``PubAck`` dataclass per call. Here a client has one wildcard subscription (``<inbox>.*``); a publish gets the
next token of a counter, one future in a dict keyed by that token and one timer (``call_later``) for its time
limit, and the reply is parsed once (``json.loads``). What a reply means is the server's, as for
``js.publish()``: a ``503`` status (no responders: no stream takes the subject), a JSON ``error`` (a JetStream
API error), or a PubAck (``duplicate`` too).

The HPUB command is written here too, when the client has the parts nats-py 2.x builds its own from
(``_send_command``, ``_flush_pending``, ``_flush_queue``): its ``publish`` encodes each header on its own
(strip, a regular expression, an ``encode`` per name and per value), a fifth of the relay's interpreter time
per event; here the header block is one ``join`` and one ``encode``. The names were checked by ``Messages``
with the client's own pattern, and values are stripped as the client strips them. The checks the client's
``publish`` makes come first, with its errors. A client without those parts is published to through its
``publish``.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

NO_RESPONDERS = "503"  # the status of the server's reply when no stream (no subscriber) takes the subject


class NoStream(Exception):
    """No stream takes the subject (the server's no-responders reply)."""


class JetStreamError(NamedTuple):
    """A JetStream API error a publish was answered with."""

    code: int | None
    err_code: int | None
    description: str


class Acks:
    """The PubAcks of one client's publishes, each call waiting for its own. Used only on the client's loop."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox() + "."
        self._skip = len(self._prefix)
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._next = 0
        self._raw = all(hasattr(nc, name) for name in ("_send_command", "_flush_pending", "_flush_queue", "stats"))
        import nats.errors

        self._errors = nats.errors

    async def start(self) -> Acks:
        await self._nc.subscribe(self._prefix + "*", cb=self._reply)
        return self

    async def _reply(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject[self._skip:], None)
        if future is not None and not future.done():
            future.set_result(msg)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str],
                      timeout: float) -> JetStreamError | None:
        """Publish and wait for the stream's answer: None for a PubAck, the JetStream error otherwise. Raises
        NoStream, TimeoutError (no answer within ``timeout`` seconds) or what the client's publish raises."""
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            if self._raw:
                await self._send(subject, self._prefix + token, payload, headers)
            else:
                await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
            msg = await future
        finally:
            timer.cancel()
            self._waiting.pop(token, None)
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise NoStream
        answer: Any = json.loads(msg.data)
        error = answer.get("error") if isinstance(answer, dict) else None
        if error is None:
            return None
        return JetStreamError(error.get("code"), error.get("err_code"), str(error.get("description") or error))


    async def _send(self, subject: str, reply: str, payload: bytes, headers: dict[str, str]) -> None:
        """What the client's ``publish`` does with a message of these headers (the sink's connection buffers
        nothing while it is not connected: ``pending_size=0``)."""
        nc, errors = self._nc, self._errors
        if nc.is_closed:
            raise errors.ConnectionClosedError
        if nc.is_draining_pubs:
            raise errors.ConnectionDrainingError
        if not nc.is_connected:
            raise errors.OutboundBufferLimitError
        if len(payload) > nc.max_payload:
            raise errors.MaxPayloadError
        block = ("NATS/1.0\r\n" + "".join([f"{k}: {v.strip()}\r\n" for k, v in headers.items()]) + "\r\n").encode()
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += len(payload)
        line = f"HPUB {subject} {reply} {len(block)} {len(block) + len(payload)}\r\n".encode()
        await nc._send_command(b"".join((line, block, payload, b"\r\n")))
        if nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


__all__ = ["Acks", "JetStreamError", "NoStream"]
