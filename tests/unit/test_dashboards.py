"""The Grafana dashboard and the Prometheus alert rules (deploy/), checked offline.

- The dashboard is Grafana dashboard JSON in every way that can be checked without a Grafana: a
  schemaVersion, unique panel ids, panels on the 24-column grid without overlaps, every panel with
  the data source variable and queries, every `$variable` defined.
- The alert file is Prometheus rule YAML: groups of rules with only the fields Prometheus accepts,
  durations it parses, the labels and annotations we promise (severity; summary, description and a
  runbook_url naming a section of a page under docs/), and each alert explained in
  docs/observability.md.
- Every PromQL expression parses: with promql-parser (the Rust port of Prometheus' own parser, which
  also checks function argument types), after the dashboard's Grafana variables are substituted.
- With `promtool` on PATH (or $PROMTOOL): `promtool check rules`, and `promtool test rules` feeds each
  alert series in which it must fire, and healthy ones in which it must not.

That every metric and label the files use is served by a real relay is checked in
tests/integration/test_dashboards.py, with the helpers below. Each check has a twin that feeds it a
broken copy and expects it to complain, so none of them can pass by checking nothing.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-relay.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OBSERVABILITY = ROOT / "docs" / "observability.md"

PREFIX = "outbox_relay_"
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"job", "instance"})
# Grafana's own variables, and what stands in for them when an expression is parsed.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
# The oldest schema Grafana 10 writes; Grafana migrates older ones on import, silently.
MIN_SCHEMA_VERSION = 36
PANEL_TYPES = {"row", "timeseries", "stat", "table", "gauge", "bargauge", "text", "heatmap"}
SEVERITIES = {"warning", "critical"}
ANNOTATIONS = {"summary", "description", "runbook_url"}
RULE_FIELDS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
GROUP_FIELDS = {"name", "interval", "rules", "limit", "query_offset"}
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+|0")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def tool(name: str) -> str | None:
    return os.environ.get(name.upper()) or shutil.which(name)


# -- reading the files ----------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def alert_rules() -> dict[str, Any]:
    return dict(yaml.safe_load(ALERTS.read_text()))


def all_panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, also those inside collapsed rows."""
    for panel in d.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]")


def variables_used(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in VARIABLE.finditer(text)}


