"""The metrics server's lifecycle, without a database or a broker."""

from __future__ import annotations

import socket
import threading

from outbox_relay.compose import build_worker
from outbox_relay.settings import RelaySettings
from tests.servers import free_port


def test_closing_a_server_that_never_started_returns_and_frees_its_port() -> None:
    """A worker refused before it started (no sink, a bad option) still closes its services; the HTTP
    server's shutdown() would wait forever for a serve_forever() that never ran."""
    port = free_port()
    worker = build_worker(RelaySettings(kafka=False, metrics_port=port, metrics_host="127.0.0.1"))
    [server] = worker.services
    closing = threading.Thread(target=server.close, name="close", daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "MetricsServer.close() hangs when start() never ran"
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the listening socket was closed
