"""One try of a key rebuild (key_rebuild.py) for an ``async def`` projection: in one transaction, clear
the key's state and replay its history. The one source: key_replay.py (sync projections) is
generated from it by scripts/async_to_sync.py."""

from __future__ import annotations

import secrets

import psycopg

from outbox_relay.sqlfiles import query
from outbox_relay.store import event_reader

from .declare import Projection
from .drive_async import adrive
from .key_replay_parts import key_batch, key_begin, key_failures, key_params, replayed
from .rebuild_error import RebuildError
from .walk import walk


async def areplay_key(projection: Projection, dsn: str, key: str) -> int:
    """The events replayed (see ``rebuild_key``)."""
    assert projection.clear_key is not None
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(query("projections", "prepare_session"))
        await conn.set_read_only(False)  # conn.transaction() begins READ WRITE
        async with conn.transaction():
            token = secrets.token_hex(8)
            await conn.execute(query("projections", "begin_batch"), key_begin(token))
            cur = await conn.execute(query("rebuild", "key_cursor"), {"sink": projection.name, "key": key})
            cursor = await cur.fetchone()
            if cursor is None:
                raise RebuildError(f"projection {projection.name!r} has never run against this database")
            cur = await conn.execute(query("rebuild", "key_history"), key_params(projection, key, cursor))
            read, _ = event_reader(cur)
            events = [read(r) for r in await cur.fetchall()]
            await projection.clear_key(key, conn)
            batch = key_batch(projection, key, cursor, events, token)
            with key_failures(projection, key):
                await adrive(walk(batch, careful=False), conn, projection.handler)
            return replayed(projection, key, batch)
