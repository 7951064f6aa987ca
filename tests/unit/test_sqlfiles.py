"""The named queries as the code sends them: compacted, and short enough for psycopg's query cache."""

from __future__ import annotations

import psycopg._queries

from outbox_relay.sqlfiles import compact, queries, sql_dir


def test_comments_and_indentation_go_literals_and_the_purpose_line_stay() -> None:
    sql = ("-- Purpose of the query.\n"
           "-- more about it\n"
           "SELECT 'a -- b', \"x--y\" -- trailing\n"
           "    FROM t /* block */ WHERE z = $$ -- kept $$ AND q = $f$ a'b -- c $f$\n"
           "      AND w = 'it''s -- x' - 1 AND v = 2/3")
    assert compact(sql) == ("-- Purpose of the query.\n"
                            "SELECT 'a -- b', \"x--y\" FROM t WHERE z = $$ -- kept $$ AND q = $f$ a'b -- c $f$\n"
                            "AND w = 'it''s -- x' - 1 AND v = 2/3")


def test_a_query_without_a_purpose_line_keeps_its_first_statement_line() -> None:
    assert compact("SELECT 1 -- one\n  , 2") == "SELECT 1 , 2"


def test_every_named_query_fits_psycopg_s_query_cache() -> None:
    # Longer queries have their placeholders parsed again on every execution (sqlfiles.compact).
    limit = psycopg._queries.MAX_CACHED_STATEMENT_LENGTH
    for path in sorted((sql_dir() / "queries").glob("*.sql")):
        for name, sql in queries(path.stem).items():
            assert len(sql.encode()) <= limit, f"{path.stem}.{name}: {len(sql.encode())} bytes"


def test_the_cursor_only_checkpoint_is_the_first_step_of_the_whole_one() -> None:
    # store.Checkpoint.statement picks relay.advance for a batch that only moves cursors: the same
    # fenced UPDATE as the whole checkpoint's first step, or the two would fence differently.
    def fenced_update(sql: str) -> str:  # the batch's rows (v) and the fenced UPDATE, without comments
        text = " ".join(line.split("--", 1)[0] for line in sql.splitlines())
        return " ".join(text.split("WITH v AS (", 1)[1].split("RETURNING c.bucket", 1)[0].split()).replace(
            "moved AS (", "fenced AS (")

    assert fenced_update(queries("relay")["advance"]) == fenced_update(queries("relay")["checkpoint"])
