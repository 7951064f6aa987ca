"""``create_app``: the console's Starlette application, its routes and its one background task (a
sample of every sink's backlog each minute, for the overview's charts)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from .. import admin
from ..dsn import redact, remember_dsn
from ..errors import ConfigurationError
from . import actions, audit, history, ledger, overview, signin, sink
from .security import SecurityHeaders, load_tokens
from .web import HERE, Console

log = logging.getLogger("outbox_relay.console")

SAMPLE_SECONDS = 60.0


def create_app(dsn: str, *, token_file: str | Path | None = None, read_needs_token: bool = False,
               max_attempts: int = admin.DEFAULT_MAX_ATTEMPTS, sample_seconds: float | None = SAMPLE_SECONDS,
               pool_size: int = 4) -> Starlette:
    """The console over the outbox database ``dsn``. ``token_file``: the tokens that may act (without it the
    console is read-only); ``read_needs_token``: pages need a signed-in session too (set it when listening
    beyond this host); ``max_attempts``: the relays' --max-attempts ("attempt 3 of N");
    ``sample_seconds``: how often to sample the backlog for the charts (None: never, e.g. a second
    console of the same database)."""
    remember_dsn(dsn)
    tokens = load_tokens(token_file) if token_file is not None else None
    if read_needs_token and tokens is None:
        raise ConfigurationError("a console that needs a token to read needs --token-file")
    pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        dsn, min_size=1, max_size=pool_size, kwargs={"autocommit": True, "application_name": "outbox-console",
                    # Never prepared: each page's queries are planned for their values (GUIDE section 4: a
                    # generic plan of an "x IS NULL OR col = x" filter can not use the index).
                    "prepare_threshold": None},
        open=False)
    state = Console(pool=pool, dsn_shown=redact(dsn), tokens=tokens, read_needs_token=read_needs_token,
                    max_attempts=max_attempts)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(pool.open, True, 10.0)
        sampler = asyncio.create_task(_sample_every(state, sample_seconds)) if sample_seconds else None
        try:
            yield
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            await run_in_threadpool(pool.close)

    routes: list[BaseRoute] = [*overview.routes, *sink.routes, *ledger.routes, *history.routes, *audit.routes,
                               *actions.routes, *signin.routes,
                               Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static")]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.console = state
    app.add_middleware(SecurityHeaders)
    return app


def sample_once(state: Console) -> None:
    """One sample of every sink (admin.take_sample); a failure is logged, the next minute tries again."""
    try:
        with state.connection() as conn:
            admin.take_sample(conn)
    except (psycopg.Error, OSError) as exc:
        log.warning("console: sampling the backlog failed: %s", redact(str(exc)))


async def _sample_every(state: Console, seconds: float) -> None:
    while True:
        await run_in_threadpool(sample_once, state)
        await asyncio.sleep(seconds)
