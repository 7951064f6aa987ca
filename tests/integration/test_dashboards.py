"""Every series the Grafana dashboard and the alert rules (deploy/) query is one a real relay serves.

A relay runs in-process (compose.build_worker with a metrics port) against the test PostgreSQL and
broker, delivers events (one of them dead-lettered: too large for the broker) while a second sink
that no relay runs lags on a few keys, so that most families have samples. Its /metrics is scraped,
and every selector of every expression must name a series it serves (counters end in _total,
histograms in _bucket/_count/_sum), with labels its samples carry: selector matchers, `by (...)`
and `on (...)` labels, a legend's `{{label}}`, an annotation's `$labels.x`. Families the relay
declares without a sample yet (a producer replacement, a failed cycle) are checked by name only.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from outbox_relay import Outbox, store
from outbox_relay.compose import build_worker
from outbox_relay.settings import RelaySettings
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import running
from tests.servers import free_port, wait_until
from tests.unit.test_dashboards import (
    ALERTS,
    DASHBOARD,
    OBSERVABILITY,
    Served,
    alert_queries,
    dashboard_queries,
    query_problems,
)

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",)}


def served(text: str) -> Served:
    """The series a /metrics text serves, with the label names of their samples (None: declared, no
    sample yet). A histogram's own name is not a series: only its _bucket, _count and _sum are."""
    series: Served = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            series.setdefault(family.name + suffix, None)
        for sample in family.samples:
            labels = frozenset(sample.labels)
            known = series.get(sample.name)
            series[sample.name] = labels if known is None else known | labels
    return series


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


@pytest.fixture
def relay(dsn: str, kafka_bootstrap: str, kafka_topic: str) -> Iterator[tuple[Worker, int]]:
    port = free_port()
    settings = RelaySettings(dsn=dsn, worker_id="dashboards", kafka_bootstrap_servers=kafka_bootstrap,
                             default_topic=kafka_topic, metrics_port=port, metrics_host="127.0.0.1",
                             metrics_refresh_seconds=1, heartbeat_seconds=0.2, worker_ttl_seconds=2,
                             housekeeping_seconds=0.5, lease_seconds=5, kafka_stall_seconds=5)
    with running(build_worker(settings)) as worker:
        yield worker, port


@pytest.fixture
def scrape_text(dsn: str, kafka_topic: str, relay: tuple[Worker, int]) -> str:
    """/metrics of a relay that has delivered, dead-lettered, run housekeeping, and sees keys lag."""
    _, port = relay
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "stalled", "projection")  # no relay runs it: its keys lag
    outbox = Outbox(default_topic=kafka_topic)
    with psycopg.connect(dsn) as conn:
        outbox.publish_many(conn, [{"type": "t", "key": f"k{i % 3}", "payload": {"i": i}} for i in range(12)])
        outbox.publish(conn, type="t", key="huge", payload={"blob": "x" * 2_000_000})  # over the broker's limit

    def ready() -> str | None:
        text = scrape(port)
        done = (value(text, "outbox_relay_events_delivered_total", sink="kafka") == 12
                and value(text, "outbox_relay_events_dead_lettered_total", sink="kafka") == 1
                and value(text, "outbox_relay_key_pending_events", sink="stalled", key="k0") == 4
                and value(text, "outbox_relay_housekeeping_last_finished_age_seconds") is not None
                and (value(text, "outbox_relay_housekeeping_runs_total") or 0) >= 1)
        return text if done else None

    return str(wait_until(ready, 30, interval=0.2, message="deliveries, a dead letter, lagging keys and "
                                                            "housekeeping on /metrics"))


@pytest.fixture
def scraped(scrape_text: str) -> Served:
    return served(scrape_text)


def test_every_series_the_dashboard_and_the_alerts_use_is_served_by_a_relay(scraped: Served) -> None:
    assert query_problems(dashboard_queries(json.loads(DASHBOARD.read_text())), scraped) == []
    assert query_problems(alert_queries(yaml.safe_load(ALERTS.read_text())), scraped) == []
    # The check saw what it checks: samples with labels, and families without samples.
    assert scraped["outbox_relay_delivery_latency_seconds_bucket"] == frozenset({"sink", "le"})
    assert scraped["outbox_relay_key_pending_events"] == frozenset({"sink", "key"})
    # Every sink's counters exist from the start at 0, so increase() sees their first event.
    assert scraped["outbox_relay_cycle_failures_total"] == frozenset({"sink"})
    assert "outbox_relay_delivery_latency_seconds" not in scraped


