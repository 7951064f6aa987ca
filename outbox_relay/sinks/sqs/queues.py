"""Which queue an event goes to: its topic's (or the relay's default topic's) queue, by URL from
``--sqs-queue-urls`` or by name, ``PREFIX + topic + '.fifo'``, whose URL SQS is asked once
(GetQueueUrl) and then kept. A name SQS can not have is the event's fault (GiveUp, naming the topic
and how to map it); a queue that does not exist is the sink's condition (the caller holds)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...sqs_settings import FIFO_QUEUE_NAME, queue_name_of
from ..user import GiveUp


@dataclass(frozen=True)
class Queue:
    url: str
    name: str
    fifo: bool


class Queues:
    """Topic -> queue for one sink. ``lookup(name)`` asks SQS for a queue's URL (it raises what the client
    raises: the sink decides what that means). Thread-safe."""

    def __init__(self, prefix: str, urls: Mapping[str, str], default_topic: str | None,
                 lookup: Callable[[str], str]) -> None:
        self.prefix = prefix
        self.default_topic = default_topic
        self._given = {topic: Queue(url, queue_name_of(url), queue_name_of(url).endswith(".fifo"))
                       for topic, url in urls.items()}
        self._lookup = lookup
        self._found: dict[str, Queue] = {}
        self._lock = threading.Lock()

    def name_of(self, topic: str | None) -> str | GiveUp:
        """The queue name of ``topic`` by the prefix rule (or as mapped), or why there is none."""
        topic = topic or self.default_topic
        if topic is None:
            return GiveUp("sqs: the event has no topic and the relay has no --default-topic")
        if topic in self._given:
            return self._given[topic].name
        name = f"{self.prefix}{topic}.fifo"
        if not FIFO_QUEUE_NAME.match(name):
            return GiveUp(f"sqs: topic {topic!r} makes the queue name {name!r}, which SQS does not allow (1-80 "
                          "characters of A-Z a-z 0-9 _ -, ending in .fifo): map the topic to a queue with "
                          "--sqs-queue-urls TOPIC=URL")
        return name

    def of(self, topic: str | None) -> Queue | GiveUp:
        """The queue of an event of ``topic`` (asking SQS for its URL the first time)."""
        topic = topic or self.default_topic
        if topic in self._given:
            return self._given[topic]
        name = self.name_of(topic)
        if isinstance(name, GiveUp):
            return name
        with self._lock:
            found = self._found.get(name)
        if found is not None:
            return found
        queue = Queue(self._lookup(name), name, True)
        with self._lock:
            self._found[name] = queue
        return queue

    def forget_url(self, url: str) -> None:
        """SQS said the queue at ``url`` does not exist: ask for its URL again next time (it may be made anew
        elsewhere). A URL given in the settings stays."""
        with self._lock:
            self._found = {name: q for name, q in self._found.items() if q.url != url}
