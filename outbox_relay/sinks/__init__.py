"""The sink family. This package's own names are the public contract of a sink you write (``user.py``):

    from outbox_relay.sinks import Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable

Importing it loads neither the engine nor Kafka. The modules:

- ``user.py``: the user's contract (``EventSink``, ``SinkEvent``, its answers, ``check_sink``);
- ``engine.py``: the engine's contract (``Sink``, ``Commit``, ``Failure``, ``KeyHold``), what the relay drives;
- ``adapter.py``: a user's ``EventSink`` as an engine ``Sink`` (order, time limit, concurrency);
- ``kafka/``: the Kafka sink; ``webhook/``: the webhook sink (an ``EventSink``).
"""

from .user import Delivered, EventSink, GiveUp, Outcome, Retry, SinkEvent, SinkUnavailable, check_sink

__all__ = ["Delivered", "EventSink", "GiveUp", "Outcome", "Retry", "SinkEvent", "SinkUnavailable", "check_sink"]