def substitute(expr: str) -> str:
    """A Grafana query as Prometheus would receive it: variables replaced by plausible values."""
    return VARIABLE.sub(lambda m: GRAFANA_VARIABLES.get(next(g for g in m.groups() if g), "x"), expr)


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a file: where it is, the expression, and the labels its output is
    expected to carry (a legend's `{{label}}`, an annotation's `$labels.label`)."""

    where: str
    expr: str
    shown_labels: frozenset[str] = frozenset()


LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")
LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\)\s*$")


def dashboard_queries(d: dict[str, Any]) -> list[Query]:
    """The PromQL of every panel target and of every `label_values(...)` variable (Grafana
    variables substituted)."""
    queries = []
    for panel in all_panels(d):
        for t in panel.get("targets", []):
            if "expr" in t:
                shown = frozenset(LEGEND_LABEL.findall(t.get("legendFormat", "")))
                queries.append(Query(f"panel {panel.get('id')} {panel.get('title')!r} target {t.get('refId')}",
                                     substitute(t["expr"]), shown))
    for var in d.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            text = q.get("query", "") if isinstance(q, dict) else str(q)
            m = LABEL_VALUES.match(text)
            if m:
                queries.append(Query(f"variable {var.get('name')}", substitute(m.group(1)),
                                     frozenset({m.group(2)})))
    return queries


def alert_queries(doc: dict[str, Any]) -> list[Query]:
    queries = []
    for group in doc.get("groups") or []:
        for rule in group.get("rules") or []:
            annotations = rule.get("annotations") or {}
            shown = frozenset(label for text in annotations.values() for label in TEMPLATE_LABEL.findall(str(text)))
            name = rule.get("alert") or rule.get("record")
            queries.append(Query(f"rule {name}", str(rule.get("expr", "")), shown - set(rule.get("labels") or {})))
    return queries


# -- PromQL ------------------------------------------------------------------------------------------


def parse(query: Query) -> tuple[pq.Expr | None, str | None]:
    try:
        return pq.parse(query.expr), None
    except ValueError as exc:
        return None, f"{query.where}: PromQL does not parse ({exc}): {query.expr}"


def selectors(expr: pq.Expr) -> list[pq.VectorSelector]:
    found: list[pq.VectorSelector] = []

    def visit(node: pq.Expr) -> None:
        if isinstance(node, pq.VectorSelector):
            found.append(node)

    pq.walk(expr, pre_visit=visit)
    return found


# What is known of a metric on a relay's /metrics: the label names of its samples; None when it is
# declared (# TYPE) without a sample yet, so its labels are unknown.
Served = dict[str, frozenset[str] | None]


def output_labels(node: pq.Expr, served: Served | None, problems: list[str], where: str) -> frozenset[str] | None:
    """The labels of the series an expression yields (None: unknown), and into ``problems`` every
    `by`/`on` label, matcher label or series name that is not there. ``served`` None: check nothing
    against a relay, only walk."""

    def sub(n: pq.Expr) -> frozenset[str] | None:
        return output_labels(n, served, problems, where)

    def need(labels: list[str], have: frozenset[str] | None, what: str) -> None:
        missing = sorted(set(labels) - have) if have is not None else []
        if missing:
            problems.append(f"{where}: {what} names {missing}, which its operand does not have (it has "
                            f"{sorted(have or ())})")

    if isinstance(node, pq.VectorSelector):
        if served is None:
            return None
        name = node.name or ""
        if name not in served:
            problems.append(f"{where}: {name or str(node)!r} is not a series a relay serves")
            return None
        labels = served[name]
        if labels is None:
            return None
        have = labels | TARGET_LABELS | {"__name__"}
        need([m.name for m in node.matchers.matchers], have, f"the selector {node}")
        return labels | TARGET_LABELS
    if isinstance(node, pq.MatrixSelector):
        return sub(node.vector_selector)
    if isinstance(node, pq.SubqueryExpr | pq.ParenExpr | pq.UnaryExpr):
        return sub(node.expr)
    if isinstance(node, pq.NumberLiteral | pq.StringLiteral):
        return frozenset()
    if isinstance(node, pq.AggregateExpr):
        inner = sub(node.expr)
        if node.param is not None and isinstance(node.param, pq.Expr):
            sub(node.param)
        mod = node.modifier
        if mod is not None and mod.type == pq.AggModifierType.By:
            need(mod.labels, inner, f"{node.op} by")
            return frozenset(mod.labels)
        if mod is not None:  # without
            return None if inner is None else inner - set(mod.labels)
        return inner if str(node.op) in ("topk", "bottomk", "limitk", "limit_ratio") else frozenset()
    if isinstance(node, pq.Call):
        args = [sub(a) if isinstance(a, pq.Expr) else frozenset() for a in node.args]
        name = node.func.name
        if name in ("absent", "absent_over_time", "scalar", "time", "vector", "pi"):
            return frozenset()
        if name == "histogram_quantile":
            need(["le"], args[1], "histogram_quantile")
            return None if args[1] is None else args[1] - {"le"}
        if name in ("label_replace", "label_join"):
            dst = node.args[1]
            return None if args[0] is None else args[0] | {str(dst).strip('"')}
        vectors = [a for a, raw in zip(args, node.args, strict=True)
                   if not isinstance(raw, pq.NumberLiteral | pq.StringLiteral)]
        return vectors[0] if vectors else frozenset()
    if isinstance(node, pq.BinaryExpr):
        lhs, rhs = sub(node.lhs), sub(node.rhs)
        op = str(node.op)
        mod = node.modifier
        matching = mod.matching if mod is not None else None
        if matching is not None and matching.type == pq.LabelModifierType.Include:
            need(matching.labels, lhs, f"the left side of {op} on")
            need(matching.labels, rhs, f"the right side of {op} on")
        if op in ("and", "unless"):
            return lhs
        if op == "or":
            return None if lhs is None or rhs is None else lhs | rhs
        scalar_left = isinstance(node.lhs, pq.NumberLiteral)
        scalar_right = isinstance(node.rhs, pq.NumberLiteral)
        if scalar_left or scalar_right:
            return rhs if scalar_left else lhs
        if matching is not None and matching.type == pq.LabelModifierType.Include and (
                mod is None or mod.card == pq.VectorMatchCardinality.OneToOne):
            return frozenset(matching.labels)  # one-to-one `on`: Prometheus keeps only those
        return lhs
    return None


def query_problems(queries: list[Query], served: Served | None = None) -> list[str]:
    """Parse every query; with ``served``, check every series and label it uses against a relay."""
    problems: list[str] = []
    for q in queries:
        expr, error = parse(q)
        if expr is None:
            problems.append(str(error))
            continue
        labels = output_labels(expr, served, problems, q.where)
        if served is not None and labels is not None and not q.shown_labels <= labels:
            problems.append(f"{q.where}: shows labels {sorted(q.shown_labels - labels)} that its series do not "
                            f"have (they have {sorted(labels)})")
    return problems


# -- the dashboard -------------------------------------------------------------------------------------


def dashboard_problems(d: dict[str, Any]) -> list[str]:
    problems = []
    schema = d.get("schemaVersion")
    if not isinstance(schema, int) or schema < MIN_SCHEMA_VERSION:
        problems.append(f"schemaVersion {schema!r} is not an integer >= {MIN_SCHEMA_VERSION}")
    for key in ("title", "uid"):
        if not isinstance(d.get(key), str) or not d[key]:
            problems.append(f"no {key}")
    if len(d.get("uid") or "") > 40:
        problems.append("uid longer than 40 characters (Grafana refuses it)")
    variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
    source = variables.get("datasource", {})
    if source.get("type") != "datasource" or source.get("query") != "prometheus":
        problems.append("no Prometheus data source variable `datasource`")
    if "sink" not in variables:
        problems.append("no `sink` variable")
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for name, var in variables.items():
        if var.get("type") == "query" and var.get("datasource") != datasource:
            problems.append(f"variable {name} does not query the data source variable: {var.get('datasource')}")
    defined = set(variables) | set(GRAFANA_VARIABLES)
    panels = list(all_panels(d))
    if not panels:
        problems.append("no panels")
    ids = [p.get("id") for p in panels]
    for i in sorted({i for i in ids if ids.count(i) > 1}, key=str):
        problems.append(f"panel id {i} is used {ids.count(i)} times")
    cells: dict[tuple[int, int], Any] = {}
    for p in panels:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        if not isinstance(p.get("id"), int):
            problems.append(f"{where}: id is not an integer")
        if p.get("type") not in PANEL_TYPES:
            problems.append(f"{where}: unknown type {p.get('type')!r}")
        if not p.get("title"):
            problems.append(f"{where}: no title")
        grid = p.get("gridPos") or {}
        if not all(isinstance(grid.get(k), int) for k in "xywh"):
            problems.append(f"{where}: gridPos {grid} lacks x, y, w or h")
        elif grid["x"] < 0 or grid["w"] < 1 or grid["x"] + grid["w"] > 24 or grid["h"] < 1:
            problems.append(f"{where}: gridPos {grid} is off the 24-column grid")
        else:
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    if (x, y) in cells:
                        problems.append(f"{where} overlaps panel {cells[(x, y)]}")
                        break
                    cells[(x, y)] = p.get("id")
                else:
                    continue
                break
        if p.get("type") == "row":
            continue
        if p.get("datasource") != datasource:
            problems.append(f"{where}: datasource is {p.get('datasource')!r}, not {datasource}")
        targets = p.get("targets") or []
        if not targets:
            problems.append(f"{where}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            problems.append(f"{where}: refIds {refs} are not unique and set")
        for t in targets:
            if not str(t.get("expr", "")).strip():
                problems.append(f"{where}: target {t.get('refId')} has no expr")
            if t.get("datasource", datasource) != datasource:
                problems.append(f"{where}: target {t.get('refId')} has its own datasource {t.get('datasource')}")
    used = set()
    for var in variables.values():
        used |= variables_used(json.dumps(var.get("query", "")))
    for p in panels:
        used |= variables_used(json.dumps(p.get("targets", [])))
    for name in sorted(used - defined):
        problems.append(f"${name} is used but not defined")
    problems += query_problems(dashboard_queries(d))
    return problems


def test_the_dashboard_is_valid_grafana_json() -> None:
    assert dashboard_problems(dashboard()) == []


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    exprs = " ".join(q.expr for q in dashboard_queries(dashboard()))
    for series in ("events_delivered_total", "events_dead_lettered_total", "events_retried_total",
                   "pending_events", "oldest_pending_age_seconds", "delivery_latency_seconds_bucket",
                   "batch_size_events_bucket", "lease_changes_total", "producer_recreations_total",
                   "housekeeping_runs_total", "housekeeping_last_finished_age_seconds",
                   "oldest_writing_transaction_age_seconds", "key_pending_events", "buckets_held", "listening"):
        assert PREFIX + series in exprs, series
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    tables = [p for p in all_panels(dashboard()) if p["type"] == "table"]
    assert any("key_pending_events" in t["expr"] for p in tables for t in p["targets"])


def _mutate(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of the dashboard with one thing broken."""
    d = copy.deepcopy(dashboard())
    change(d)
    return d


