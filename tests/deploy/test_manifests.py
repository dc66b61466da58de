"""deploy/ checked against the code: every manifest parses; every worker is pinned to a device
of its own; every environment variable a manifest sets is one the code (or Flower) reads and
every required one is set; probes, grace periods, metrics ports and KEDA's queues agree with
the worker's own settings; ``docker compose config`` and ``systemd-analyze verify`` pass where
those tools are installed (``.ci/run`` installs both)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from worker.common.config import queue_name
from worker.dispatch.lanes import lane_queues

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
SYSTEMD = DEPLOY / "systemd"
IMAGE = "specbatch:latest"

# ---------------------------------------------------------------- what the code reads


def env_names_read_by_code() -> set[str]:
    """Every environment variable our packages read: each ``Settings`` field's variables, and
    what the engine and the kernels read themselves."""
    from dataclasses import fields

    from worker.common.config import Settings

    names: set[str] = set()
    for f in fields(Settings):
        names |= {f"SPECBATCH_{f.metadata['env']}", *([f.metadata["also"]] if f.metadata["also"] else [])}
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        text = path.read_text()
        names |= set(re.findall(r'(?:environ\.get|getenv)\("([A-Z0-9_]+)"', text))
        names |= set(re.findall(r'environ\["([A-Z0-9_]+)"\]', text))
        names |= set(re.findall(r'envvar="([A-Z0-9_]+)"', text))
    return names


def flower_env_names() -> set[str]:
    """Flower reads ``FLOWER_<OPTION>`` for each of its options."""
    import flower.options  # noqa: F401  (defines them)
    from tornado.options import options

    return {f"FLOWER_{name.upper()}" for name in options._options}


READ = env_names_read_by_code() | flower_env_names()
WORKER_REQUIRED = ({"REDIS_URL", "SPECBATCH_BROKER_URL"}, {"DATABASE_URL", "SPECBATCH_DATABASE_URL"},
                   {"SPECBATCH_MODEL"})


def check_env(where: str, names: set[str], required: tuple[set[str], ...] = ()) -> None:
    unknown = names - READ
    assert not unknown, f"{where} sets {sorted(unknown)}, which nothing reads"
    for alternatives in required:
        assert names & alternatives, f"{where} sets none of {sorted(alternatives)}"


def test_the_code_scan_finds_the_variables_we_know():
    assert {"SPECBATCH_MODEL", "SPECBATCH_DRAIN_TIMEOUT", "SPECBATCH_READY_FILE", "SPECBATCH_METRICS_PORT",
            "REDIS_URL", "DATABASE_URL", "SPECBATCH_CACHE_DIR", "FLOWER_BASIC_AUTH"} <= READ
    assert "SPECBATCH_NO_SUCH_SETTING" not in READ


# ---------------------------------------------------------------- Kubernetes


def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict:
    matches = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container_env(container: dict) -> dict[str, str | None]:
    """Names (and literal values, None when from a secret) a container gets: envFrom + env."""
    out: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            out.update(find("ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            out.update(dict.fromkeys(find("Secret", source["secretRef"]["name"])["stringData"]))
    for item in container.get("env", []):
        out[item["name"]] = item.get("value")
    return out


def our_containers() -> list[tuple[str, dict, dict]]:
    found = []
    for doc in k8s_docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec["containers"]:
                if c["image"] == IMAGE:
                    found.append((doc["metadata"]["name"], doc, c))
    return found


def test_every_kubernetes_manifest_parses_and_has_what_the_issue_names():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in k8s_docs()}
    for expected in [("Deployment", "specbatch-worker"), ("Deployment", "specbatch-flower"),
                     ("Service", "specbatch-flower"), ("Job", "specbatch-migrate"),
                     ("StatefulSet", "specbatch-redis"), ("StatefulSet", "specbatch-postgres"),
                     ("ScaledObject", "specbatch-worker"), ("ConfigMap", "specbatch")]:
        assert expected in kinds, expected
    assert all("apiVersion" in d and "metadata" in d for d in k8s_docs())


def test_kubernetes_containers_set_only_variables_the_code_reads_and_all_it_needs():
    for name, _doc, container in our_containers():
        args = container.get("args", [])
        required = {"worker": WORKER_REQUIRED, "db": WORKER_REQUIRED[1:2],
                    "flower": WORKER_REQUIRED[:1] + ({"FLOWER_BASIC_AUTH"},)}[args[0]]
        check_env(f"k8s {name}", set(container_env(container)), required)


def test_the_kubernetes_worker_is_one_gpu_ready_when_loaded_drained_in_its_grace_and_scraped():
    deployment = find("Deployment", "specbatch-worker")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = container_env(container)
    args = container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert args[args.index("--device") + 1] == "cuda:0"  # the pod's only GPU
    assert container["readinessProbe"]["exec"]["command"] == ["test", "-f", env["SPECBATCH_READY_FILE"]]
    drain = float(env["SPECBATCH_DRAIN_TIMEOUT"])
    assert drain + 15 <= pod["spec"]["terminationGracePeriodSeconds"] <= drain + 120
    port = args[args.index("--metrics-port") + 1]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == port
    assert {"containerPort": int(port), "name": "metrics"} in container["ports"]
    migrate = find("Job", "specbatch-migrate")["spec"]["template"]["spec"]["containers"][0]
    assert migrate["args"] == ["db", "upgrade"]


def test_keda_scales_the_worker_on_its_model_queues_to_zero():
    scaled = find("ScaledObject", "specbatch-worker")["spec"]
    model = find("ConfigMap", "specbatch")["data"]["SPECBATCH_MODEL"]
    assert scaled["scaleTargetRef"]["name"] == find("Deployment", "specbatch-worker")["metadata"]["name"]
    assert scaled["minReplicaCount"] == 0
    lists = {t["metadata"]["listName"] for t in scaled["triggers"] if t["type"] == "redis"}
    assert lists == set(lane_queues(queue_name(model)))
    sql = [t for t in scaled["triggers"] if t["type"] == "postgresql"]
    assert sql and queue_name(model) in sql[0]["metadata"]["query"]
    auth = find("TriggerAuthentication", sql[0]["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"][0]["key"] in find("Secret", "specbatch-secrets")["stringData"]


def test_flower_is_served_with_auth_behind_its_service():
    container = find("Deployment", "specbatch-flower")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:1] == ["flower"] and "FLOWER_BASIC_AUTH" in container_env(container)
    service = find("Service", "specbatch-flower")["spec"]
    assert service["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}


# ---------------------------------------------------------------- compose


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_pins_each_worker_to_its_own_gpu_and_restarts_it():
    services = compose()["services"]
    workers = {n: s for n, s in services.items() if s.get("command", [None])[0] == "worker"}
    assert len(workers) >= 2
    gpus = []
    for name, service in workers.items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and len(devices[0]["device_ids"]) == 1, name
        gpus.append(devices[0]["device_ids"][0])
        cmd = service["command"]
        assert cmd[cmd.index("--device") + 1] == "cuda:0", name  # the container's only GPU
        assert service["restart"] in ("unless-stopped", "always", "on-failure")
        env = service["environment"]
        drain = float(env["SPECBATCH_DRAIN_TIMEOUT"])
        assert float(service["stop_grace_period"].rstrip("s")) >= drain + 15
        assert service["healthcheck"]["test"] == ["CMD", "test", "-f", env["SPECBATCH_READY_FILE"]]
    assert len(set(gpus)) == len(gpus), "two workers share a GPU"
    names = [s["command"][s["command"].index("--name") + 1] for s in workers.values()]
    assert len(set(names)) == len(names)


def test_compose_services_set_only_variables_the_code_reads_and_all_they_need():
    services = compose()["services"]
    assert services["redis"]["command"][:3] == ["redis-server", "--appendonly", "yes"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    for name, service in services.items():
        if service.get("image") != IMAGE:
            continue
        command = service.get("command", ["tools"])
        required = {"worker": WORKER_REQUIRED, "db": WORKER_REQUIRED[1:2],
                    "flower": WORKER_REQUIRED[:1] + ({"FLOWER_BASIC_AUTH"},)}.get(command[0], WORKER_REQUIRED)
        check_env(f"compose {name}", set(service["environment"]), required)


def test_docker_compose_config_validates():
    client = (["docker", "compose"] if shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True).returncode == 0 else
              ["docker-compose"] if shutil.which("docker-compose") else None)
    if client is None:
        pytest.skip("no docker compose client here (.ci/run installs docker-compose)")
    done = subprocess.run([*client, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_dockerfile_copies_the_packages_and_runs_the_cli():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    copied = {m.split()[0] for m in re.findall(r"^COPY (.+)$", text, re.M)}
    for package in ("engine", "kernels", "worker", "migrations"):
        assert package in copied
    for path in {p for line in re.findall(r"^COPY (.+)$", text, re.M) for p in line.split()[:-1]}:
        assert (ROOT / path).exists(), path
    assert 'ENTRYPOINT ["specbatch"]' in text


# ---------------------------------------------------------------- systemd


def test_systemd_units_pin_by_instance_and_verify(tmp_path):
    worker_unit = (SYSTEMD / "specbatch-worker@.service").read_text()
    assert "--device cuda:%i" in worker_unit
    flower_unit = (SYSTEMD / "specbatch-flower.service").read_text()
    assert "specbatch flower" in flower_unit
    for unit in (worker_unit, flower_unit):
        names = set(re.findall(r"^Environment=([A-Z0-9_]+)=", unit, re.M))
        check_env("systemd unit", names)
        drain = re.search(r"^Environment=SPECBATCH_DRAIN_TIMEOUT=(\d+)", unit, re.M)
        if drain:
            assert int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M)[1]) >= int(drain[1]) + 15
    if not shutil.which("systemd-analyze"):
        pytest.skip("no systemd-analyze here")
    cli = shutil.which("specbatch")
    assert cli, "the specbatch console script is not installed"
    units = []
    for name, text in (("specbatch-worker@0.service", worker_unit), ("specbatch-flower.service", flower_unit)):
        # Verified as installed: the CLI where the venv has it, the env file optional here.
        text = text.replace("/opt/specbatch/venv/bin/specbatch", cli)
        text = text.replace("EnvironmentFile=/etc/specbatch/env", "EnvironmentFile=-/etc/specbatch/env")
        (tmp_path / name).write_text(text)
        units.append(str(tmp_path / name))
    done = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True)
    problems = [line for line in done.stderr.splitlines() if "specbatch" in line]
    assert done.returncode == 0 and not problems, done.stderr
