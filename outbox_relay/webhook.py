"""The webhook sink's public names where the docs give them (``from outbox_relay.webhook import verify``,
``--sink outbox_relay.webhook:from_env``), and the command that makes a signing secret:
``python -m outbox_relay.webhook secret``. The code is in ``outbox_relay/sinks/webhook/``."""

from __future__ import annotations

import sys

from .sinks.webhook import InvalidSignature, WebhookSecret, WebhookSink, check_url, from_env, from_settings, verify


def main(argv: list[str]) -> int:
    if argv == ["secret"]:
        print(WebhookSecret.generate())
        return 0
    print("usage: python -m outbox_relay.webhook secret   (prints a new signing secret)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["InvalidSignature", "WebhookSecret", "WebhookSink", "check_url", "from_env", "from_settings", "main",
           "verify"]
