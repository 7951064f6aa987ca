"""The NATS JetStream sink: one JetStream publish per event, delivered on the stream's PubAck (an ``EventSink``).

``sink.py`` (``NatsSink``, ``from_settings``, ``from_env``), ``message.py`` (headers: CloudEvents NATS binding,
``Nats-Msg-Id``), ``subjects.py`` (``<prefix>.<topic>.<key token>``, ``subject_token``), ``connection.py`` (the
URL's checks, credentials, TLS, the client), ``readback.py`` (what a stream holds, for ``verify`` and tests).
nats-py is imported only when a sink connects: ``pip install outbox-relay[nats]``.
"""

from .sink import NatsSink, from_env, from_settings
from .subjects import subject_token, topic_filter

__all__ = ["NatsSink", "from_env", "from_settings", "subject_token", "topic_filter"]
