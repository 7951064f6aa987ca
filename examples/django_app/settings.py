"""Settings of the example Django project: the database comes from ``OUTBOX_DSN`` (a libpq URL or
keywords), e.g. ``postgresql://app@localhost/app``."""

from __future__ import annotations

import os
from typing import Any

from psycopg.conninfo import conninfo_to_dict


def database(dsn: str) -> dict[str, Any]:
    """A DATABASES entry for a libpq DSN; what is not NAME/USER/PASSWORD/HOST/PORT goes to OPTIONS."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3, which outbox-relay installs
        "NAME": params.pop("dbname", ""), "USER": params.pop("user", ""), "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""), "PORT": str(params.pop("port", "")), "OPTIONS": params,
    }


if "OUTBOX_DSN" not in os.environ:
    raise SystemExit("set OUTBOX_DSN to the PostgreSQL database of the example (or run demo.py, which can start one)")

DATABASES = {"default": database(os.environ["OUTBOX_DSN"])}
INSTALLED_APPS = [
    "outbox_relay.contrib.django",  # `manage.py migrate` applies the outbox schema too
    "shop",
]
OUTBOX_RELAY_DEFAULT_TOPIC = "orders"  # the topic of events published without one
ROOT_URLCONF = "urls"
MIDDLEWARE: list[str] = []
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
