"""`outbox-relay run` as a real process: exit codes for what an operator gets wrong, and no secret in
its output, whatever shape the secret has or wherever it comes from."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_relay_processes import Relays
from tests.integration.test_cli_connection import PrivateServer
from tests.servers import free_port, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def private() -> Iterator[PrivateServer]:
    server = PrivateServer()
    try:
        yield server
    finally:
        server.server.close()


def exits_by_itself(relays: Relays, worker: str, dsn: str, extra: list[str]) -> tuple[int, str]:
    relay = relays.start(worker, dsn, f"127.0.0.1:{free_port()}", "orders", extra)
    try:
        code = relay.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`run {' '.join(extra)}` kept running: {relay.stderr()}")
    return code, relay.stderr()


def test_run_against_an_unmigrated_database_says_migrate(database_factory: Callable[..., str],
                                                         relays: Relays) -> None:
    code, err = exits_by_itself(relays, "unmigrated", database_factory(migrated=False), [])
    assert code == 2, err
    assert "outbox-relay: error: the outbox schema is missing: run `outbox-relay migrate` first" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("extra", [
    ["--poll-seconds", "1e12"],  # used to kill the sink thread, and the process then exited 0
    ["--lease-seconds", "inf"],
    ["--kafka-sink", "Bad Name"],
])
def test_run_refuses_settings_out_of_bounds(dsn: str, relays: Relays, extra: list[str]) -> None:
    code, err = exits_by_itself(relays, "bounds", dsn, extra)
    assert code == 2 and f"({extra[0]}, OUTBOX_" in err and "Traceback" not in err, err


def test_run_refuses_a_dsn_libpq_can_not_parse_without_echoing_it(relays: Relays) -> None:
    code, err = exits_by_itself(relays, "bad-dsn", "postgresql://relay:Unparse%zzable@db/app", [])
    assert code == 2 and "the DSN is not a valid PostgreSQL connection string" in err, err
    assert "Unparse" not in err


def test_a_relay_with_a_wrong_password_waits_and_never_prints_it(private: PrivateServer, relays: Relays) -> None:
    """The relay's own "unavailable" line and psycopg_pool's warnings, with a password holding tabs."""
    password = "Wr0ng\tTabbed\tSecr3t"
    relay = relays.start("wrong-pw", private.url(password), f"127.0.0.1:{free_port()}", "orders", ["--no-listen"])
    wait_until(lambda: "unavailable" in relay.stderr() and "password authentication failed" in relay.stderr(),
               30, 0.2, "the relay to report the database unavailable")
    assert relay.running
    assert relay.terminate(timeout=30) == 0
    output = relay.stderr() + relay.stdout_path.read_text(errors="replace")
    assert not any(piece in output for piece in ("Wr0ng", "Tabbed", "Secr3t")), output


def test_kafka_secrets_from_options_files_and_the_environment_are_never_printed(
        dsn: str, relays: Relays, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "kafka-password"
    secret_file.write_text("F1le-Secret-Value\n")
    config_file = tmp_path / "client.properties"
    config_file.write_text("sasl.oauthbearer.client.secret=C0nfig-File-Secret\n")
    monkeypatch.setenv("OUTBOX_KAFKA_CONFIG", '{"ssl.key.password": "Env1ron-Secret"}')
    options = {
        "sasl.oauthbearer.extensions": "org=Ext3nsion-Secret",
        "sasl.oauthbearer.assertion.private.key.passphrase": "Pa55phrase-Secret",
        "sasl.oauthbearer.assertion.private.key.pem": "-----BEGIN PRIVATE KEY-----Pem-Secret",
        "sasl.password": f"@{secret_file}",
    }
    extra = ["--kafka-config-file", str(config_file)]
    for key, value in options.items():
        extra += ["--kafka-option", f"{key}={value}"]
    relay = relays.start("kafka-secrets", dsn, f"127.0.0.1:{free_port()}", "orders", extra)
    wait_until(lambda: "kafka producer config" in relay.stderr() and " started" in relay.stderr(),
               30, 0.2, "the relay to start")
    assert relay.terminate() == 0
    output = relay.stderr() + relay.stdout_path.read_text(errors="replace")
    line = next(x for x in output.splitlines() if "kafka producer config" in x)
    for key in [*options, "ssl.key.password", "sasl.oauthbearer.client.secret"]:
        assert f"'{key}': '***'" in line, (key, line)
    for secret in ("F1le-Secret", "C0nfig-File", "Env1ron", "Ext3nsion", "Pa55phrase", "Pem-Secret"):
        assert secret not in output, (secret, output)
    assert "F1le-Secret" not in " ".join(relay.proc.args), "the file's content stays out of the command line"



def test_python_dash_m_outbox_relay_is_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "outbox_relay", "--version"], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and result.stdout.strip() == "outbox-relay 0.1.0", result
