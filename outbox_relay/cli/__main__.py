"""``python -m outbox_relay.cli``: the ``outbox-relay`` command."""

import sys

from . import main

sys.exit(main())
