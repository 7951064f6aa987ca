"""Messages of concurrent ``deliver`` calls share SendMessageBatch requests (group commit).

Each call hands its message over and waits for that message's own answer. Per queue, one request is
in flight at a time; the calls that come while it is in flight wait and go out together in the next
request (up to ``size`` messages and ``max_bytes``), sent by the first of them. A call that finds the
queue idle sends at once, unless the last request answered several calls: those come back for their
keys' next events within a moment, so it waits for as many (at most ``linger`` seconds) instead of
going out alone and leaving them the next request (without this, requests alternated 1 and 10
messages: half the requests for a tenth of the messages). An idle relay's latency stays one request.
Order per key is not the batcher's concern: the relay hands a key's next event to the sink only
after the previous one was answered, so a request never holds two events of one key.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .message import Message

BATCH_BYTES = 262_144  # SQS's limit on a batch's total size (256 KiB; a larger message goes alone)
LINGER_SECONDS = 0.005  # the longest a request waits for the calls the last one answered


@dataclass
class Waiting:
    """One call's message in the batcher. ``answer`` is set once by the sender of its request."""

    message: Message
    answer: object = None
    answered: bool = False
    lead: bool = False  # told to send the next request of its queue
    wake: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Line:
    waiting: deque[Waiting] = field(default_factory=deque)
    sending: bool = False  # a request of this queue is in flight (its sender owns the line's next turn)
    expected: int = 1  # calls the last request answered: about as many come back for their next events


Send = Callable[[str, Sequence[Message]], list[object]]  # (queue URL, messages) -> one answer per message


class Batcher:
    def __init__(self, send: Send, size: int = 10, max_bytes: int = BATCH_BYTES,
                 linger: float = LINGER_SECONDS) -> None:
        self._send = send
        self.size = size
        self.max_bytes = max_bytes
        self.linger = linger
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a call joined a line
        self._lines: dict[str, _Line] = {}

    def submit(self, queue_url: str, message: Message) -> object:
        """Send ``message`` to ``queue_url`` (with others' if they come meanwhile); its answer."""
        me = Waiting(message)
        with self._lock:
            line = self._lines.setdefault(queue_url, _Line())
            line.waiting.append(me)
            self._arrived.notify_all()
            if not line.sending:
                line.sending = me.lead = True
        while True:
            if not me.lead:
                me.wake.wait()
                me.wake.clear()
            if me.answered:
                return me.answer
            if me.lead:
                me.lead = False
                self._send_next(queue_url, line)

    def waiting(self, queue_url: str) -> int:
        """How many calls wait for a request of ``queue_url`` (their messages not sent yet)."""
        with self._lock:
            line = self._lines.get(queue_url)
            return len(line.waiting) if line is not None else 0

    def in_flight(self, queue_url: str) -> bool:
        """Whether a request of ``queue_url`` is being sent."""
        with self._lock:
            line = self._lines.get(queue_url)
            return line is not None and line.sending

    def _send_next(self, queue_url: str, line: _Line) -> None:
        """Send the line's next request (this thread's message is its first) and pass the turn on."""
        with self._lock:
            deadline = time.monotonic() + self.linger
            while len(line.waiting) < min(self.size, line.expected):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.wait(left)
            batch: list[Waiting] = [line.waiting.popleft()]
            total = batch[0].message.size
            while (line.waiting and len(batch) < self.size
                   and total + line.waiting[0].message.size <= self.max_bytes):
                total += line.waiting[0].message.size
                batch.append(line.waiting.popleft())
        try:
            answers = self._send(queue_url, [w.message for w in batch])
        except BaseException as exc:  # a bug or an interrupt: every caller of the request raises it
            answers = [exc] * len(batch)
        finally:
            following: Waiting | None = None
            with self._lock:
                line.expected = len(batch)
                if line.waiting:
                    following = line.waiting[0]
                    following.lead = True
                else:
                    line.sending = False
            if following is not None:
                following.wake.set()
        for w, answer in zip(batch, answers, strict=True):
            w.answer, w.answered = answer, True
            w.wake.set()
