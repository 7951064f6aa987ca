"""The RabbitMQ sink: each event a persistent message, delivered once the broker confirms it (an ``EventSink``).

``sink.py`` (``RabbitMQSink``, ``from_settings``, ``from_env``), ``message.py`` (the AMQP message: exchange,
routing key, CloudEvents AMQP binding headers), ``connection.py`` (the URL's checks, credentials, TLS, one
connection), ``readback.py`` (``read_back``: what the broker holds, for ``outbox-relay verify``). pika, the
client, is imported only when a connection is made (``pip install outbox-relay[rabbitmq]``).
"""

from .connection import Tls, check_url
from .sink import RabbitMQSink, from_env, from_settings

__all__ = ["RabbitMQSink", "Tls", "check_url", "from_env", "from_settings"]
