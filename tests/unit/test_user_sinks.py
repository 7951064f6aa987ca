"""The sink contract's checks without a database: what `--sink MODULE:ATTR` accepts and the errors it
gives (module, attribute, not a sink, duplicate names), the answers' mapping, the event as given."""

from __future__ import annotations

import json
import textwrap
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from outbox_relay.compose import default_sinks, load_sink
from outbox_relay.errors import ConfigurationError
from outbox_relay.settings import load_settings
from outbox_relay.sinks import Delivered, GiveUp, Retry, SinkUnavailable, check_sink
from outbox_relay.sinks.adapter import EventSinkAdapter, outcome_of, sink_event
from outbox_relay.sinks.engine import CommitAtEnd
from outbox_relay.store import EventFilter, StoredEvent

DSN = "postgresql://relay@db.invalid/app"


@pytest.fixture
def sinks_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"user_sinks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class Audit:
            kind = "audit"
            def __init__(self, name="audit"):
                self.name = name
            def deliver(self, event):
                return None

        audit = Audit()
        twin = Audit()
        def make():
            return Audit("made")
        def broken():
            raise RuntimeError("no endpoint configured")
        class NoKind:
            name = "x"
            def deliver(self, event):
                return None
        no_kind = NoKind()
        not_callable = 42
    """))
    (tmp_path / f"{name}_raises.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / f"{name}_imports.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_sink_takes_an_instance_or_a_factory(sinks_module: str) -> None:
    assert load_sink(f"{sinks_module}:audit").name == "audit"
    assert load_sink(f"{sinks_module}:make").name == "made"


@pytest.mark.parametrize(("attr", "message"), [
    (":nothing", "has no attribute 'nothing'"),
    (":no_kind", "is not a sink: no `kind` attribute"),
    (":not_callable", "int object (--sink {m}:not_callable) is not a sink: no `name` attribute"),
    (":broken", "calling broken() to make the sink failed: RuntimeError: no endpoint configured"),
])
def test_load_sink_names_what_is_wrong(sinks_module: str, attr: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=None) as caught:
        load_sink(sinks_module + attr)
    assert message.format(m=sinks_module) in str(caught.value)


def test_load_sink_tells_a_missing_module_from_a_module_that_fails(sinks_module: str) -> None:
    with pytest.raises(ConfigurationError, match="no module named 'nowhere_at_all'"):
        load_sink("nowhere_at_all.sinks:audit")
    with pytest.raises(ConfigurationError, match=r"importing module .* failed: RuntimeError: boom at import"):
        load_sink(f"{sinks_module}_raises:audit")
    with pytest.raises(ConfigurationError, match=r"importing module .* failed: No module named 'no_such_dependency"):
        load_sink(f"{sinks_module}_imports:audit")


def test_two_sinks_of_one_name_are_refused(sinks_module: str) -> None:
    settings = load_settings(dsn=DSN, kafka=False, sink=[f"{sinks_module}:audit", f"{sinks_module}:twin"])
    with pytest.raises(ConfigurationError, match="two sinks of this relay have the name 'audit'"):
        default_sinks(settings)


def test_settings_read_several_sinks_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SINK", "a.b:c, d:e  f.g:make")
    assert load_settings(dsn=DSN, kafka=False).sink == ["a.b:c", "d:e", "f.g:make"]
    with pytest.raises(ConfigurationError, match=r"sink \(--sink, OUTBOX_SINK\): 'a\.b' is not MODULE:ATTR"):
        load_settings(dsn=DSN, kafka=False, sink=["a.b"])


class Minimal:
    name, kind = "m", "mine"

    def deliver(self, event: object) -> None:
        return None


def test_check_sink_lists_every_problem() -> None:
    class Bad:
        name = "Bad Name"
        kind = "Web-Hook"
        topics = "orders"
        concurrency = 0

    with pytest.raises(ConfigurationError) as caught:
        check_sink(Bad())
    text = str(caught.value)
    for part in ("name 'Bad Name' is not a sink name", "kind 'Web-Hook' is not a sink kind",
                 "no `deliver(event)` method", "`topics` must be None or a collection of str",
                 "`concurrency` must be an int from 1 to 256, not 0"):
        assert part in text, text
    assert check_sink(Minimal()).name == "m"


def test_deliver_many_must_be_a_plain_method_beside_a_plain_deliver() -> None:
    class AsyncMany(Minimal):
        async def deliver_many(self, events: list[object]) -> list[None]:
            return [None] * len(events)

    class AsyncDeliver(Minimal):
        async def deliver(self, event: object) -> None:  # type: ignore[override]
            return None

        def deliver_many(self, events: list[object]) -> list[None]:
            return [None] * len(events)

    class NotCallable(Minimal):
        deliver_many = 3

    for bad in (AsyncMany(), AsyncDeliver(), NotCallable()):
        with pytest.raises(ConfigurationError, match="`deliver_many` must be a plain method"):
            check_sink(bad)

    class Many(Minimal):
        def deliver_many(self, events: list[object]) -> list[None]:
            return [None] * len(events)

    assert EventSinkAdapter(Many()).many and not EventSinkAdapter(Minimal()).many

    class Wrapped(Many):  # a subclass of a sink with waves that wraps deliver: called as it says
        def deliver(self, event: object) -> None:
            return super().deliver(event)

    class WrappedMany(Wrapped):
        def deliver_many(self, events: list[object]) -> list[None]:
            return super().deliver_many(events)

    on_instance = Many()
    on_instance.deliver = lambda event: None  # type: ignore[method-assign]
    assert not EventSinkAdapter(Wrapped()).many and not EventSinkAdapter(on_instance).many
    assert EventSinkAdapter(WrappedMany()).many


def test_the_adapter_reads_the_optional_attributes() -> None:
    sink = Minimal()
    assert EventSinkAdapter(sink).event_filter is None
    sink.topics = {"orders"}  # type: ignore[attr-defined]
    sink.types = ["OrderPaid", "OrderPlaced"]  # type: ignore[attr-defined]
    sink.concurrency = 8  # type: ignore[attr-defined]
    adapter = EventSinkAdapter(sink)
    assert adapter.event_filter == EventFilter(types=("OrderPaid", "OrderPlaced"), topics=("orders",))
    assert adapter.concurrency == 8 and adapter.kind == "mine"


def test_answers_map_to_the_engines_outcomes() -> None:
    assert outcome_of(None) is None and outcome_of(Delivered()) is None
    retry = outcome_of(Retry("HTTP 503", after_seconds=1e9))
    assert retry is not None and retry.retriable and retry.error == "HTTP 503" and retry.retry_after == 86400.0
    give_up = outcome_of(GiveUp("HTTP 400"))
    assert give_up is not None and not give_up.retriable
    wrong = outcome_of(True)
    assert wrong is not None and wrong.retriable and "returned a bool" in wrong.error
    secret = outcome_of(Retry("failed: postgresql://u:hunter2@db/x"))
    assert secret is not None and "hunter2" not in secret.error
    with pytest.raises(ValueError, match="after_seconds"):
        Retry("x", after_seconds=float("inf"))
    with pytest.raises(ValueError, match="retry_after_seconds"):
        SinkUnavailable("x", retry_after_seconds=-1)


def stored(headers: str = "{}") -> StoredEvent:
    return StoredEvent(bucket=1, xid=5, seq=2, id=uuid.uuid4(), key="k", topic="t", type="T",
                       payload_text='{"a": 1}', headers_text=headers, time=datetime(2026, 1, 1, tzinfo=UTC),
                       attempts=2, version=3)


def test_the_event_as_a_sink_gets_it() -> None:
    e = sink_event(stored(json.dumps({"traceparent": "00-x"})))
    assert not isinstance(e, type(None)) and hasattr(e, "payload")
    assert e.payload == {"a": 1} and e.payload_json == '{"a": 1}'  # type: ignore[union-attr]
    assert e.attempt == 3 and e.version == 3 and e.headers == {"traceparent": "00-x"}  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        e.headers["x"] = "y"  # type: ignore[index,union-attr]
    bad = sink_event(stored('{"n": 1}'))
    assert not hasattr(bad, "payload") and not bad.retriable  # type: ignore[union-attr]


def test_a_sink_that_raises_system_exit_is_charged_like_any_error() -> None:
    import threading

    from outbox_relay.sinks.engine import Failure

    class Exits:
        name, kind = "exits", "mine"

        def deliver(self, event: object) -> None:
            raise SystemExit(3)

    adapter = EventSinkAdapter(Exits())
    e = stored()
    got: dict[str, object] = {}

    def commit(outcomes: dict[uuid.UUID, Failure | None], tx: object) -> set[int]:
        got.update(outcomes=outcomes)
        return {1}

    try:
        assert adapter.deliver([e], {1: 1}, CommitAtEnd.of(commit), threading.Event()) == {1}  # type: ignore[arg-type]
    finally:
        adapter.close()
    outcome = got["outcomes"][e.id]  # type: ignore[index]
    assert isinstance(outcome, Failure) and outcome.retriable and outcome.error == "SystemExit: 3"


def test_answers_that_skipped_their_checks_are_a_bug_of_the_sink_never_a_crash() -> None:
    from outbox_relay.sinks.adapter import unavailable_wait

    class LaxRetry(Retry):
        def __post_init__(self) -> None:  # skips the check of after_seconds
            pass

    for after in (float("nan"), float("inf"), -5.0, "10", True):
        failure = outcome_of(LaxRetry("busy", after_seconds=after))  # type: ignore[arg-type]
        assert failure is not None and failure.retriable and failure.retry_after is None
        assert "after_seconds" in failure.error, after

    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    for answer in (Retry(Unprintable()), GiveUp(Unprintable())):  # type: ignore[arg-type]
        failure = outcome_of(answer)
        assert failure is not None and "Unprintable whose str() failed" in failure.error

    class Down(SinkUnavailable):
        def __init__(self) -> None:  # never calls SinkUnavailable.__init__
            pass

    assert unavailable_wait(Down()) == 5.0
    assert unavailable_wait(SinkUnavailable("x", 1e12)) == 86400.0


def test_a_sink_class_is_made_into_its_instance_or_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' own example is a class with class attributes: `--sink mod:MySink` must make one (a class is a
    zero-argument callable), and a class passed where an instance belongs is refused (its `deliver` called
    on the class would fail for every event, then dead-letter them all)."""
    name = f"class_sinks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class MySink:
            name = "crm"
            kind = "crm"
            def deliver(self, event):
                return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    made = load_sink(f"{name}:MySink")
    assert type(made).__name__ == "MySink" and not isinstance(made, type)
    with pytest.raises(ConfigurationError, match=r"is a class, not a sink: pass an instance \(MySink\(\)\)"):
        check_sink(type(made))
    with pytest.raises(ConfigurationError, match="is a class, not a sink"):
        EventSinkAdapter(type(made))  # type: ignore[arg-type]


