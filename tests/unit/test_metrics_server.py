"""The metrics server's lifecycle, without a database or a broker."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

import pytest

from outbox_relay import metrics
from outbox_relay.compose import build_worker
from outbox_relay.metrics import MetricsServer
from outbox_relay.settings import RelaySettings
from tests.servers import free_port, wait_until

NOWHERE = "postgresql://relay@db.invalid/app"  # a DSN is required; these workers never connect


def test_closing_a_server_that_never_started_returns_and_frees_its_port() -> None:
    """A worker refused before it started (no sink, a bad option) still closes its services; the HTTP
    server's shutdown() would wait forever for a serve_forever() that never ran."""
    port = free_port()
    worker = build_worker(RelaySettings(dsn=NOWHERE, kafka=False, metrics_port=port, metrics_host="127.0.0.1"))
    [server] = [s for s in worker.services if isinstance(s, MetricsServer)]
    closing = threading.Thread(target=server.close, name="close", daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "MetricsServer.close() hangs when start() never ran"
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the listening socket was closed


def _server(port: int) -> MetricsServer:
    """A metrics server of a relay that never starts (no database: /healthz answers 503)."""
    worker = build_worker(RelaySettings(kafka=False, metrics_port=port, metrics_host="127.0.0.1",
                                        dsn="postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"))
    [server] = [s for s in worker.services if isinstance(s, MetricsServer)]
    assert isinstance(server, MetricsServer)
    return server


def _get(port: int, path: str = "/healthz") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_idle_connections_are_bounded_and_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_CONNECTIONS a connection is closed at once; an idle one is cut after REQUEST_SECONDS, so
    a probe gets through while idle clients keep the port busy."""
    monkeypatch.setattr(metrics, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(metrics, "REQUEST_SECONDS", 2.0)
    # As on a starved machine: a connection's thread closes it a while after its client saw it cut. The
    # probe must not wait for those threads (it was refused while they had not run: seen in CI).
    close = metrics.BoundedHTTPServer.shutdown_request

    def late_close(self: metrics.BoundedHTTPServer, request: Any) -> None:
        if "process_request_thread" in threading.current_thread().name:
            time.sleep(2.0)
        close(self, request)

    monkeypatch.setattr(metrics.BoundedHTTPServer, "shutdown_request", late_close)
    port = free_port()
    server = _server(port)
    server.start()
    idle: list[socket.socket] = []
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(metrics.MAX_CONNECTIONS + 8)]
        for s in idle[-8:]:  # over the bound: closed by the server without a word
            assert s.recv(1) == b""
        wait_until(lambda: server.server.refused >= 8, 10, message="the extra connections to be refused")
        for s in idle[:metrics.MAX_CONNECTIONS]:  # within it: cut once their time is up
            assert s.recv(1) == b""
        assert _get(port).startswith(b"HTTP/1.0 503"), "the probe is answered (503: no database here)"
    finally:
        for s in idle:
            s.close()
        server.close()


def test_running_out_of_descriptors_is_logged_once_and_accepting_resumes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    failures: list[int] = []
    real_accept = socket.socket.accept

    def accept(self: socket.socket) -> tuple[socket.socket, Any]:
        if self.getsockname()[1] == port and len(failures) < 5:
            failures.append(1)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_accept(self)

    port = free_port()
    server = _server(port)
    monkeypatch.setattr(socket.socket, "accept", accept)
    with caplog.at_level(logging.DEBUG, logger="outbox_relay.metrics"):
        server.start()
        try:
            assert _get(port).startswith(b"HTTP/1.0 503")
        finally:
            server.close()
    assert len(failures) == 5
    said = [r for r in caplog.records if "out of file descriptors" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in caplog.records]


def test_a_client_that_hangs_up_is_no_error(caplog: pytest.LogCaptureFixture,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    """No traceback on stderr (socketserver's default), nothing above debug in the log."""
    port = free_port()
    server = _server(port)
    with caplog.at_level(logging.DEBUG, logger="outbox_relay.metrics"):
        server.start()
        try:
            for _ in range(50):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
                s.close()
            assert _get(port).startswith(b"HTTP/1.0 503")
        finally:
            server.close()
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "refresh" not in r.getMessage()]


def test_a_burst_of_connections_waits_in_the_backlog_rather_than_for_a_syn_retransmit() -> None:
    """Probes and scrapes arrive together: connections the serving thread has not accepted yet wait in
    the listen backlog. With socketserver's backlog of 5 the kernel dropped the rest's SYNs and each of
    those clients waited out a 1 s retransmit (the hang-up acceptance test spent 47 s so)."""
    server = metrics.BoundedHTTPServer(("127.0.0.1", 0), metrics.BaseHTTPRequestHandler)
    with contextlib.ExitStack() as clients:  # never served: every connection stays in the backlog
        clients.callback(server.server_close)
        for _ in range(metrics.MAX_CONNECTIONS):
            clients.enter_context(socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=0.5))
