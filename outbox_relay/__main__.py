"""``python -m outbox_relay``: the ``outbox-relay`` command."""

import sys

from .cli import main

sys.exit(main())
