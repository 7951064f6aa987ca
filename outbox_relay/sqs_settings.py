"""The SQS sink's settings (outbox_relay.sinks.sqs): :class:`SqsFields`, which ``RelaySettings`` extends
(``outbox-relay run --sqs-url ...``), and :class:`SqsSettings`, the same alone (``read_back``, scripts).
Every field is read from ``OUTBOX_SQS_<FIELD>``. Credentials are never settings of ours: boto3's own
chain finds them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``--sqs-profile``, an instance or
task role)."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from .broker_settings import SinkOptions, check_topics
from .settings_base import TOPIC_NAME, NameList, SettingsBase

# SQS queue names: 1-80 characters of A-Z a-z 0-9 _ -; a FIFO queue's ends in ".fifo" (counted).
QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,80}\Z")
FIFO_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,75}\.fifo\Z")
QUEUE_PREFIX = re.compile(r"^[A-Za-z0-9_-]{0,74}\Z")
REGION = re.compile(r"^[a-z]{2}(-[a-z0-9]+)+-\d+\Z")
SQS = SinkOptions("sqs", "SQS", label="SQS", peer="endpoint")


def _pairs(value: Any) -> Any:
    """``topic=URL,topic=URL`` (the environment's form) as a dict; a dict as it is."""
    if not isinstance(value, str):
        return value
    pairs: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        topic, sep, url = item.partition("=")
        if not sep:
            raise ValueError(f"{item.strip()[:100]!r} is not TOPIC=QUEUE_URL")
        pairs[topic.strip()] = url.strip()
    return pairs


def check_endpoint(url: str) -> urllib.parse.SplitResult:
    """``url`` split if it is an http(s) URL of a host with no credentials in it, else ValueError."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL (e.g. https://sqs.eu-west-1.amazonaws.com)")
    if parts.username is not None or parts.password is not None:
        raise ValueError("credentials do not go in the SQS URL: they come from the AWS chain (AWS_ACCESS_KEY_ID / "
                         "AWS_SECRET_ACCESS_KEY, --sqs-profile, an instance role)")
    return parts


def queue_name_of(url: str) -> str:
    """The queue name of a queue URL (its last path segment)."""
    return urllib.parse.urlsplit(url).path.rstrip("/").rpartition("/")[2]


class SqsFields(SettingsBase):
    """The SQS sink's settings, on when ``sqs_url`` is set."""

    sqs_url: str | None = SQS.url(
        "deliver every event to Amazon SQS at this endpoint, e.g. https://sqs.eu-west-1.amazonaws.com, "
        "or http://127.0.0.1:4566 for LocalStack (turns the SQS sink on; see docs/sqs.md)", max_length=2048)
    sqs_sink: str = SQS.sink()
    sqs_region: str | None = Field(
        default=None, min_length=1, max_length=50,
        description="SQS: the AWS region (none: read from an AWS endpoint's host, else boto3's chain: "
                    "AWS_REGION, the profile)")
    sqs_profile: str | None = Field(
        default=None, min_length=1, max_length=200,
        description="SQS: the AWS profile (~/.aws) whose credentials sign the requests (none: boto3's default chain)")
    sqs_queue_prefix: str = Field(
        default="", max_length=74,
        description="SQS: an event of topic T goes to the FIFO queue named PREFIX + T + '.fifo' (unless "
                    "--sqs-queue-urls names T's queue)")
    sqs_queue_urls: Annotated[dict[str, str], NoDecode, BeforeValidator(_pairs)] = Field(
        default_factory=dict,
        description="SQS: the queue of a topic by URL, TOPIC=URL[,TOPIC=URL...] (another account's queue, a name the "
                    "prefix rule can not make)")
    sqs_allow_standard_queue: bool = Field(
        default=False,
        description="SQS: accept standard (non-FIFO) queues in --sqs-queue-urls: no order, no deduplication is "
                    "then promised for their events")
    sqs_concurrency: int = SQS.concurrency(10)
    sqs_batch_size: int = Field(
        default=10, ge=1, le=10,
        description="SQS: most messages per SendMessageBatch (events of different keys delivered at once share a "
                    "request); 1: one SendMessage per event")
    sqs_topics: NameList = SQS.topics()
    sqs_connect_timeout_seconds: float = SQS.connect_timeout()
    sqs_timeout_seconds: float = Field(
        default=10.0, ge=0.01, le=600,
        description="SQS: seconds to wait for an answer before the endpoint counts as down (the events are sent "
                    "again later; the queue's deduplication drops a copy that did arrive)")
    sqs_unavailable_seconds: float = SQS.unavailable(
        "how long events wait after the endpoint was down, throttled or refused a queue (missing, access denied) "
        "before the next try (no attempt counted)")
    sqs_ca_file: Path | None = SQS.ca_file()
    sqs_tls_verify: bool = SQS.tls_verify()

    @field_validator("sqs_url")
    @classmethod
    def _sqs_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_endpoint(value)
        return value

    @field_validator("sqs_region")
    @classmethod
    def _region(cls, value: str | None) -> str | None:
        if value is not None and not REGION.match(value):
            raise ValueError("not an AWS region name (e.g. eu-west-1)")
        return value

    @field_validator("sqs_queue_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not QUEUE_PREFIX.match(value):
            raise ValueError("a queue name prefix is at most 74 characters of A-Z a-z 0-9 _ -")
        return value

    @field_validator("sqs_topics")
    @classmethod
    def _sqs_topics(cls, value: list[str]) -> list[str]:
        return check_topics(value)

    @model_validator(mode="after")
    def _sqs(self) -> SqsFields:
        SQS.check_sink_name(self)
        for topic, url in self.sqs_queue_urls.items():
            if not TOPIC_NAME.match(topic):
                raise ValueError(f"sqs_queue_urls: {topic[:64]!r} is not a topic name (1-249 characters of "
                                 "A-Z a-z 0-9 . _ -)")
            try:
                check_endpoint(url)
            except ValueError as exc:
                raise ValueError(f"sqs_queue_urls: the queue URL of topic {topic}: {exc}") from None
            name = queue_name_of(url)
            if not QUEUE_NAME.match(name) and not FIFO_QUEUE_NAME.match(name):
                raise ValueError(f"sqs_queue_urls: the queue URL of topic {topic} does not end in a queue name "
                                 "(https://sqs.REGION.amazonaws.com/ACCOUNT/NAME)")
            if not name.endswith(".fifo") and not self.sqs_allow_standard_queue:
                raise ValueError(f"sqs_queue_urls: the queue of topic {topic} ({name}) is a standard queue, which "
                                 "keeps no order and does not deduplicate: use a FIFO queue (NAME.fifo), or pass "
                                 "--sqs-allow-standard-queue to accept that")
        return self


class SqsSettings(SqsFields):
    """The SQS sink's settings alone, from ``OUTBOX_SQS_*``."""

    model_config = SettingsConfigDict(extra="ignore")
