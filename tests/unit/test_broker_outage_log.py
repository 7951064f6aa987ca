"""A broker that is away is one line when it goes, then one summary per interval (issue 18 item 1),
not librdkafka's several connection failures a second. Other librdkafka lines pass untouched.

A clock the test moves stands in for time; one case feeds real librdkafka lines (a producer aimed at
a closed port) through the filter, so the parsing follows what librdkafka writes."""

from __future__ import annotations

import logging
import socket
import threading

from confluent_kafka import Producer

from outbox_relay.librdkafka_log import BrokerOutages, EventsWaiting

FAIL = ("FAIL", "rdkafka#producer-1", "[thrd:kafka-1:9092/1]: kafka-1:9092/1: Connect to ipv4#10.0.0.7:9092 failed: "
                                      "Connection refused (after 0ms in state CONNECT)")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(args: tuple[str, str, str], level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("outbox_relay.librdkafka", level, __file__, 1, "%s [%s] %s", args, None)


def test_an_outage_is_its_first_line_then_one_summary_per_interval() -> None:
    clock = Clock()
    outages = BrokerOutages(interval=30.0, clock=clock, waiting=lambda: 1234)
    passed = []
    for _ in range(720):  # 90 s of 8 failures a second (librdkafka writes about 6.7)
        r = record(FAIL)
        if outages.filter(r):
            passed.append(r.getMessage())
        clock.now += 0.125
    assert len(passed) == 3, passed  # the first line, then one at 30 s and one at 60 s
    assert "Connect to ipv4#10.0.0.7:9092 failed" in passed[0]
    summary = passed[1]
    assert summary.startswith("broker kafka-1:9092 unreachable for 30 s; 1234 events waiting"), summary
    assert "Connection refused" in summary and "239 similar lines" in summary, summary
    assert passed[2].startswith("broker kafka-1:9092 unreachable for 60 s"), passed[2]


def test_other_lines_and_other_brokers_pass() -> None:
    clock = Clock()
    outages = BrokerOutages(interval=30.0, clock=clock)
    assert outages.filter(record(FAIL))
    assert not outages.filter(record(FAIL))
    other = ("FAIL", "rdkafka#producer-1", "[thrd:kafka-2:9092/2]: kafka-2:9092/2: Connect to ipv4#10.0.0.8:9092 "
                                           "failed: Connection refused")
    assert outages.filter(record(other)), "another broker's first failure is its own outage"
    assert outages.filter(record(("CONFWARN", "rdkafka#producer-1", "[thrd:app]: Configuration property x"),
                                 logging.WARNING))
    # A broker quiet for a while is back; its next failure is a new outage, shown as librdkafka wrote it.
    clock.now += 120
    r = record(FAIL)
    assert outages.filter(r) and r.getMessage().startswith("FAIL"), r.getMessage()


def test_the_summary_without_a_count_of_waiting_events() -> None:
    clock = Clock()
    outages = BrokerOutages(interval=10.0, clock=clock)
    outages.filter(record(FAIL))
    clock.now += 10
    r = record(FAIL)
    assert outages.filter(r)
    assert r.getMessage().startswith("broker kafka-1:9092 unreachable for 10 s (0 similar lines"), r.getMessage()


def test_events_waiting_counts_batches_in_delivery() -> None:
    waiting = EventsWaiting("kafka")

    class Sink:
        def __init__(self, name: str) -> None:
            self.name = name

    with waiting.delivering(Sink("kafka"), [object()] * 3):  # type: ignore[arg-type]
        with waiting.delivering(Sink("kafka"), [object()] * 2), \
                waiting.delivering(Sink("totals"), [object()] * 7):  # type: ignore[arg-type]
            assert waiting() == 5  # the Kafka sink's batches only
        assert waiting() == 3
    assert waiting() == 0


def test_real_librdkafka_lines_are_recognised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines: list[logging.LogRecord] = []
    enough = threading.Event()

    class Collect(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            lines.append(r)
            if len(lines) >= 5:
                enough.set()

    logger = logging.getLogger("test.librdkafka.outage")
    logger.propagate = False
    logger.addHandler(Collect())
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{port}", "logger": logger})
    producer.produce("t", b"x")
    for _ in range(200):
        producer.poll(0.1)
        if enough.is_set():
            break
    producer.purge()
    producer.flush(1)
    assert len(lines) >= 5, [r.getMessage() for r in lines]
    outages = BrokerOutages(interval=30.0, clock=Clock())  # no time passes: only the first line shows
    shown = [r.getMessage() for r in lines[:5] if outages.filter(r)]
    assert len(shown) == 1 and f"127.0.0.1:{port}" in shown[0], shown
