"""A time limit for projection handlers: a batch's walk runs on a handler thread the runner can abandon.

The thread, the deadline, the abandon protocol and the process's cap on abandoned threads are
outbox_relay/timelimit.py's (shared with user sinks and the inbox); what is a projection's is here. The
walk (the handlers and the relay's statements of one transaction) runs on a handler thread, one per
sink, reused from batch to batch; the runner thread waits for it, checking its stop flag, and gives up
on it when one handler call has run for longer than the limit (or the relay's own statements made no
progress for that long):

1. Unless the walk already began its checkpoint, it is marked abandoned under the walk's lock,
   and the helper checks that mark under the same lock right before the checkpoint: a walk the
   runner gave up on never commits, so the event can be charged and the batch redone without a
   double effect. (A walk caught inside its checkpoint is waited for once more, then ``SinkStuck``.)
2. Its transaction is ended from another connection (``end_walk``: ``pg_terminate_backend``), so
   its locks and the horizon go at once; the sink forgets that connection (the helper still holds
   it) and opens a new one for the next batch.
3. The helper thread is left to its handler; the next batch gets a new one. Past the process's cap
   (``timelimit.MAX_ABANDONED``, counted over every sink and inbox; ``over_cap``) the sink charges the event as
   usual, then raises ``SinkStuck`` and the relay exits (4) rather than pile up threads: the attempts
   were counted, and the restarted process starts without them.

The fast path pays two thread hand-offs per batch (not per event) and two attribute writes per
handler call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from outbox_relay.errors import SinkStuck
from outbox_relay.sinks.engine import Aborted
from outbox_relay.timelimit import Call, Deadline, cap_exceeded

log = logging.getLogger("outbox_relay.projections")


class Abandoned(Exception):
    """Raised on an abandoned walk's helper thread at its checkpoint: nothing of it may land."""


class Walk(Call[Any]):
    """One run of a batch on the helper thread. The helper writes ``event``/``since``/``pid`` and
    calls ``may_commit``; the runner thread reads them and may ``abandon``."""

    def __init__(self, fn: Callable[[Walk], Any]) -> None:
        super().__init__(lambda: fn(self))
        self.event: Any = None  # the stored event whose handler runs now; None: the relay's own statements
        self.pid: int | None = None  # backend of the walk's connection, once it has one

    def calling(self, event: Any) -> None:
        self.event, self.since = event, time.monotonic()

    def returned(self) -> None:
        self.event, self.since = None, time.monotonic()

    def may_commit(self) -> None:
        """Right before the checkpoint (helper thread): refuse if the runner gave up on this walk."""
        if not self.begin_commit():
            raise Abandoned()


class TimedOut(Exception):
    """The walk was abandoned: ``event`` is the stored event whose handler did not return (None: the
    relay's own statements made no progress). Nothing of the walk landed."""

    def __init__(self, event: Any, seconds: float) -> None:
        super().__init__()
        self.event = event
        self.seconds = seconds


class Guard:
    """Runs walks on a helper thread with the time limit (one per sink, used by its runner thread)."""

    def __init__(self, name: str, timeout: float, end: Callable[[Walk], None]) -> None:
        self.name = name
        self.timeout = timeout
        self._end = end  # ends an abandoned walk's transaction and makes the sink forget its connection
        self._deadline = Deadline(f"sink-{name}-walk", timeout)
        self.over_cap = False  # this sink's abandon put the process over the cap: it stops the relay

    def run(self, fn: Callable[[Walk], Any], abort: threading.Event) -> Any:
        """``fn(walk)`` on the helper; its result, or what it raised. Raises ``TimedOut`` when the limit
        passed, ``Aborted`` on a hard stop (the walk abandoned in both cases)."""
        walk = Walk(fn)
        self._deadline.start(walk)
        in_checkpoint = False
        while (why := self._deadline.wait(walk, abort)) != "done":
            if walk.abandon():
                self._give_up(walk)
                if why == "stop":
                    raise Aborted()
                raise TimedOut(walk.event, self.timeout)
            if why == "overdue" and in_checkpoint:  # its checkpoint hangs: whether it lands is unknown
                raise SinkStuck(f"sink {self.name}: a batch's checkpoint did not return within "
                                f"{2 * self.timeout:g}s; the relay stops so that its buckets move")
            if why == "overdue":
                in_checkpoint = True
                walk.since = time.monotonic()  # one more limit for the checkpoint to come back
        return walk.result()

    def _give_up(self, walk: Walk) -> None:
        over = self._deadline.give_up()  # if its handler ever returns, the thread ends
        try:
            self._end(walk)
        except Exception as exc:  # the walk can not commit anyway (may_commit); its locks wait for the server
            log.warning("sink %s: could not end the abandoned batch's transaction: %s", self.name, exc)
        self.over_cap = self.over_cap or over

    def check_cap(self) -> None:
        """Raise ``SinkStuck`` once the process is over the cap of abandoned threads (the sink calls it
        after the batch that charged the last one landed)."""
        over, self.over_cap = self.over_cap, False
        if over and (why := cap_exceeded("handlers")):
            raise SinkStuck(f"sink {self.name}: {why}")

    def close(self) -> None:
        self._deadline.close()
