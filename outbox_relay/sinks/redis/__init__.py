"""The Redis Streams sink: one ``XADD`` per event, to the stream of its topic (an ``EventSink``).

``sink.py`` (``RedisStreamsSink``, ``from_settings``), ``message.py`` (the stream and the entry's
CloudEvents fields), ``connection.py`` (the URL, credentials, TLS, which server errors are conditions),
``readback.py`` (``read_back``: what the streams hold, for ``verify`` and the tests). redis-py is
imported lazily: ``pip install outbox-relay[redis]``.
"""

from .message import HEADER_PREFIX, entry, stream_of
from .sink import RedisStreamsSink, from_settings

__all__ = ["HEADER_PREFIX", "RedisStreamsSink", "entry", "from_settings", "stream_of"]
