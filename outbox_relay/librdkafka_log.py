"""librdkafka's connection failures, summarised: a broker that is away is one line when it goes, then
one line per interval ("broker X unreachable for N s; M events waiting"), instead of the several
lines a second librdkafka writes while it reconnects. /readyz says 503 meanwhile (KafkaSink.problem).

``outbox-relay run`` installs ``BrokerOutages`` on logger ``outbox_relay.librdkafka``, where the Kafka
sink routes librdkafka's lines; other lines (configuration warnings, TLS, debug contexts) pass as they
are. The sink itself is not involved: this is a logging filter only.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .observer import Delivery, Observer

if TYPE_CHECKING:
    from .sinks.engine import Sink
    from .store import StoredEvent

SUMMARY_SECONDS = 30.0  # one summary line per broker per this long
# A broker with no failure for this long is back (librdkafka retries a broker that is down at least
# every reconnect.backoff.max.ms, 10 s by default); its next failure starts a new outage.
QUIET_SECONDS = 60.0

# confluent-kafka logs ("%s [%s] %s", facility, client name, text); text is "[thrd:NAME]: BROKER: what".
_BROKER_LINE = re.compile(r"^\[thrd:[^\]]*\]:\s*(?P<broker>\S+?):\s+(?P<what>.*)$", re.DOTALL)
# Connection failures: librdkafka's facility for a broker connection that failed or broke.
_FAILURE_FACILITIES = frozenset({"FAIL"})


@dataclass
class _Outage:
    since: float
    last_line: float
    summarised: float
    suppressed: int = 0
    last: str = ""


class BrokerOutages(logging.Filter):
    """Let the first connection failure of a broker's outage through, then one summary per ``interval``.

    ``waiting`` says how many events wait for the brokers (None: not known); it is called from the
    thread that logs (the sink's, inside ``poll()``), so it must be cheap and never block."""

    def __init__(self, interval: float = SUMMARY_SECONDS, quiet: float = QUIET_SECONDS,
                 waiting: Callable[[], int | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self.quiet = quiet
        self.waiting = waiting
        self._clock = clock
        self._lock = threading.Lock()
        self._outages: dict[str, _Outage] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if not (isinstance(args, tuple) and len(args) == 3 and args[0] in _FAILURE_FACILITIES):
            return True
        m = _BROKER_LINE.match(str(args[2]))
        if m is None:
            return True
        broker = m.group("broker").rsplit("/", 1)[0]  # "host:port/1" or "host:port/bootstrap"
        now = self._clock()
        with self._lock:
            outage = self._outages.get(broker)
            if outage is None or now - outage.last_line > self.quiet:
                self._outages[broker] = _Outage(since=now, last_line=now, summarised=now, last=m.group("what"))
                return True  # the outage's first line, as librdkafka wrote it
            outage.last_line, outage.last = now, m.group("what")
            if now - outage.summarised < self.interval:
                outage.suppressed += 1
                return False
            suppressed, outage.suppressed, outage.summarised = outage.suppressed, 0, now
            since = outage.since
        try:
            count = self.waiting() if self.waiting is not None else None
        except Exception:  # a count is a nicety; never lose the line for it
            count = None
        waiting = f"; {count} events waiting" if count is not None else ""
        record.msg = "broker %s unreachable for %.0f s%s (%d similar line%s in the last %.0f s; the last: %s)"
        record.args = (broker, now - since, waiting, suppressed, "" if suppressed == 1 else "s", self.interval,
                       m.group("what"))
        return True


class EventsWaiting(Observer):
    """Counts the events of the batches the sink named ``sink`` is delivering right now (what waits for
    the brokers while they are away): an observer for ``BrokerOutages.waiting``. Thread-safe."""

    def __init__(self, sink: str) -> None:
        self.sink = sink
        self._lock = threading.Lock()
        self._count = 0

    def __call__(self) -> int:
        return self._count

    @contextlib.contextmanager
    def delivering(self, sink: Sink, events: Sequence[StoredEvent]) -> Iterator[Delivery]:
        if sink.name != self.sink:
            yield Delivery()
            return
        with self._lock:
            self._count += len(events)
        try:
            yield Delivery()
        finally:
            with self._lock:
                self._count -= len(events)


def summarise_outages(waiting: Callable[[], int | None] | None = None) -> BrokerOutages:
    """Install ``BrokerOutages`` on the logger the Kafka sink gives librdkafka; returns it (to remove)."""
    outages = BrokerOutages(waiting=waiting)
    logging.getLogger("outbox_relay.librdkafka").addFilter(outages)
    return outages
