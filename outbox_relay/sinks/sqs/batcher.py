"""Messages of concurrent ``deliver`` calls share SendMessageBatch requests (group commit).

Each call hands its message over and waits for that message's own answer. Per queue, one request is
in flight at a time: a call that finds none sends at once (no lingering: an idle relay's latency is
one request), the calls that come while it is in flight wait and go out together in the next request
(up to ``size`` messages and ``max_bytes``), sent by the first of them. Busy lanes thus fill batches
on their own. Order per key is not the batcher's concern: the relay hands a key's next event to the
sink only after the previous one was answered, so a request never holds two events of one key.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .message import Message

BATCH_BYTES = 262_144  # SQS's limit on a batch's total size (256 KiB; a larger message goes alone)


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


Send = Callable[[str, Sequence[Message]], list[object]]  # (queue URL, messages) -> one answer per message


class Batcher:
    def __init__(self, send: Send, size: int = 10, max_bytes: int = BATCH_BYTES) -> None:
        self._send = send
        self.size = size
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lines: dict[str, _Line] = {}

    def submit(self, queue_url: str, message: Message) -> object:
        """Send ``message`` to ``queue_url`` (with others' if they come meanwhile); its answer."""
        me = Waiting(message)
        with self._lock:
            line = self._lines.setdefault(queue_url, _Line())
            line.waiting.append(me)
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
