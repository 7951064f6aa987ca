"""Secrets out of logs and errors, and why a connection failed, in one line.

No single rule catches every way a secret reaches a log line, so there are three:

- ``redact`` masks passwords in anything shaped like a DSN (URL user info, ``password=``), also
  passwords with spaces or tabs;
- ``redact`` also masks every secret *value* this process was told about (``remember_dsn``: the
  DSN's password as written, decoded and percent-encoded; ``remember_secret``: each secret Kafka
  option's value), wherever it appears: in a libpq message, a psycopg_pool warning, a traceback;
- ``check_dsn`` refuses a DSN libpq can not parse with a message that quotes none of it: libpq's
  own parse errors quote the offending token, and that token may be the password.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from .errors import MAX_ERROR_CHARS, ConfigurationError

MASK = "***"

# URL form: scheme://user:secret@host. libpq ends the user info at the first "@" or "/", so the
# password is everything up to there, spaces and tabs included.
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://[^:/@\n]*):[^/@\n]*@", re.IGNORECASE)
# Keyword form (and URL query parameters): password=secret, password = 'se cret' (an unterminated
# quote runs to the end: libpq refuses it, and what follows is still the password).
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*(?:'|$)|\S+)", re.IGNORECASE)

# Shorter values are not masked by value: they would turn up inside ordinary words (the DSN-shaped
# rules above still mask them where they appear as a password).
MIN_SECRET_CHARS = 4

# librdkafka properties whose value is a secret (CONFIGURATION.md, librdkafka 2.x): passwords,
# private keys and their passphrases, OAUTHBEARER client secrets, its config string (it may carry
# credentials and extension values) and extensions. Certificates, CA bundles and file paths are not
# secret and stay readable.
KAFKA_SECRET_OPTIONS = frozenset({
    "sasl.password",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.keystore.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.client.credentials.client.secret",
    "sasl.oauthbearer.extensions",
    "sasl.oauthbearer.assertion.private.key.pem",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "ssl_engine_callback_data",
    # Not a librdkafka property (the Java client's), but people paste it: it holds a password.
    "sasl.jaas.config",
})
# Properties added by later librdkafka versions are masked too when their name says secret.
_SECRET_OPTION_NAME = re.compile(r"password|secret|passphrase|private\.key|key\.pem|credential|token(?!\.endpoint)",
                                 re.IGNORECASE)


class _KnownSecrets:
    """Secret values of this process, masked in every text ``redact`` sees."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None  # replaced whole, so readers need no lock

    def add(self, values: Iterable[str]) -> None:
        new = {v for v in values if len(v) >= MIN_SECRET_CHARS}
        with self._lock:
            if new <= self._values:
                return
            self._values |= new
            # Longest first, so that a value containing another is masked whole.
            alternatives = sorted(self._values, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(v) for v in alternatives))

    def mask(self, text: str) -> str:
        pattern = self._pattern
        return pattern.sub(MASK, text) if pattern is not None else text


_known = _KnownSecrets()


def remember_secret(value: str) -> None:
    """Mask this value (and its percent-encoded form) in everything ``redact`` sees from now on."""
    if value:
        _known.add([value, quote(value, safe="")])


def remember_dsn(dsn: str) -> None:
    """Mask the password of this DSN from now on: as written, decoded, percent-encoded and quoted.

    Works for a DSN libpq can not parse, too (its password as written)."""
    found: set[str] = set()
    for m in _URL_PASSWORD.finditer(dsn):
        raw = m.group(0)[len(m.group("scheme")) + 1:-1]
        found |= {raw, unquote(raw)}
    for m in _KEYWORD_PASSWORD.finditer(dsn):
        raw = m.group(2)
        found |= {raw, raw.strip("'"), unquote(raw)}
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        password = None
    if password:
        value = str(password)
        escaped = value.replace("\\", "\\\\").replace("'", "\\'")
        found |= {value, quote(value, safe=""), quote(value), escaped}
    for value in found:
        remember_secret(value)


def redact(text: str) -> str:
    """``text`` with passwords in DSNs and every remembered secret value replaced by ``***``."""
    text = _URL_PASSWORD.sub(rf"\g<scheme>:{MASK}@", text)
    text = _KEYWORD_PASSWORD.sub(rf"\g<1>{MASK}", text)
    return _known.mask(text)


def describe_error(exc: BaseException) -> str:
    """An exception as a parked event's or dead letter's last error: type and message, no secrets, bounded."""
    try:
        message = str(exc)
    except Exception:  # a handler's own exception class with a broken __str__: the error is still recorded
        message = "<its message can not be shown: str() failed>"
    return redact(f"{type(exc).__name__}: {message}")[:MAX_ERROR_CHARS]


def one_line(text: str) -> str:
    """Redacted, on one line (libpq messages span several)."""
    return " ".join(redact(text).split())


# Quoted tokens in libpq's parse errors ("invalid percent-encoded token: "pa%zz"") may be the
# password; one-character ones are punctuation ("missing "=" after ...").
_QUOTED = re.compile(r'"[^"]{2,}"')


