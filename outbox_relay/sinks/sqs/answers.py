"""What an SQS answer (or the lack of one) means for an event: the event's fault, the sink's condition, or
an outage.

- the endpoint can not be reached, times out, throttles or answers 5xx: the sink is down
  (``SinkUnavailable``, no attempt counted; the events are sent again, and a FIFO queue drops a copy
  that did arrive);
- a queue that does not exist, credentials refused or missing, access or a KMS key denied (and any
  401/403): a condition of the sink, held the same way (nothing dead-lettered while an operator fixes it);
- the message refused (contents, size, parameters): the event's fault, ``GiveUp`` with SQS's reason;
- anything else: ``Retry`` (counted; dead-lettered with the reason past --max-attempts).
"""

from __future__ import annotations

import re
from typing import Any

from ...dsn import redact
from ..user import GiveUp, Retry, SinkUnavailable

# Error codes (the query protocol's and the JSON protocol's names both).
CONDITIONS = frozenset({
    "AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist",
    "AWS.SimpleQueueService.QueueDeletedRecently", "QueueDeletedRecently",
    "AccessDenied", "AccessDeniedException", "InvalidClientTokenId", "UnrecognizedClientException",
    "SignatureDoesNotMatch", "IncompleteSignature", "MissingAuthenticationToken", "ExpiredToken",
    "ExpiredTokenException", "RequestExpired", "InvalidSecurity", "OptInRequired", "InvalidAddress",
    "KmsAccessDenied", "KmsDisabled", "KmsInvalidKeyUsage", "KmsInvalidState", "KmsNotFound", "KmsOptInRequired",
    "KMS.AccessDeniedException", "KMS.DisabledException", "KMS.NotFoundException",
})
OUTAGES = frozenset({
    "RequestThrottled", "ThrottlingException", "Throttling", "KmsThrottled", "KMS.ThrottlingException",
    "ServiceUnavailable", "InternalError", "InternalFailure", "RequestTimeout", "RequestTimeoutException",
})
FAULTS = frozenset({
    "InvalidMessageContents", "InvalidParameterValue", "InvalidAttributeName", "InvalidAttributeValue",
    "MessageTooLong", "BatchRequestTooLong", "MissingParameter", "UnsupportedOperation",
})
MISSING_QUEUE = frozenset({"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"})

Answer = GiveUp | Retry | SinkUnavailable


_XML_ERROR = re.compile(r"<Code>([^<]{1,100})</Code>.*?<Message>([^<]{0,500})</Message>", re.S)


def codes(error: dict[str, Any]) -> set[str]:
    return {str(error[k]) for k in ("Code", "QueryErrorCode") if error.get(k)}


def parsed(error: dict[str, Any]) -> dict[str, Any]:
    """``error`` with the code and message of an XML error body the JSON client left unparsed (its code is
    then the HTTP status: moto, or a proxy in front of SQS, answering in the query protocol's XML)."""
    found = _XML_ERROR.search(str(error.get("Message") or ""))
    if found is None or not str(error.get("Code") or "").isdigit():
        return error
    return {**error, "Code": found.group(1), "Message": found.group(2)}


def of_error(code_names: set[str], message: str, status: int, where: str, sender_fault: bool,
             wait: float) -> Answer:
    """The answer to an error SQS returned (for a request, or one entry of a batch)."""
    what = redact(f"sqs: {where}: {'/'.join(sorted(code_names)) or 'error'}: {message}".rstrip(": "))
    if code_names & CONDITIONS or (status in (401, 403) and not code_names & OUTAGES):
        # 401/403 whatever the code (an error body the client could not parse, a proxy): SQS or something
        # in front of it refuses this relay, not the message.
        return SinkUnavailable(f"{what} (a condition of the sink: check the queue, the credentials and the "
                               "policy)", wait)
    if code_names & OUTAGES or status >= 500 or (status == 0 and not sender_fault):
        return SinkUnavailable(what, wait)
    if code_names & FAULTS or (sender_fault and status == 0):
        return GiveUp(what)
    return Retry(what)


def of_exception(exc: Exception, where: str, wait: float) -> Answer | None:
    """The answer to an exception of boto3's, None if it is not one (a bug: let it raise)."""
    from botocore import exceptions as boto

    if isinstance(exc, boto.ClientError):
        error = parsed(exc.response.get("Error", {}))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 400)
        return of_error(codes(error), str(error.get("Message") or ""), status, where, True, wait)
    if isinstance(exc, boto.ConnectionError | boto.HTTPClientError):
        return SinkUnavailable(redact(f"sqs: {where}: the endpoint is unreachable: {exc}"), wait)
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError | boto.CredentialRetrievalError
                  | boto.TokenRetrievalError | boto.SSOError):
        return SinkUnavailable(redact(f"sqs: {where}: no usable AWS credentials: {exc}"), wait)
    if isinstance(exc, boto.ParamValidationError):
        return GiveUp(redact(f"sqs: {where}: the client refuses the message: {exc}"))
    if isinstance(exc, boto.BotoCoreError):
        return Retry(redact(f"sqs: {where}: {type(exc).__name__}: {exc}"))
    return None
