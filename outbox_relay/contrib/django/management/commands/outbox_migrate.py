"""``manage.py outbox_migrate [--database ALIAS]``: apply the outbox schema's pending migrations."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.db import DEFAULT_DB_ALIAS

from outbox_relay.contrib.django import migrate


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type information
    help = "Apply the pending migrations of the outbox schema (outbox-relay migrate) on a Django database."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS,
                            help="the database alias to migrate (default: %(default)s)")

    def handle(self, *args: Any, **options: Any) -> None:
        applied = migrate(options["database"])
        for m in applied:
            self.stdout.write(f"applied {m.version:04d}_{m.name}")
        self.stdout.write(f"outbox schema up to date ({len(applied)} migrations applied)")
