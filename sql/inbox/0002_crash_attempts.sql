-- 0002_crash_attempts: attempts of a partition's head message that survive the process.
--
-- A handler that kills its process (segfault, out of memory, os._exit, a watchdog's SIGKILL) reports
-- no failure, so attempts counted in memory never reach max_attempts: the message was retried forever
-- across restarts and blocked its partition. Only the head of a partition can be attempted again (the
-- partition waits behind it), so one record per partition suffices. It is written, committed, before
-- an attempt made alone (a retry, or the first message after the previous holder stopped without
-- releasing its lease), so a crash during that attempt counts; healthy batches write nothing extra.

ALTER TABLE outbox_inbox.positions
    ADD COLUMN attempt_message_id text,                 -- the head message these attempts are of
    ADD COLUMN attempts           integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    ADD COLUMN last_error         text;                 -- its last failure (or that the process stopped)
