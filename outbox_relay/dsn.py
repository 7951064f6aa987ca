"""Keep passwords out of logs and error messages."""

from __future__ import annotations

import re

# URL form (postgresql://user:secret@host) and keyword form (password=secret).
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://[^:/@\s]*):[^@\s]*@", re.IGNORECASE)
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
# librdkafka options that hold a secret: every *password*, *secret*, inline PEM keys and the
# OAUTHBEARER config string (it may carry credentials). Certificates and paths are not secret.
_SECRET_OPTION = re.compile(r".*(password|secret).*|ssl\.key\.pem|ssl_key\.pem|sasl\.oauthbearer\.config", re.I)


def redact(text: str) -> str:
    """Replace any password inside a DSN (or text containing one) by ``***``."""
    text = _URL_PASSWORD.sub(r"\g<scheme>:***@", text)
    return _KEYWORD_PASSWORD.sub(r"\1***", text)


def redact_kafka_config(config: dict[str, str]) -> dict[str, str]:
    """A copy of a librdkafka config safe to log."""
    return {k: ("***" if _SECRET_OPTION.fullmatch(k) else v) for k, v in config.items()}
