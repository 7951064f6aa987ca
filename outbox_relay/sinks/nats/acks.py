"""JetStream publishes and their PubAcks over one reply subscription per client.

``js.publish()`` makes each publish a request: a fresh inbox token, a future, an ``asyncio.wait_for`` task and a
``PubAck`` dataclass per call. Here a client has one wildcard subscription (``<inbox>.*``); a publish gets the
next token of a counter, one future in a dict keyed by that token and one timer (``call_later``) for its time
limit, and the reply is parsed once (``json.loads``). What a reply means is the server's, as for
``js.publish()``: a ``503`` status (no responders: no stream takes the subject), a JSON ``error`` (a JetStream
API error), or a PubAck (``duplicate`` too).
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


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


__all__ = ["Acks", "JetStreamError", "NoStream"]