def check_dsn(dsn: str) -> None:
    """Raise ConfigurationError if libpq can not parse ``dsn``; the message quotes none of it."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        reason = _QUOTED.sub('"..."', one_line(str(exc)))
        raise ConfigurationError(f"the DSN is not a valid PostgreSQL connection string ({reason}); it is not shown "
                                 "because it may contain a password") from None


def is_secret_kafka_option(name: str) -> bool:
    if name in KAFKA_SECRET_OPTIONS:
        return True
    # A path to a key file is not the key.
    return bool(_SECRET_OPTION_NAME.search(name)) and not name.endswith((".location", ".file"))


def redact_kafka_config(config: dict[str, str]) -> dict[str, str]:
    """A copy of a librdkafka config safe to log (URLs keep their host, lose their password)."""
    return {k: (MASK if is_secret_kafka_option(k) else redact(str(v))) for k, v in config.items()}


def remember_kafka_secrets(config: dict[str, Any]) -> None:
    """Mask the values of the secret options of a librdkafka config from now on."""
    for k, v in config.items():
        if is_secret_kafka_option(k):
            remember_secret(str(v))


# -- why a connection failed --------------------------------------------------------------------

_FATAL = re.compile(r"(?:FATAL|ERROR):\s+(.*)")
_WHERE = re.compile(r'connection to server (at "[^"]*"(?:, port \d+)?|on socket "[^"]*")')
_UNREACHABLE = ("connection refused", "could not translate host name", "failed to resolve host",
                "no such file or directory", "timeout expired", "network is unreachable", "no route to host",
                "could not connect", "server closed the connection unexpectedly", "connection timed out",
                "name or service not known", "temporary failure in name resolution")


def connection_problem(exc: BaseException) -> str:
    """Why a connection attempt failed, as one line an operator can act on (nothing secret in it).

    For errors of ``psycopg.connect`` and of psycopg_pool. A pool's ``PoolTimeout`` hides the
    cause (the pool logs it as warnings): ``probe_connection`` connects once to find it."""
    from psycopg_pool import PoolTimeout

    if isinstance(exc, PoolTimeout):
        return f"no connection could be opened in time ({one_line(str(exc))})"
    text = one_line(str(exc))
    low = text.lower()
    sqlstate = getattr(exc, "sqlstate", None)
    fatal = _FATAL.search(text)
    detail = fatal.group(1) if fatal else text
    where = _WHERE.search(text)
    at = f" ({where.group(1).replace('at ', 'server ', 1).replace('on socket', 'socket', 1)})" if where else ""
    if sqlstate == "53300" or any(s in low for s in ("too many clients", "too many connections",
                                                     "remaining connection slots are reserved")):
        return (f"too many connections: the server has no connection slot free{at}: {detail} (SQLSTATE 53300; "
                "raise max_connections or the role's CONNECTION LIMIT, or use fewer or smaller pools)")
    if sqlstate == "28P01" or "password authentication failed" in low or "authentication failed" in low:
        return f"authentication failed{at}: {detail} (check the password in the DSN)"
    if sqlstate == "3D000" or ("database" in low and "does not exist" in low):
        return f"the database does not exist{at}: {detail}"
    if sqlstate == "28000" or "no pg_hba.conf entry" in low or "not permitted to log in" in low \
            or ("role" in low and "does not exist" in low):
        return f"the server refused the login{at}: {detail}"
    if sqlstate == "57P03" or "starting up" in low or "shutting down" in low or "in recovery mode" in low:
        return f"the server is starting up or shutting down{at}: {detail}"
    if any(s in low for s in _UNREACHABLE):
        reason = text.rsplit("failed:", 1)[-1].strip() if "failed:" in text else text
        return f"the server is not reachable{at}: {reason}"
    return detail


def probe_connection(dsn: str, timeout: float = 5.0) -> str | None:
    """Connect once; ``connection_problem`` of the failure, or None if the connection worked."""
    try:
        with psycopg.connect(dsn, connect_timeout=max(1, round(timeout))):
            return None
    except psycopg.Error as exc:
        return connection_problem(exc)


def describe(dsn: str) -> str:
    """Which database ``dsn`` names, for an operator: ``database app on db.internal:5432 as relay``.

    What libpq would use, its environment (PGHOST, PGUSER, ...) and defaults included; never the
    password. Raises ConfigurationError (via ``check_dsn``) for a DSN libpq can not parse."""
    check_dsn(dsn)
    given = {o.keyword.decode(): o.val.decode() for o in pq.Conninfo.parse(dsn.encode()) if o.val is not None}
    defaults = {o.keyword.decode(): o.val.decode() for o in pq.Conninfo.get_defaults() if o.val is not None}

    def value(name: str) -> str:
        return given.get(name) or defaults.get(name) or ""

    user = value("user")
    dbname = value("dbname") or user  # libpq's rule
    hosts = (value("host") or value("hostaddr")).split(",")
    ports = value("port").split(",") if value("port") else ["5432"]
    places = []
    for i, host in enumerate(hosts):
        port = ports[i] if i < len(ports) else ports[-1]
        port = port or "5432"
        if not host or host.startswith("/") or host.startswith("@"):  # a Unix-domain socket
            places.append(f"socket {host or 'default'} (port {port})")
        else:
            places.append(f"{host}:{port}")
    service = f" (service {value('service')})" if value("service") else ""
    return f"database {dbname or '?'} on {', '.join(places)} as {user or '?'}{service}"
