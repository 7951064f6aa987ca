"""The fault proxy forwards, cuts and stalls, and spares exempt clients (no servers: an echo socket)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from tests.faults.proxy import Proxy, exempt_kafka_clients, kafka_client_id
from tests.servers import wait_until


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on a free port; its port."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        server.close()


@pytest.fixture
def proxy(echo: int) -> Iterator[Proxy]:
    p = Proxy("test", ("127.0.0.1", echo), exempt=exempt_kafka_clients("faults-")).start()
    try:
        yield p
    finally:
        p.close()


def kafka_request(client_id: str) -> bytes:
    """An ApiVersions request header as a Kafka client sends it first."""
    body = struct.pack(">hhih", 18, 3, 1, len(client_id)) + client_id.encode()
    return struct.pack(">i", len(body)) + body


def connect(p: Proxy, first: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    s.sendall(first)
    assert recv_exactly(s, len(first)) == first
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_kafka_client_id_is_read_from_the_first_request() -> None:
    assert kafka_client_id(kafka_request("faults-recorder")) == "faults-recorder"
    assert kafka_client_id(kafka_request("rdkafka")) == "rdkafka"
    assert kafka_client_id(b"\x00\x00") is None


def test_cut_resets_connections_but_spares_exempt_ones(proxy: Proxy) -> None:
    victim = connect(proxy, kafka_request("rdkafka"))
    observer = connect(proxy, kafka_request("faults-recorder"))
    wait_until(lambda: proxy.connections() == 2, 5)
    assert proxy.cut() == 1
    with victim, observer:
        try:
            closed = victim.recv(1) == b""
        except ConnectionResetError:
            closed = True
        assert closed, "the cut connection still delivered data"
        observer.sendall(b"still here")
        assert recv_exactly(observer, 10) == b"still here"
    # New connections work after a cut.
    with connect(proxy, kafka_request("rdkafka")):
        pass


def test_stall_holds_bytes_until_resume(proxy: Proxy) -> None:
    with connect(proxy, kafka_request("rdkafka")) as victim, \
            connect(proxy, kafka_request("faults-admin")) as observer:
        proxy.stall()
        victim.sendall(b"held")
        observer.sendall(b"flows")
        assert recv_exactly(observer, 5) == b"flows"
        victim.settimeout(0.3)
        with pytest.raises(TimeoutError):
            victim.recv(4)
        proxy.resume()
        victim.settimeout(5)
        assert recv_exactly(victim, 4) == b"held"


def test_an_upstream_that_is_down_closes_the_client(echo: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # bound, not listening: connections are refused
        p = Proxy("down", ("127.0.0.1", dead_port)).start()
        try:
            with socket.create_connection(("127.0.0.1", p.port), timeout=5) as c:
                assert c.recv(1) == b""
            assert p.stats.upstream_failures == 1
        finally:
            p.close()
