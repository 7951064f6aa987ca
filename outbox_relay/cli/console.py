"""``outbox-relay console``: serve the operator console (outbox_relay.console, extra ``console``) with uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..settings import env_var
from .exit_codes import EXIT_OK
from .invocation import dsn_from_args, migrated_database
from .output import say
from .parsers import add_dsn_option
from .values import MAX_ATTEMPTS, int_between

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
TOKEN_FILE_ENV = "OUTBOX_CONSOLE_TOKEN_FILE"


def add_parser(sub: Any) -> None:  # the subparsers of build_parser (argparse keeps their type private)
    p = sub.add_parser("console", help="serve the operator console in a browser (the console extra): relays, sinks, "
                                       "keys, dead letters, history; confirmed, audited actions")
    add_dsn_option(p)
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="listen on this address; beyond this host, reading needs a token too (default 127.0.0.1)")
    p.add_argument("--port", type=int_between(1, 65535), default=DEFAULT_PORT, help="listen on this port")
    p.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help=f"the tokens that may act (one a line: LABEL TOKEN); without it the console is read-only "
                        f"[env {TOKEN_FILE_ENV}]")
    p.add_argument("--max-attempts", type=int_between(*MAX_ATTEMPTS), default=None, metavar="N",
                   help=f"the relays' --max-attempts, for 'attempt 3 of N' (default: {env_var('max_attempts')}, "
                        "else 10)")


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_console(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..console import create_app
    except ImportError as exc:
        raise ConfigurationError(f"the console needs the console extra: pip install 'outbox-relay[console]' "
                                 f"({exc.name} is missing)") from None
    dsn = dsn_from_args(args)
    with migrated_database(dsn):  # a migrated database, or a clear error now rather than on the first page
        pass
    token_file = args.token_file or (Path(os.environ[TOKEN_FILE_ENV]) if os.environ.get(TOKEN_FILE_ENV) else None)
    beyond = not loopback(args.host)
    if beyond and token_file is None:
        raise ConfigurationError(f"listening on {args.host} (beyond this host) needs --token-file: reading needs a "
                                 "token there too")
    max_attempts = args.max_attempts or int(os.environ.get(env_var("max_attempts")) or 0) or None
    app = create_app(dsn, token_file=token_file, read_needs_token=beyond,
                     **({"max_attempts": max_attempts} if max_attempts else {}))
    say(f"outbox-relay console: http://{args.host}:{args.port}/ ("
         + ("actions need a token of " + str(token_file) if token_file else "read-only: no --token-file") + ")")
    # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again for the handler it replaced:
    # a handler that does nothing makes that a normal exit (status 0) rather than death by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return EXIT_OK
