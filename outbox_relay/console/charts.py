"""Charts of the last hour from the samples (outbox.console_samples), drawn here as SVG polylines: the
page carries the points and the template draws them (no script, no image requests)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from ..admin import Sample

WIDTH, HEIGHT = 560.0, 120.0


@dataclass(frozen=True)
class Series:
    name: str
    points: str  # "x,y x,y ..." in the chart's box
    last: float


@dataclass(frozen=True)
class Chart:
    title: str
    unit: str
    top: float  # the value at the top of the box
    series: list[Series]
    start: datetime | None
    end: datetime | None

    @property
    def empty(self) -> bool:
        return not any(s.points for s in self.series)


def _line(values: list[tuple[datetime, float]], start: datetime, span: float, top: float) -> str:
    pts = []
    for at, v in values:
        x = WIDTH * (at - start).total_seconds() / span if span else WIDTH
        y = HEIGHT - HEIGHT * (v / top if top else 0.0)
        pts.append(f"{x:.1f},{y:.1f}")
    return " ".join(pts)


def _chart(title: str, unit: str, named: dict[str, list[tuple[datetime, float]]]) -> Chart:
    every = [p for vs in named.values() for p in vs]
    if not every:
        return Chart(title, unit, 0.0, [], None, None)
    start = min(at for at, _ in every)
    end = max(at for at, _ in every)
    top = max(v for _, v in every) or 1.0
    span = (end - start).total_seconds()
    series = [Series(n, _line(vs, start, span, top), vs[-1][1] if vs else 0.0) for n, vs in sorted(named.items())]
    return Chart(title, unit, top, series, start, end)


def per_sink(samples: list[Sample]) -> dict[str, list[Sample]]:
    by: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by[s.sink].append(s)
    return by


def delivered_rates(samples: list[Sample]) -> list[tuple[datetime, float]]:
    """Events a sink's cursors passed per second, minute by minute: those stored in the minute less what its
    backlog grew (an estimate: the count of stored events covers every topic)."""
    out = []
    for before, after in itertools.pairwise(samples):
        seconds = (after.at - before.at).total_seconds()
        if seconds > 0:
            passed = after.published - (after.pending - before.pending) - (after.dead_letters - before.dead_letters)
            out.append((after.at, max(0.0, passed / seconds)))
    return out


def overview_charts(samples: list[Sample], shown: int = 6) -> list[Chart]:
    """Backlog per sink and delivered per second per sink (the ``shown`` sinks with most backlog; the rest
    summed as "others"), and events stored per second."""
    by = per_sink(samples)
    ranked = sorted(by, key=lambda s: -max((x.pending for x in by[s]), default=0))
    keep, rest = ranked[:shown], ranked[shown:]
    backlog = {s: [(x.at, float(x.pending)) for x in by[s]] for s in keep}
    rates = {s: delivered_rates(by[s]) for s in keep}
    if rest:
        totals: dict[datetime, float] = defaultdict(float)
        for s in rest:
            for x in by[s]:
                totals[x.at] += x.pending
        backlog["(others)"] = sorted(totals.items())
    stored: dict[datetime, float] = {}
    for x in samples:
        stored[x.at] = x.published / 60.0
    return [_chart("backlog (events not delivered)", "events", backlog),
            _chart("delivered per second (estimate)", "events/s", {**rates, "(stored/s)": sorted(stored.items())})]


def sparkline(samples: list[Sample]) -> Chart:
    return _chart("backlog", "events", {"backlog": [(x.at, float(x.pending)) for x in samples]})
