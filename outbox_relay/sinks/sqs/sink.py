"""The SQS sink: each event a message on its topic's FIFO queue, delivered once SQS accepted it.

"Delivered" is SQS's own acknowledgement: the event's id among the ``Successful`` entries of a
SendMessageBatch answer (or a SendMessage answer), which SQS gives once the message is stored. Each
event is sent with ``MessageGroupId`` = its partition key and ``MessageDeduplicationId`` = its id
(message.py). The relay's adapter calls ``deliver_many`` with the next event of each of up to
``concurrency`` keys (sinks/waves.py); their messages go out per queue in SendMessageBatch requests of
up to ``batch_size`` (batches.py), one after another. What an error means is answers.py's; which queue,
queues.py's. Order per key, retries, dead letters and fencing are the relay's: a key's next event reaches
the sink only once the previous one is answered, so the group's order in the queue is the key's publish
order.

A standard queue (no order, no deduplication) is refused unless ``allow_standard_queue``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dsn import describe_error
from ...errors import ConfigurationError
from ...sqs_settings import FIFO_QUEUE_NAME, QUEUE_NAME, QUEUE_PREFIX, check_endpoint, queue_name_of
from ..user import MAX_CONCURRENCY, Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable
from .answers import MISSING_QUEUE, codes, of_error, of_exception, parsed
from .batches import requests
from .client import make_client
from .message import Message, message_of
from .queues import Queues

if TYPE_CHECKING:
    from ...sqs_settings import SqsFields

log = logging.getLogger("outbox_relay.sqs")

UNAVAILABLE_SECONDS = 5.0


class SqsSink:
    """Sends each event to its topic's SQS queue. An ``EventSink`` (outbox_relay.sinks). Thread-safe."""

    kind = "sqs"

    def __init__(self, endpoint: str, *, name: str = "sqs", source: str = "outbox-relay",
                 region: str | None = None, profile: str | None = None, queue_prefix: str = "",
                 queue_urls: Mapping[str, str] | None = None, default_topic: str | None = None,
                 allow_standard_queue: bool = False, concurrency: int = 10, batch_size: int = 10,
                 topics: Collection[str] | None = None, connect_timeout_seconds: float = 5.0,
                 timeout_seconds: float = 10.0, unavailable_seconds: float = UNAVAILABLE_SECONDS,
                 ca_file: str | Path | None = None, verify_tls: bool = True, client: Any = None) -> None:
        try:
            check_endpoint(endpoint)
        except ValueError as exc:
            raise ConfigurationError(f"sqs: the endpoint URL: {exc}") from None
        self.name = name
        self.source = source
        self.endpoint = endpoint
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(f"sqs concurrency must be 1-{MAX_CONCURRENCY} (keys delivered at once)")
        if not 1 <= batch_size <= 10:
            raise ConfigurationError("sqs batch_size must be 1-10 (SQS takes at most 10 messages per batch)")
        if not QUEUE_PREFIX.match(queue_prefix):
            raise ConfigurationError("sqs: a queue name prefix is at most 74 characters of A-Z a-z 0-9 _ -")
        urls = dict(queue_urls or {})
        for topic, url in urls.items():
            queue = queue_name_of(url)
            if not (QUEUE_NAME.match(queue) or FIFO_QUEUE_NAME.match(queue)):
                raise ConfigurationError(f"sqs: the queue URL of topic {topic} does not end in a queue name")
            if not queue.endswith(".fifo"):
                if not allow_standard_queue:
                    raise ConfigurationError(
                        f"sqs: the queue of topic {topic} ({queue}) is a standard queue, which keeps no order and "
                        "does not deduplicate: use a FIFO queue, or allow standard queues (--sqs-allow-standard-queue)")
                log.warning("sqs sink %s: topic %s goes to the standard queue %s: its events may arrive out of order "
                            "and more than once", name, topic, queue)
        self.concurrency = concurrency
        self.topics = frozenset(topics) if topics is not None else None
        if not 0 < unavailable_seconds <= 3600:
            raise ConfigurationError("sqs unavailable_seconds must be more than 0 and at most 3600")
        self.unavailable_seconds = unavailable_seconds
        self._client = client if client is not None else make_client(
            endpoint, region=region, profile=profile, concurrency=concurrency,
            connect_timeout_seconds=connect_timeout_seconds, timeout_seconds=timeout_seconds,
            ca_file=Path(ca_file) if ca_file is not None else None, verify_tls=verify_tls)
        self.queues = Queues(queue_prefix, urls, default_topic, self._queue_url)
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"SqsSink(name={self.name!r}, endpoint={self.endpoint!r})"

    # -- the contract

    def deliver(self, event: SinkEvent) -> Delivered | Retry | GiveUp:
        answer = self.deliver_many([event])[0]
        if isinstance(answer, SinkUnavailable):
            raise answer
        return answer

    def deliver_many(self, events: Sequence[SinkEvent]) -> list[Delivered | Retry | GiveUp | SinkUnavailable]:
        """Each event's message to its topic's queue, in requests shared by the events of one queue: an answer
        each."""
        answers: list[Delivered | Retry | GiveUp | SinkUnavailable] = [Delivered()] * len(events)
        lines: dict[str, list[tuple[int, Message]]] = {}
        for i, event in enumerate(events):
            try:
                queue = self.queues.of(event.topic)
            except SinkUnavailable as exc:  # SQS can not say where the queue is
                answers[i] = exc
                continue
            message = queue if isinstance(queue, GiveUp) else message_of(event, self.source, queue.fifo)
            if isinstance(message, GiveUp):
                answers[i] = message
                continue
            assert not isinstance(queue, GiveUp)
            lines.setdefault(queue.url, []).append((i, message))
        for url, line in lines.items():
            for request in requests(line, self.batch_size):
                try:
                    sent = self._send(url, [m for _, m in request])
                except Exception as exc:  # what answers.py does not know: each message's attempt failed
                    sent = [Retry(f"sqs: send to {queue_name_of(url)}: {describe_error(exc)}")] * len(request)
                for (i, _), answer in zip(request, sent, strict=True):
                    if answer is not None:
                        assert isinstance(answer, Retry | GiveUp | SinkUnavailable), answer
                        answers[i] = answer
        return answers

    def close(self) -> None:
        self._client.close()

    # -- SQS

    def _queue_url(self, name: str) -> str:
        try:
            return str(self._client.get_queue_url(QueueName=name)["QueueUrl"])
        except Exception as exc:
            answer = of_exception(exc, f"GetQueueUrl {name}", self.unavailable_seconds)
            if answer is None:
                raise
            if isinstance(answer, SinkUnavailable):
                raise answer from None
            # A refusal of the lookup is no fault of the event: the queue, not the message, is at issue.
            raise SinkUnavailable(f"{answer.reason} (looking up the queue)", self.unavailable_seconds) from None

    def _send(self, url: str, messages: Sequence[Message]) -> list[object]:
        """One request for ``messages`` (a queue's): one answer per message (None: delivered)."""
        where = f"send to {queue_name_of(url)}"
        if len(messages) == 1:
            try:
                self._client.send_message(QueueUrl=url, **messages[0].entry)
                return [None]
            except Exception as exc:
                return [self._refused(exc, url, where)]
        entries = [{"Id": str(i), **m.entry} for i, m in enumerate(messages)]
        try:
            reply = self._client.send_message_batch(QueueUrl=url, Entries=entries)
        except Exception as exc:
            answer = self._refused(exc, url, where)
            if isinstance(answer, GiveUp):
                # The request as a whole was refused for some message's sake: each alone says which.
                return [self._send(url, [m])[0] for m in messages]
            return [answer] * len(messages)
        ok = {str(s.get("Id")) for s in reply.get("Successful") or ()}
        failed = {str(f.get("Id")): f for f in reply.get("Failed") or ()}
        answers: list[object] = []
        for entry in entries:
            if entry["Id"] in ok:
                answers.append(None)
            elif entry["Id"] in failed:
                f = failed[entry["Id"]]
                code_names = codes(f)
                if code_names & MISSING_QUEUE:
                    self.queues.forget_url(url)
                answers.append(of_error(code_names, str(f.get("Message") or ""), 0, where, bool(f.get("SenderFault")),
                                        self.unavailable_seconds))
            else:
                answers.append(Retry(f"sqs: {where}: the answer lists the message neither as sent nor as failed"))
        return answers

    def _refused(self, exc: Exception, url: str, where: str) -> object:
        answer = of_exception(exc, where, self.unavailable_seconds)
        if answer is None:
            raise exc
        error = parsed(getattr(exc, "response", {}).get("Error", {}))
        if codes(error) & MISSING_QUEUE:
            self.queues.forget_url(url)
        return answer


# -- configuration --------------------------------------------------------------------------------


def from_settings(settings: SqsFields, *, source: str = "outbox-relay", default_topic: str | None = None) -> SqsSink:
    """The SQS sink that ``settings`` (``sqs_*``) describe; ConfigurationError without a URL."""
    s = settings
    if not s.sqs_url:
        raise ConfigurationError("no SQS endpoint: pass --sqs-url or set OUTBOX_SQS_URL")
    return SqsSink(s.sqs_url, name=s.sqs_sink, source=source, region=s.sqs_region, profile=s.sqs_profile,
                   queue_prefix=s.sqs_queue_prefix, queue_urls=s.sqs_queue_urls, default_topic=default_topic,
                   allow_standard_queue=s.sqs_allow_standard_queue, concurrency=s.sqs_concurrency,
                   batch_size=s.sqs_batch_size, topics=s.sqs_topics or None,
                   connect_timeout_seconds=s.sqs_connect_timeout_seconds, timeout_seconds=s.sqs_timeout_seconds,
                   unavailable_seconds=s.sqs_unavailable_seconds, ca_file=s.sqs_ca_file, verify_tls=s.sqs_tls_verify)


__all__ = ["SqsSink", "from_settings"]