def _panel(d: dict[str, Any], n: int) -> dict[str, Any]:
    return [p for p in all_panels(d) if p["type"] != "row"][n]


BROKEN_DASHBOARDS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("no schemaVersion", lambda d: d.pop("schemaVersion"), "schemaVersion"),
    ("duplicate id", lambda d: _panel(d, 3).update(id=_panel(d, 2)["id"]), "is used 2 times"),
    ("no datasource", lambda d: _panel(d, 4).pop("datasource"), "datasource is None"),
    ("fixed datasource", lambda d: _panel(d, 4).update(datasource={"type": "prometheus", "uid": "P1"}),
     "datasource is"),
    ("no targets", lambda d: _panel(d, 5).update(targets=[]), "no targets"),
    ("off the grid", lambda d: _panel(d, 6)["gridPos"].update(x=20, w=8), "off the 24-column grid"),
    ("overlap", lambda d: _panel(d, 7)["gridPos"].update(_panel(d, 8)["gridPos"]), "overlaps"),
    ("bad PromQL", lambda d: _panel(d, 9)["targets"][0].update(expr=_panel(d, 9)["targets"][0]["expr"] + ")"),
     "does not parse"),
    ("rate without a range", lambda d: _panel(d, 9)["targets"][0].update(
        expr='rate(outbox_relay_events_delivered_total{sink=~"$sink"})'), "does not parse"),
    ("undefined variable", lambda d: _panel(d, 10)["targets"][0].update(
        expr='outbox_relay_pending_events{sink=~"$sinks"}'), "$sinks is used but not defined"),
    ("no datasource variable", lambda d: d["templating"].update(
        list=[v for v in d["templating"]["list"] if v["name"] != "datasource"]), "data source variable"),
    ("no sink variable", lambda d: d["templating"].update(
        list=[v for v in d["templating"]["list"] if v["name"] != "sink"]), "no `sink` variable"),
]