def replace_in_targets(dashboard: dict[str, Any], old: str, new: str) -> bool:
    """Replace the first ``old`` in a panel target's expr or legend; False if there is none."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for field in ("expr", "legendFormat"):
                if old in target.get(field, ""):
                    target[field] = target[field].replace(old, new, 1)
                    return True
    return False


# Broken copies: (what, old text, new text, the problem it must cause). The dashboard's first, then
# the alert file's.
BROKEN_DASHBOARD = [
    ("a misspelled series", "outbox_relay_events_delivered_total{", "outbox_relay_event_delivered_total{",
     "is not a series"),
    ("a histogram by its own name", "outbox_relay_delivery_latency_seconds_bucket{",
     "outbox_relay_delivery_latency_seconds{", "is not a series"),
    ("a counter without _total", "outbox_relay_lease_changes_total{", "outbox_relay_lease_changes{",
     "is not a series"),
    ("by a label the series lacks", "sum by (instance) (rate(outbox_relay_housekeeping_runs_total",
     "sum by (sink) (rate(outbox_relay_housekeeping_runs_total", "which its operand does not have"),
    ("a quantile without le", "sum by (sink, le) (rate(outbox_relay_delivery_latency_seconds_bucket",
     "sum by (sink) (rate(outbox_relay_delivery_latency_seconds_bucket", "histogram_quantile names ['le']"),
    ("a matcher on a label the series lacks", 'outbox_relay_oldest_writing_transaction_age_seconds{job="$job"}',
     'outbox_relay_oldest_writing_transaction_age_seconds{job="$job", sink=~"$sink"}',
     "which its operand does not have"),
    ("a legend label the series lack", "{{sink}} parked", "{{key}} parked", "shows labels ['key']"),
]
BROKEN_ALERTS = [
    ("a misspelled series", "outbox_relay_oldest_pending_age_seconds) > 300",
     "outbox_relay_oldest_pending_seconds) > 300", "is not a series"),
    ("on a label one side lacks", "unless on (job, sink) sum by (job, sink)", "unless on (job, sink) sum by (job)",
     "the right side of unless on"),
    ("an annotation label the alert lacks", "Outbox relay {{ $labels.instance }}: Kafka producer",
     "Outbox relay {{ $labels.key }}: Kafka producer", "shows labels ['key']"),
]


def test_the_check_finds_a_series_or_label_a_relay_does_not_serve(scraped: Served) -> None:
    dashboard_text, alerts_text = DASHBOARD.read_text(), ALERTS.read_text()
    for what, old, new, problem in BROKEN_DASHBOARD:
        broken = json.loads(dashboard_text)
        assert replace_in_targets(broken, old, new), what
        problems = query_problems(dashboard_queries(broken), scraped)
        assert any(problem in p for p in problems), (what, problems)
    for what, old, new, problem in BROKEN_ALERTS:
        assert old in alerts_text, what
        problems = query_problems(alert_queries(yaml.safe_load(alerts_text.replace(old, new, 1))), scraped)
        assert any(problem in p for p in problems), (what, problems)
    # A relay that served no such family at all: every series is missing.
    assert query_problems(dashboard_queries(json.loads(dashboard_text)), {})


# -- docs/observability.md -----------------------------------------------------------------------------

TABLE_ROW = re.compile(r"^\| `(outbox_relay_\w+)` \|", re.MULTILINE)
NAMED = re.compile(r"\b(outbox_relay_\w+)")


def doc_problems(doc: str, text: str) -> list[str]:
    """docs/observability.md has a table row for every metric family the relay serves (counters by
    their _total name, histograms by their own; not the _created ones prometheus_client adds), and
    names no series the relay does not serve."""
    families = {f.name + ("_total" if f.type == "counter" else ""): f.type
                for f in text_string_to_metric_families(text)
                if not f.name.endswith("_created")}  # the creation time of each counter and histogram
    rows = set(TABLE_ROW.findall(doc))
    problems = [f"{name} ({kind}) has no row in the metrics tables" for name, kind in sorted(families.items())
                if name not in rows]
    known = set(served(text)) | set(families)
    problems += [f"the doc names {name}, which a relay does not serve" for name in sorted(set(NAMED.findall(doc)))
                 if name not in known]
    return problems


def test_the_observability_doc_lists_every_metric_a_relay_serves(scrape_text: str) -> None:
    doc = OBSERVABILITY.read_text()
    assert doc_problems(doc, scrape_text) == []
    row = "| `outbox_relay_parked_events` |"
    assert row in doc
    assert any("outbox_relay_parked_events (gauge) has no row" in p
               for p in doc_problems(doc.replace(row, "| parked |"), scrape_text))
    assert any("outbox_relay_parked_total, which" in p
               for p in doc_problems(doc + "\n`outbox_relay_parked_total`\n", scrape_text))
