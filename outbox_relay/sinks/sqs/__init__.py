"""The Amazon SQS sink: each event a message on its topic's FIFO queue (an ``EventSink``).

``sink.py`` (``SqsSink``, ``from_settings``), ``message.py`` (the message: body, CloudEvents attributes,
group and deduplication ids), ``queues.py`` (topic -> queue), ``batches.py`` (a wave's messages
as SendMessageBatch requests), ``answers.py`` (SQS's errors: the event's fault or the sink's
condition), ``client.py`` (boto3, imported only here), ``readback.py`` (what the queues hold, for tests
and ``verify``).
"""

from .sink import SqsSink, from_settings

__all__ = ["SqsSink", "from_settings"]