@pytest.mark.parametrize(("change", "problem"), [(c, p) for _, c, p in BROKEN_DASHBOARDS],
                         ids=[name for name, _, _ in BROKEN_DASHBOARDS])
def test_the_dashboard_check_finds_a_broken_copy(change: Callable[[dict[str, Any]], None], problem: str) -> None:
    problems = dashboard_problems(_mutate(change))
    assert any(problem in p for p in problems), problems


# -- the alert rules ---------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", path.read_text(), re.MULTILINE)}


def alert_problems(doc: dict[str, Any]) -> list[str]:
    problems = []
    if set(doc) != {"groups"} or not isinstance(doc.get("groups"), list) or not doc["groups"]:
        return [f"the file must hold `groups:` (a non-empty list) and nothing else: {sorted(doc)}"]
    documented = OBSERVABILITY.read_text() if OBSERVABILITY.exists() else ""
    names = [g.get("name") for g in doc["groups"]]
    if len(set(names)) != len(names) or not all(names):
        problems.append(f"group names {names} are not unique and set")
    for group in doc["groups"]:
        if set(group) - GROUP_FIELDS:
            problems.append(f"group {group.get('name')}: unknown fields {sorted(set(group) - GROUP_FIELDS)}")
        rules = group.get("rules")
        if not isinstance(rules, list) or not rules:
            problems.append(f"group {group.get('name')}: no rules")
            continue
        for rule in rules:
            name = rule.get("alert") or rule.get("record")
            where = f"rule {name}"
            if set(rule) - RULE_FIELDS:
                problems.append(f"{where}: unknown fields {sorted(set(rule) - RULE_FIELDS)}")
            if ("alert" in rule) == ("record" in rule):
                problems.append(f"{where}: needs exactly one of alert and record")
                continue
            if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                problems.append(f"{where}: no expr")
            if "record" in rule:
                continue
            if not LABEL_NAME.fullmatch(str(name)):
                problems.append(f"{where}: the alert name is not a valid label value for alertname here")
            for key in ("for", "keep_firing_for"):
                if key in rule and not DURATION.fullmatch(str(rule[key])):
                    problems.append(f"{where}: {key} {rule[key]!r} is not a Prometheus duration")
            if "for" not in rule:
                problems.append(f"{where}: no `for:` (write `for: 0m` to fire at once)")
            labels = rule.get("labels") or {}
            annotations = rule.get("annotations") or {}
            for what, mapping in (("label", labels), ("annotation", annotations)):
                if not isinstance(mapping, dict):
                    problems.append(f"{where}: {what}s is not a mapping")
                    continue
                for k, v in mapping.items():
                    if not LABEL_NAME.fullmatch(str(k)) or not isinstance(v, str):
                        problems.append(f"{where}: {what} {k!r}: {v!r} is not a name with a string value")
            if labels.get("severity") not in SEVERITIES:
                problems.append(f"{where}: severity {labels.get('severity')!r} is not one of {sorted(SEVERITIES)}")
            missing = ANNOTATIONS - set(annotations)
            if missing:
                problems.append(f"{where}: no {sorted(missing)} annotation")
            runbook = str(annotations.get("runbook_url", ""))
            page, _, anchor = runbook.partition("#")
            target = ROOT / page
            if runbook and (not page.startswith("docs/") or not page.endswith(".md") or not target.is_file()
                            or anchor not in anchors(target)):
                problems.append(f"{where}: runbook_url {runbook} is not a section of a page under docs/")
            if f"`{name}`" not in documented:
                problems.append(f"{where}: not explained in docs/observability.md")
    problems += query_problems(alert_queries(doc))
    return problems


