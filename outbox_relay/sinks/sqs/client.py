"""The boto3 SQS client a sink (or a read-back) uses: endpoint, region, profile, TLS, timeouts. boto3 is
imported here only, when a client is made, so ``import outbox_relay`` never needs it."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Any

from ...dsn import remember_secret
from ...errors import ConfigurationError

MISSING = "the sqs sink needs `pip install outbox-relay[sqs]` (boto3)"
# sqs.REGION.amazonaws.com, sqs.REGION.amazonaws.com.cn, sqs-fips.REGION..., vpce-...sqs.REGION.vpce...
_AWS_HOST = re.compile(r"(?:^|\.)sqs(?:-fips)?\.([a-z]{2}(?:-[a-z0-9]+)+-\d+)\.(?:vpce\.)?amazonaws\.com(?:\.cn)?\Z")


def region_of(endpoint: str) -> str | None:
    """The region an AWS SQS endpoint's host names, else None."""
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    found = _AWS_HOST.search(host)
    return found.group(1) if found else None


def make_client(endpoint: str, *, region: str | None = None, profile: str | None = None,
                concurrency: int = 10, connect_timeout_seconds: float = 5.0, timeout_seconds: float = 10.0,
                ca_file: Path | None = None, verify_tls: bool = True) -> Any:
    """An SQS client of ``endpoint`` signed with the credentials boto3's chain finds (remembered for
    redaction). ConfigurationError if boto3 is missing or the region or profile can not be found."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise ConfigurationError(MISSING) from None
    try:
        session = boto3.session.Session(profile_name=profile)
    except botocore.exceptions.ProfileNotFound:
        raise ConfigurationError(f"sqs: the AWS profile {profile!r} is not in the AWS config files") from None
    region = region or region_of(endpoint) or session.region_name
    if not region:
        raise ConfigurationError("sqs: no AWS region: pass --sqs-region (or set AWS_REGION, or use an endpoint "
                                 "https://sqs.REGION.amazonaws.com)")
    config = botocore.config.Config(
        connect_timeout=connect_timeout_seconds, read_timeout=timeout_seconds,
        # One resend inside the client (a dropped keep-alive connection, a throttle); the relay does the rest.
        retries={"mode": "standard", "total_max_attempts": 2},
        max_pool_connections=max(10, concurrency), tcp_keepalive=True)
    verify: bool | str = str(ca_file) if ca_file is not None else verify_tls
    client = session.client("sqs", endpoint_url=endpoint, region_name=region, config=config, verify=verify)
    credentials = session.get_credentials()
    if credentials is None:
        raise ConfigurationError("sqs: no AWS credentials found (boto3's chain: AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY, --sqs-profile or AWS_PROFILE, ~/.aws/credentials, an "
                                 "instance or task role)")
    frozen = credentials.get_frozen_credentials()
    for secret in (frozen.secret_key, frozen.token):
        if secret:
            remember_secret(secret)
    return client
