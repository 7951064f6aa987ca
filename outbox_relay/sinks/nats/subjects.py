"""Where an event goes in NATS: the subject ``<prefix>.<topic>.<key token>``.

The topic's dots are subject token separators (topic ``orders.eu`` is the tokens ``orders`` and ``eu``), and
the key is always the last token, escaped by ``subject_token`` so that it is exactly one token: a consumer
filters one topic with ``<prefix>.<topic>.*`` and one key with ``<prefix>.<topic>.<subject_token(key)>``.

The escaping: ASCII letters, digits and ``- _ ~ : = @ + ,`` stay as they are; every other character
(``.``, ``*``, ``>``, ``%``, whitespace, ``$``, non-ASCII, ...) becomes ``%XX`` per byte of its UTF-8, upper-case
hex. It is one-to-one (``%`` itself is escaped), and ``urllib.parse.unquote`` turns a token back into its key.
"""

from __future__ import annotations

import re
import string

from ...errors import ConfigurationError

SAFE = frozenset(string.ascii_letters + string.digits + "-_~:=@+,")
_ASCII = {c: (chr(c) if chr(c) in SAFE else f"%{c:02X}") for c in range(128)}
# A prefix: one or more tokens of these characters; "$" would start a system subject ($JS, $SYS).
PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
MAX_PREFIX_CHARS = 255
# The server refuses a protocol line (HPUB subject reply sizes) longer than max_control_line, 4096 by default, by
# closing the connection: a longer subject is refused here, with the reply inbox's room left.
MAX_SUBJECT_BYTES = 3900
_BREAKS_LINE = re.compile(r"[\x00-\x20\x7f]")


def subject_token(key: str) -> str:
    """``key`` as one subject token (the module's escaping)."""
    if key.isascii():
        return key.translate(_ASCII)
    return "".join(c if c in SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a subject prefix the sink can publish under, else ConfigurationError saying why."""
    if not prefix or len(prefix) > MAX_PREFIX_CHARS or not PREFIX.fullmatch(prefix):
        raise ConfigurationError(f"the NATS subject prefix {prefix[:64]!r} is not 1-{MAX_PREFIX_CHARS} characters of "
                                 "dot-separated tokens of A-Z a-z 0-9 _ - (no wildcards, no empty token, no '$')")
    return prefix


def topic_problem(topic: str) -> str | None:
    """Why ``topic`` can not be part of a subject (an empty token, whitespace or a control character: it would
    break the protocol line), or None."""
    if _BREAKS_LINE.search(topic):
        return f"topic {topic[:100]!r} can not be a NATS subject: it holds whitespace or a control character"
    if any(not token for token in topic.split(".")):
        return (f"topic {topic[:100]!r} can not be a NATS subject: it has an empty token (a leading, trailing or "
                "double '.')")
    return None


def check_topic(topic: str) -> str:
    """``topic`` if it makes a subject (for settings), else ConfigurationError."""
    problem = topic_problem(topic)
    if problem is not None:
        raise ConfigurationError(problem)
    return topic


def subject(prefix: str, topic: str, key: str) -> str:
    """The subject of an event of ``topic`` and ``key`` (both checked by the caller)."""
    return f"{prefix}.{topic}.{subject_token(key)}"


def topic_filter(prefix: str, topic: str | None = None) -> str:
    """The subject filter of every message of the sink (``<prefix>.>``) or of one topic (``<prefix>.<topic>.*``)."""
    return f"{prefix}.>" if topic is None else f"{prefix}.{topic}.*"


__all__ = ["MAX_SUBJECT_BYTES", "check_prefix", "check_topic", "subject", "subject_token", "topic_filter",
           "topic_problem"]