def test_the_alert_rules_are_valid_prometheus_rules() -> None:
    assert alert_problems(alert_rules()) == []


def test_the_alert_rules_cover_what_the_issue_asks_for() -> None:
    rules = {r["alert"]: r for g in alert_rules()["groups"] for r in g["rules"]}
    assert {"OutboxBacklogGrowing", "OutboxOldestPendingEvent", "OutboxNewDeadLetters", "OutboxHousekeepingStalled",
            "OutboxRelayNotReady", "OutboxNoRelayUp", "OutboxProducerReplacements",
            "OutboxLongWritingTransaction"} <= set(rules)
    assert "absent(" in rules["OutboxNoRelayUp"]["expr"]
    assert "deriv(" in rules["OutboxBacklogGrowing"]["expr"]


def _break_rule(n: int, change: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        rule = doc["groups"][0]["rules"][n]
        change(rule)

    return apply


BROKEN_ALERTS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("not under groups", lambda doc: doc.update(rules=doc.pop("groups")), "`groups:`"),
    ("no for", _break_rule(1, lambda r: r.pop("for")), "no `for:`"),
    ("bad for", _break_rule(1, lambda r: r.update({"for": "5 minutes"})), "not a Prometheus duration"),
    ("no summary", _break_rule(2, lambda r: r["annotations"].pop("summary")), "['summary']"),
    ("no severity", _break_rule(3, lambda r: r["labels"].pop("severity")), "severity None"),
    ("bad PromQL", _break_rule(4, lambda r: r.update(expr=r["expr"] + " >")), "does not parse"),
    ("unknown function", _break_rule(4, lambda r: r.update(expr="rates(outbox_relay_listening[5m]) > 0")),
     "does not parse"),
    ("unknown field", _break_rule(5, lambda r: r.update(summary="x")), "unknown fields ['summary']"),
    ("alert and record", _break_rule(5, lambda r: r.update(record="outbox:x")), "exactly one of"),
    ("missing runbook section", _break_rule(6, lambda r: r["annotations"].update(
        runbook_url="docs/troubleshooting.md#no-such-section")), "is not a section"),
    ("undocumented alert", _break_rule(7, lambda r: r.update(alert="OutboxSomethingNew")), "not explained"),
    ("label with a non-string value", _break_rule(7, lambda r: r["labels"].update(team=["a"])), "string value"),
]


