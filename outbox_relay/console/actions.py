"""Actions: retry, skip, pause and resume a key; retry and discard dead letters (one, a selection, or all
matching a filter). Each is a form that leads to a confirmation page; the confirmed POST runs the
``outbox_relay.admin`` function and writes its audit record in the same transaction."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import admin
from ..errors import OutboxError
from .web import checked_form, console, problem, render, session

KEY_ACTIONS = ("retry-key", "skip-key", "pause-key", "resume-key")
DEAD_ACTIONS = ("retry-dead", "discard-dead")
SCOPES = ("selected", "key", "all")  # dead letters: the ticked ones, every one of the key filter, all
SELECTION_MAX = 500


@dataclass(frozen=True)
class Plan:
    """A validated action: what the confirmation page says and the run does."""

    action: str
    sink: str
    key: str | None
    event_ids: tuple[str, ...]
    scope: str | None
    reason: str | None

    def describe(self) -> str:
        if self.action in KEY_ACTIONS:
            verb = {"retry-key": "Retry now the parked head of", "skip-key": "Skip (move to dead letters) the "
                    "parked head of", "pause-key": "Pause (hold every event of)", "resume-key": "Resume"}[self.action]
            return f"{verb} key {self.key!r} for sink {self.sink!r}."
        verb = "Retry" if self.action == "retry-dead" else "Discard for good"
        if self.scope == "selected":
            return f"{verb} {len(self.event_ids)} selected dead letter(s) of sink {self.sink!r}."
        if self.scope == "key":
            return f"{verb} every dead letter of key {self.key!r} of sink {self.sink!r}."
        return f"{verb} every dead letter of sink {self.sink!r}."

    def target(self) -> str:
        """What the audit record names."""
        if self.action in KEY_ACTIONS or self.scope == "key":
            return f"key {self.key}" + (f" (reason: {self.reason})" if self.reason else "")
        if self.scope == "selected":
            return "events " + ", ".join(self.event_ids)
        return "all dead letters"

    def fields(self) -> list[tuple[str, str]]:
        """The hidden fields that carry the plan from the confirmation page to the run."""
        out = [("action", self.action), ("sink", self.sink)]
        out += [("key", self.key)] if self.key is not None else []
        out += [("scope", self.scope)] if self.scope else []
        out += [("reason", self.reason)] if self.reason else []
        return out + [("event", e) for e in self.event_ids]


def parse_plan(form: dict[str, Any]) -> Plan:
    """The form's action, checked; OutboxError names what is missing or wrong."""
    action, sink = form.get("action"), form.get("sink")
    if action not in KEY_ACTIONS + DEAD_ACTIONS:
        raise OutboxError(f"no such action {str(action)[:40]!r}")
    if not isinstance(sink, str) or not sink:
        raise OutboxError("say which sink")
    key = form.get("key") or None
    reason = (form.get("reason") or "").strip() or None
    ids: tuple[str, ...] = ()
    scope = None
    if action in KEY_ACTIONS:
        if not key:
            raise OutboxError("say which key")
    else:
        scope = form.get("scope")
        if scope not in SCOPES:
            raise OutboxError("say which dead letters: the selected ones, those of the key filter, or all")
        if scope == "selected":
            raw = [e for e in form.get("event") or [] if isinstance(e, str) and e]
            if not raw:
                raise OutboxError("no dead letter is selected: tick the ones to change")
            if len(raw) > SELECTION_MAX:
                raise OutboxError(f"at most {SELECTION_MAX} dead letters at once (or use all of a key, or all)")
            try:
                ids = tuple(sorted({str(uuid.UUID(e)) for e in raw}))
            except ValueError:
                raise OutboxError("a selected dead letter is not an event id") from None
        elif scope == "key" and not key:
            raise OutboxError("a filter by key needs the key")
        if scope != "key":
            key = None
    return Plan(action=str(action), sink=sink, key=key if isinstance(key, str) else None, event_ids=ids,
                scope=scope if isinstance(scope, str) else None, reason=reason)


def _run(conn: Any, plan: Plan, who: str) -> tuple[int, str]:
    """Run the plan (one admin call): how many events it changed, and a sentence saying what it did."""
    if plan.action == "retry-key":
        r = admin.retry_key(conn, plan.key or "", plan.sink)
        return 1, f"the head {r.event_id} ({r.parked} parked in all) is due now: its relay retries it at once"
    if plan.action == "skip-key":
        s = admin.skip_key(conn, plan.key or "", plan.sink)
        return 1, f"the head {s.event_id} went to dead letters; {s.now_due} event(s) behind it are due now"
    if plan.action == "pause-key":
        p = admin.pause_key(conn, plan.key or "", plan.sink, reason=plan.reason, by=who)
        return (0, "it was already paused") if p.already_paused else (1, "its events are held until resumed")
    if plan.action == "resume-key":
        m = admin.resume_key(conn, plan.key or "", plan.sink)
        return (0, "it was not paused") if not m.was_paused else (m.now_due or 0, f"{m.now_due} held event(s) due now")
    change = admin.retry_dead_letters if plan.action == "retry-dead" else admin.discard_dead_letters
    d = change(conn, plan.sink, event_ids=list(plan.event_ids) or None, key=plan.key, all=plan.scope == "all")
    done = "queued again, due now" if plan.action == "retry-dead" else "deleted"
    return d.count, f"{d.count} dead letter(s) {done}"


def _may_act(request: Request) -> tuple[str | None, Response | None]:
    c = console(request)
    if c.tokens is None:
        return None, problem(request, 403, "this console is read-only: it was started without --token-file")
    s = session(request)
    if s is None:
        return None, problem(request, 403, "actions need the console's token: sign in first")
    return s.who, None


async def confirm(request: Request) -> Response:
    form, refused = await checked_form(request)
    if refused is not None:
        return refused
    who, refused = _may_act(request)
    if refused is not None:
        return refused
    try:
        plan = parse_plan(form)
    except OutboxError as exc:
        return problem(request, 400, str(exc))
    return render(request, "confirm.html", title="Confirm", plan=plan, who=who)


async def run(request: Request) -> Response:
    form, refused = await checked_form(request)
    if refused is not None:
        return refused
    who, refused = _may_act(request)
    if refused is not None or who is None:
        return refused or problem(request, 403, "sign in first")
    try:
        plan = parse_plan(form)
    except OutboxError as exc:
        return problem(request, 400, str(exc))
    return await run_in_threadpool(_execute, request, plan, who)


def _execute(request: Request, plan: Plan, who: str) -> Response:
    with console(request).connection() as conn:
        try:
            with conn.transaction():  # the action and its audit record commit together
                count, said = _run(conn, plan, who)
                record = admin.record_action(conn, who=who, action=plan.action, sink=plan.sink,
                                             target=plan.target(), count=count)
        except OutboxError as exc:
            admin.record_action(conn, who=who, action=plan.action, sink=plan.sink, target=plan.target(), count=0,
                                refused=str(exc))
            return problem(request, 409, f"refused: {exc}")
    return render(request, "done.html", title="Done", plan=plan, said=said, count=count, record=record)


routes = [Route("/actions/confirm", confirm, methods=["POST"]), Route("/actions/run", run, methods=["POST"])]