def test_a_sink_module_or_factory_that_exits_is_a_configuration_error(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"exiting_sinks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import sys
        def make():
            sys.exit("AUDIT_URL is not set")
    """))
    (tmp_path / f"{name}_argv.py").write_text("import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"calling make\(\) to make the sink failed: it called sys.exit\("
                                                 r"'AUDIT_URL is not set'\)"):
        load_sink(f"{name}:make")
    with pytest.raises(ConfigurationError, match=r"importing module .* failed: it called sys.exit\(2\)"):
        load_sink(f"{name}_argv:x")


def test_a_sink_whose_topics_or_types_can_match_nothing_is_refused() -> None:
    """An empty collection (or only empty names, as "".split(",") gives) read every event past the sink
    without delivering one, silently."""
    for attr, value in (("topics", set()), ("types", []), ("topics", [""])):
        sink = Minimal()
        setattr(sink, attr, value)
        with pytest.raises(ConfigurationError, match=f"`{attr}` is empty: the sink would never get an event"):
            check_sink(sink)
    sink = Minimal()
    sink.topics = {"orders"}  # type: ignore[attr-defined]
    assert check_sink(sink) is sink


@pytest.mark.parametrize("kind", ["kafka", "projection", "webhook"])
def test_a_user_sink_may_not_take_a_kind_of_the_products_own(kind: str) -> None:
    class Impostor:
        name = "mine"

        def deliver(self, event: object) -> None:
            return None

    Impostor.kind = kind  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match=f"kind '{kind}' is reserved for .*name your sink's own kind"):
        check_sink(Impostor(), "--sink app:mine")
    declared = Impostor()
    declared.__dict__["kind"] = kind
    with pytest.raises(ConfigurationError, match="is reserved"):
        check_sink(declared)


def test_the_products_webhook_sink_and_its_subclasses_keep_their_kind() -> None:
    from outbox_relay.sinks.webhook import WebhookSecret, WebhookSink

    class Tenanted(WebhookSink):
        pass

    for cls in (WebhookSink, Tenanted):
        sink = cls("http://localhost:9/hook", WebhookSecret.generate())
        assert check_sink(sink).kind == "webhook"