@pytest.mark.parametrize(("change", "problem"), [(c, p) for _, c, p in BROKEN_ALERTS],
                         ids=[name for name, _, _ in BROKEN_ALERTS])
def test_the_alert_check_finds_a_broken_copy(change: Callable[[dict[str, Any]], None], problem: str) -> None:
    doc = copy.deepcopy(alert_rules())
    change(doc)
    problems = alert_problems(doc)
    assert any(problem in p for p in problems), problems


# -- promtool ---------------------------------------------------------------------------------------------

needs_promtool = pytest.mark.skipif(tool("promtool") is None,
                                    reason="promtool is not installed (Debian: prometheus; or set $PROMTOOL)")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool("promtool")), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, check=False)


@needs_promtool
def test_promtool_accepts_the_rules_and_refuses_a_broken_copy(tmp_path: Path) -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "alerts.yml"
    broken.write_text(ALERTS.read_text().replace("{{ $labels.sink }}", "{{ $labels.sink }", 1))
    result = promtool("check", "rules", str(broken))
    assert result.returncode != 0, "promtool accepted a broken template"


# Series in which each alert must fire (at the eval time, with those labels) and healthy ones in which
# none may. One relay job "relay" with relays a and b; 1-minute samples.
S = 'job="relay",instance="a"'
S_B = 'job="relay",instance="b"'
PROMTOOL_CASES: list[dict[str, Any]] = [
    {  # kafka: pending grows, nothing delivered; stalled: a sink no relay runs; totals: delivering
        "series": {f'outbox_relay_pending_events{{{S},sink="kafka"}}': "0+10x40",
                   f'outbox_relay_pending_events{{{S_B},sink="kafka"}}': "0+10x40",
                   f'outbox_relay_events_delivered_total{{{S},sink="kafka"}}': "5x40",
                   f'outbox_relay_pending_events{{{S},sink="stalled"}}': "0+1x40",
                   f'outbox_relay_pending_events{{{S},sink="totals"}}': "0+10x40",
                   f'outbox_relay_events_delivered_total{{{S},sink="totals"}}': "0+10x40"},
        "alerts": {("OutboxBacklogGrowing", "20m"): [{"severity": "critical", "job": "relay", "sink": "kafka"},
                                                     {"severity": "critical", "job": "relay", "sink": "stalled"}],
                   ("OutboxBacklogGrowing", "3m"): []},
    },
    {
        "series": {f'outbox_relay_oldest_pending_age_seconds{{{S},sink="kafka"}}': "0+60x45",
                   f'outbox_relay_oldest_pending_age_seconds{{{S_B},sink="kafka"}}': "0+60x45",
                   f'outbox_relay_oldest_pending_age_seconds{{{S},sink="totals"}}': "1x45"},
        "alerts": {("OutboxOldestPendingEvent", "9m"): [],
                   ("OutboxOldestPendingEvent", "12m"): [{"severity": "warning", "job": "relay", "sink": "kafka"}],
                   ("OutboxOldestPendingEvent", "40m"): [{"severity": "warning", "job": "relay", "sink": "kafka"},
                                                         {"severity": "critical", "job": "relay", "sink": "kafka"}]},
    },
    {  # kafka: a dead letter at 20m, the gauge rises (the counter's series appears only then, at 1);
       # totals: 3 from the start, none new; orders: one at 3m, a minute after monitoring began
        "series": {f'outbox_relay_dead_letters{{{S},sink="kafka"}}': "0x20 1x30",
                   f'outbox_relay_events_dead_lettered_total{{{S},sink="kafka"}}': "_x20 1x30",
                   f'outbox_relay_dead_letters{{{S},sink="totals"}}': "3x50",
                   f'outbox_relay_dead_letters{{{S},sink="orders"}}': "_ _ 0 1x47"},
        "alerts": {("OutboxNewDeadLetters", "5m"): [{"severity": "warning", "job": "relay", "sink": "orders"}],
                   ("OutboxNewDeadLetters", "19m"): [],
                   ("OutboxNewDeadLetters", "25m"): [{"severity": "warning", "job": "relay", "sink": "kafka"}],
                   ("OutboxNewDeadLetters", "45m"): []},
    },
    {  # job "relay": housekeeping stops at 0; job "fresh": relays up, no pass ever finished
        "series": {f"outbox_relay_listening{{{S}}}": "1x20",
                   f"outbox_relay_housekeeping_last_finished_age_seconds{{{S}}}": "0+60x20",
                   'outbox_relay_listening{job="fresh",instance="c"}': "1x20",
                   'outbox_relay_listening{job="ok",instance="d"}': "1x20",
                   'outbox_relay_housekeeping_last_finished_age_seconds{job="ok",instance="d"}': "3x20"},
        "alerts": {("OutboxHousekeepingStalled", "4m"): [{"severity": "warning", "job": "fresh"}],
                   ("OutboxHousekeepingStalled", "9m"): [{"severity": "warning", "job": "relay"},
                                                         {"severity": "warning", "job": "fresh"}]},
    },
    {  # a holds 100 of its 128 buckets; b drains and hangs; c is fine
        "series": {f'outbox_relay_buckets_held{{{S},sink="kafka"}}': "100x20",
                   f'outbox_relay_buckets_assigned{{{S},sink="kafka"}}': "128x20",
                   f"outbox_relay_draining{{{S}}}": "0x20",
                   f'outbox_relay_buckets_held{{{S_B},sink="kafka"}}': "128x20",
                   f'outbox_relay_buckets_assigned{{{S_B},sink="kafka"}}': "128x20",
                   f"outbox_relay_draining{{{S_B}}}": "0x5 1x15",
                   'outbox_relay_buckets_held{job="relay",instance="c",sink="kafka"}': "128x20",
                   'outbox_relay_buckets_assigned{job="relay",instance="c",sink="kafka"}': "128x20",
                   'outbox_relay_draining{job="relay",instance="c"}': "0x20"},
        "alerts": {("OutboxRelayNotReady", "3m"): [],
                   ("OutboxRelayNotReady", "15m"): [
                       {"severity": "warning", "job": "relay", "instance": "a", "sink": "kafka"},
                       {"severity": "warning", "job": "relay", "instance": "b"}]},
    },
    {  # relays until 5m, then none
        "series": {f"outbox_relay_listening{{{S}}}": "1x5",
                   f"outbox_relay_housekeeping_last_finished_age_seconds{{{S}}}": "1x5"},
        "alerts": {("OutboxNoRelayUp", "5m"): [],
                   ("OutboxNoRelayUp", "15m"): [{"severity": "critical"}]},
    },
    {  # a replaces its producer every 2 minutes from 10m on; b once
        "series": {f'outbox_relay_producer_recreations_total{{{S},sink="kafka"}}': "0x10 0+0.5x20",
                   f'outbox_relay_producer_recreations_total{{{S_B},sink="kafka"}}': "0x10 1x20"},
        "alerts": {("OutboxProducerReplacements", "9m"): [],
                   ("OutboxProducerReplacements", "25m"): [
                       {"severity": "warning", "job": "relay", "instance": "a", "sink": "kafka"}]},
    },
    {  # a transaction opens at 0 and stays open; job "ok" has none
        "series": {f"outbox_relay_oldest_writing_transaction_age_seconds{{{S}}}": "0+60x10",
                   'outbox_relay_oldest_writing_transaction_age_seconds{job="ok",instance="d"}': "0x10"},
        "alerts": {("OutboxLongWritingTransaction", "4m"): [],
                   ("OutboxLongWritingTransaction", "7m"): [{"severity": "warning", "job": "relay"}]},
    },
    {
        "series": {f"outbox_relay_metrics_refresh_age_seconds{{{S}}}": "0+60x15",
                   f"outbox_relay_metrics_refresh_age_seconds{{{S_B}}}": "3x15"},
        "alerts": {("OutboxMetricsStale", "5m"): [],
                   ("OutboxMetricsStale", "9m"): [{"severity": "warning", "job": "relay", "instance": "a"}]},
    },
    {  # topic "late" is missing from 0 on (the gauge counts the seconds held); "soon" for 2 minutes
        "series": {f'outbox_relay_topic_held_seconds{{{S},sink="kafka",topic="late"}}': "0+60x20",
                   f'outbox_relay_topic_held_seconds{{{S_B},sink="kafka",topic="soon"}}': "0+60x2"},
        "alerts": {("OutboxKafkaTopicHeld", "4m"): [],
                   ("OutboxKafkaTopicHeld", "8m"): [
                       {"severity": "warning", "job": "relay", "sink": "kafka", "topic": "late"}]},
    },
    {  # a fails a cycle a minute from 0 on; b stops failing after 5m
        "series": {f'outbox_relay_cycle_failures_total{{{S},sink="kafka"}}': "0+1x30",
                   f'outbox_relay_cycle_failures_total{{{S_B},sink="kafka"}}': "0+1x5 5x25"},
        "alerts": {("OutboxRelayCyclesFailing", "8m"): [],
                   ("OutboxRelayCyclesFailing", "20m"): [
                       {"severity": "warning", "job": "relay", "instance": "a", "sink": "kafka"}]},
    },
]
# All is well: busy relays delivering, nothing old, no dead letters, housekeeping running.
HEALTHY = {
    f'outbox_relay_pending_events{{{S},sink="kafka"}}': "20+0x60",
    f'outbox_relay_events_delivered_total{{{S},sink="kafka"}}': "0+600x60",
    f'outbox_relay_oldest_pending_age_seconds{{{S},sink="kafka"}}': "0.2x60",
    f'outbox_relay_dead_letters{{{S},sink="kafka"}}': "2x60",
    f'outbox_relay_events_retried_total{{{S},sink="kafka"}}': "0+1x60",
    f"outbox_relay_listening{{{S}}}": "1x60",
    f"outbox_relay_draining{{{S}}}": "0x60",
    f'outbox_relay_buckets_held{{{S},sink="kafka"}}': "256x60",
    f'outbox_relay_buckets_assigned{{{S},sink="kafka"}}': "256x60",
    f"outbox_relay_housekeeping_last_finished_age_seconds{{{S}}}": "4x60",
    f"outbox_relay_oldest_writing_transaction_age_seconds{{{S}}}": "0.01x60",
    f"outbox_relay_metrics_refresh_age_seconds{{{S}}}": "7x60",
    f'outbox_relay_producer_recreations_total{{{S},sink="kafka"}}': "1x60",
    f'outbox_relay_cycle_failures_total{{{S},sink="kafka"}}': "2x60",
}


