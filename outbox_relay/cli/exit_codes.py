"""The exit statuses of ``outbox-relay`` (README and docs/configuration.md list them)."""

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and some of its work failed (replay: events it could not send)
EXIT_ERROR = 2  # nothing (more) done: bad arguments or settings, database unreachable or not migrated, refused
EXIT_INTERNAL = 3  # an unexpected exception (a bug): one line, the traceback with --log-level debug
EXIT_STOPPED = 4  # run: the relay stopped by itself, because one of its sinks can not go on (dropped)
EXIT_INTERRUPTED = 130  # rebuild/replay stopped by a signal; run the same command again to resume
