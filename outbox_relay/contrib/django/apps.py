"""The Django app ``outbox_relay`` (INSTALLED_APPS: "outbox_relay.contrib.django"): the outbox schema
follows ``manage.py migrate``, and ``manage.py outbox_migrate`` applies it alone."""

from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate

from . import APP_LABEL, migrate_on_post_migrate


class OutboxRelayConfig(AppConfig):  # type: ignore[misc]  # Django ships no type information
    name = "outbox_relay.contrib.django"
    label = APP_LABEL
    verbose_name = "Outbox relay"

    def ready(self) -> None:
        # Sent once per app and database after migrate (and flush): sender=self runs it once per database.
        post_migrate.connect(migrate_on_post_migrate, sender=self, dispatch_uid="outbox_relay.migrate")