def alert_names() -> list[str]:
    return sorted({r["alert"] for g in alert_rules()["groups"] for r in g["rules"]})


def promtool_tests(rule_file: str) -> dict[str, Any]:
    tests: list[dict[str, Any]] = []
    for case in PROMTOOL_CASES:
        tests.append({
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in case["series"].items()],
            "alert_rule_test": [{"eval_time": t, "alertname": name, "exp_alerts": [{"exp_labels": labels}
                                                                                    for labels in expected]}
                                for (name, t), expected in case["alerts"].items()],
        })
    tests.append({"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in HEALTHY.items()],
                  "alert_rule_test": [{"eval_time": t, "alertname": name, "exp_alerts": []}
                                      for name in alert_names() for t in ("30m", "59m")]})
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}


def run_promtool_tests(rules: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # promtool compares annotations too: test the expressions, `for:` and labels without them (the
    # annotations' templates are what `promtool check rules` checks).
    rules = copy.deepcopy(rules)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(promtool_tests("rules.yml")))
    return promtool("test", "rules", "tests.yml", cwd=tmp_path)


def test_every_alert_has_a_case_that_fires_it() -> None:
    fired = {name for case in PROMTOOL_CASES for (name, _), expected in case["alerts"].items() if expected}
    assert fired == set(alert_names())


@needs_promtool
def test_each_alert_fires_when_it_should_and_not_when_all_is_well(tmp_path: Path) -> None:
    result = run_promtool_tests(alert_rules(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize(("old", "new"), [
    ("> 300\n        for: 5m", "> 3000\n        for: 5m"),  # the oldest-pending warning never fires
    ("unless on (job, sink)", "and on (job, sink)"),  # the backlog alert needs a delivery to fire
    ("absent(outbox_relay_listening)", "absent(outbox_relay_listening_x)"),  # fires while relays are up
])
def test_promtool_tests_find_an_alert_that_misfires(tmp_path: Path, old: str, new: str) -> None:
    text = ALERTS.read_text()
    assert old in text
    result = run_promtool_tests(yaml.safe_load(text.replace(old, new, 1)), tmp_path)
    assert result.returncode != 0, result.stdout
