"""Deployment files: Kubernetes manifests (deploy/k8s) and the load-balanced compose stack.

No cluster and no Docker engine run here. The manifests are validated against the
Kubernetes OpenAPI schemas that the kubernetes-validate package ships (offline: the test
forbids network connections while it validates), and every cross-reference a typo would
silently break is checked: selectors and pod labels, probe and Service ports, the
autoscaler's target, the drain grace. The settings given to the server are parsed by the
server's own configuration code. tests/test_balancer.py runs deploy/nginx/nginx.conf for real.
"""

from __future__ import annotations

import copy
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, sizing_rule_mib
from kubernetes_validate.utils import all_versions

from posenc_server import app
from posenc_server.config import MIB, ServerConfig, shm_peers
from posenc_server.metrics import HEALTH_PATH, LIVE_PATH

K8S = ROOT / "deploy" / "k8s"
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
# Validate against every schema version from 1.27, the oldest Kubernetes release supported.
VERSIONS = sorted(
    {v for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 27)},
    key=lambda v: tuple(map(int, v.split("."))),
)

Doc = dict[str, Any]


def manifests() -> list[Doc]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def one(kind: str, name: str | None = None) -> Doc:
    found = [d for d in manifests() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec() -> Doc:
    spec: Doc = one("Deployment")["spec"]["template"]["spec"]
    return spec


def container() -> Doc:
    containers = pod_spec()["containers"]
    assert len(containers) == 1
    found: Doc = containers[0]
    return found


def env() -> dict[str, str]:
    return {item["name"]: item["value"] for item in container()["env"]}


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (``1Gi``, ``768Mi``, ``500m``, ``2``) as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3, "": 1}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|m|)", str(value))
    assert match, f"unexpected quantity {value!r}"
    return float(match.group(1)) * units[match.group(2)]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any attempt to open a network connection fails the test."""

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"network connection attempted to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield


# -- Kubernetes: schemas -------------------------------------------------------------------


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_match_the_kubernetes_schemas_offline(version: str) -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} == {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }
    for doc in docs:
        # strict: unknown fields (typos) are errors too.
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"], []),
        (["spec", "template", "spec", "containers", 0, "livenessProbe", "httpGot"], {"port": 1}),
        (["spec", "template", "spec", "terminationGracePeriodSeconds"], "45s"),
        (["spec", "selector"], None),
    ],
)
def test_the_schema_check_rejects_broken_manifests(path: list[str | int], value: object) -> None:
    doc = copy.deepcopy(one("Deployment"))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = sorted(kustomization["resources"])
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert listed == on_disk
    assert "namespace" not in kustomization  # chosen at apply time: kubectl -n


# -- Kubernetes: cross-references ----------------------------------------------------------


def test_the_deployment_runs_the_image_as_compose_does() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["posenc"]
    assert container()["image"] == compose["image"] == "posenc:1.0.0"
    assert container()["args"] == compose["command"] == ["serve"]
    assert env()["POSENC_HOST"] == "0.0.0.0"
    # The server's own configuration code accepts the settings.
    config = ServerConfig.from_args([], env())
    assert config.host == "0.0.0.0" and config.port == 50051
    assert config.cache_bytes == 512 * MIB


def test_selectors_match_the_pod_labels() -> None:
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    for service in (one("Service", "posenc-headless"), one("Service", "posenc")):
        assert selects(service["spec"]["selector"], labels), service["metadata"]["name"]
    assert selects(one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    spread = pod_spec()["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
    assert selects(spread, labels)


def test_probes_and_services_use_the_served_port() -> None:
    port = ServerConfig.from_args([], env()).port
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports["grpc"] == port
    assert ports["metrics"] == ServerConfig.from_args([], env()).metrics_port
    for probe, path in (
        ("startupProbe", HEALTH_PATH),
        ("readinessProbe", HEALTH_PATH),
        # Liveness, which a flood of the gRPC port's connections does not fail.
        ("livenessProbe", LIVE_PATH),
    ):
        check = container()[probe]
        assert check["httpGet"] == {"path": path, "port": "metrics"}, probe
    headless = one("Service", "posenc-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is False
    for name in ("posenc-headless", "posenc"):
        (service_port,) = one("Service", name)["spec"]["ports"]
        assert service_port["port"] == port
        assert ports[service_port["targetPort"]] == port
        assert service_port["appProtocol"] == "grpc"


def test_termination_outlasts_the_drain() -> None:
    grace = ServerConfig.from_args([], env()).grace_seconds
    assert grace == ServerConfig().grace_seconds == 30
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # The kubelet waits for preStop, then the server's drain, before SIGKILL.
    assert pod_spec()["terminationGracePeriodSeconds"] > int(pre_stop[1]) + grace
    # A draining server answers NOT_SERVING: readiness drops it at once, liveness never
    # restarts it for that.
    readiness, liveness = container()["readinessProbe"], container()["livenessProbe"]
    assert readiness["failureThreshold"] * readiness["periodSeconds"] <= 5
    assert liveness["failureThreshold"] * liveness["periodSeconds"] > grace
    # Rollouts add a ready pod before removing one.
    rolling = one("Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1


def test_pods_run_as_the_images_non_root_user_on_a_read_only_root() -> None:
    # A user and a group of its own: `USER 10001` alone runs with group 0 (root).
    dockerfile_user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert dockerfile_user
    uid, gid = int(dockerfile_user.group(1)), int(dockerfile_user.group(2))
    assert (uid, gid) == (10001, 10001)
    for context in (pod_spec()["securityContext"], container()["securityContext"]):
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid)
    security = container()["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in container()["volumeMounts"]}
    assert mounts == {"/tmp"}  # the only writable path


def test_resources_fit_the_cache_budget_and_the_processes() -> None:
    config = ServerConfig.from_args([], env())
    resources = container()["resources"]
    requests, limits = resources["requests"], resources["limits"]
    # The default, one process per core the container sees, would follow the node's cores.
    assert config.processes >= 1
    assert config.processes <= quantity(limits["cpu"])
    needed = sizing_rule_mib(config.cache_bytes / MIB, config.processes) * MIB
    assert quantity(requests["memory"]) >= needed
    assert quantity(limits["memory"]) > quantity(requests["memory"])
    assert 0 < quantity(requests["cpu"]) <= quantity(limits["cpu"])


def test_the_autoscaler_scales_the_deployment_on_cpu() -> None:
    hpa = one("HorizontalPodAutoscaler")["spec"]
    deployment = one("Deployment")
    target = hpa["scaleTargetRef"]
    assert target == {
        "apiVersion": deployment["apiVersion"],
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    # CPU utilization is relative to the request, which must be set.
    assert "cpu" in container()["resources"]["requests"]
    # The autoscaler owns the replica count: applying the Deployment never resets it.
    assert "replicas" not in deployment["spec"]
    assert 3 <= hpa["minReplicas"] < hpa["maxReplicas"]
    # A voluntary disruption leaves at least two replicas serving.
    assert hpa["minReplicas"] - one("PodDisruptionBudget")["spec"]["maxUnavailable"] >= 2


# -- docker compose and nginx ----------------------------------------------------------------


def compose() -> Doc:
    services: Doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return services


def nginx_directives() -> list[tuple[str, list[str]]]:
    """``(name, arguments)`` of every simple directive in deploy/nginx/nginx.conf."""
    text = "\n".join(line.split("#", 1)[0] for line in NGINX_CONF.read_text().splitlines())
    directives = []
    for statement in re.findall(r"([^;{}]+);", text):
        words = statement.split()
        directives.append((words[0], words[1:]))
    return directives


def directive(name: str) -> list[str]:
    found = [args for key, args in nginx_directives() if key == name]
    assert len(found) == 1, f"expected one {name} in nginx.conf, found {found}"
    return found[0]


def test_compose_runs_three_healthy_replicas_behind_nginx() -> None:
    services = compose()
    replica, balancer = services["posenc"], services["nginx"]
    port = int(replica["environment"]["POSENC_PORT"])
    assert replica["deploy"]["replicas"] == 3
    assert "ports" not in replica  # no host port: replicas are reached through nginx
    assert str(port) in replica["expose"]
    assert replica["healthcheck"]["test"][1:3] == ["posenc", "health"]
    # nginx publishes the port, on the host's loopback address only, and starts once the
    # replicas are healthy.
    assert balancer["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert balancer["depends_on"] == {"posenc": {"condition": "service_healthy"}}
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in balancer["volumes"]
    # `server ... resolve` needs nginx 1.27.3 or later.
    version = re.fullmatch(r"nginx:(\d+)\.(\d+)(?:\.(\d+))?(-\w+)?", balancer["image"])
    assert version
    assert tuple(int(v or 0) for v in version.groups()[:3]) >= (1, 27, 3)


def test_compose_replicas_fit_their_memory_limit() -> None:
    replica = compose()["posenc"]
    environment = {k: str(v) for k, v in replica["environment"].items()}
    config = ServerConfig.from_args([], environment)
    assert config.processes >= 1
    limit = replica["deploy"]["resources"]["limits"]["memory"]
    match = re.fullmatch(r"(\d+)([mg])", limit)
    assert match
    limit_bytes = int(match.group(1)) * {"m": MIB, "g": 1024 * MIB}[match.group(2)]
    assert limit_bytes >= sizing_rule_mib(config.cache_bytes / MIB, config.processes) * MIB
    assert replica["stop_grace_period"] == "40s" and config.grace_seconds < 40


def test_nginx_balances_grpc_calls_over_the_compose_service() -> None:
    port = compose()["posenc"]["environment"]["POSENC_PORT"]
    assert directive("listen") == [port, "http2"]
    (upstream,) = re.findall(r"upstream (\w+) \{", NGINX_CONF.read_text())
    assert directive("grpc_pass") == [f"grpc://{upstream}"]
    server = directive("server")
    assert server[0] == f"posenc:{port}" and "resolve" in server
    assert directive("resolver")[0] == "127.0.0.11"  # Docker's embedded DNS
    assert int(directive("keepalive")[0]) > 0
    assert directive("zone")[0] == upstream
    retry = directive("grpc_next_upstream")
    assert {"error", "timeout", "non_idempotent"} <= set(retry)


def test_nginx_limits_fit_the_largest_request_and_a_long_stream() -> None:
    body = directive("client_max_body_size")[0]
    assert body.endswith("m")
    assert int(body[:-1]) * MIB >= ServerConfig().max_receive_message_bytes
    # Past the replicas' keepalive pings (a live replica is never silent that long), short
    # enough that a vanished one's streams are reset and resumed elsewhere within minutes.
    keepalive = app._KEEPALIVE_TIME_MS / 1000
    for timeout in ("grpc_read_timeout", "grpc_send_timeout"):
        value = directive(timeout)[0]
        assert value.endswith("s"), timeout
        assert 2 * keepalive <= int(value[:-1]) <= 300, timeout
    assert directive("grpc_socket_keepalive") == ["on"]
    assert int(directive("http2_max_concurrent_streams")[0]) >= 100


def test_the_network_policy_opens_grpc_and_limits_metrics_to_prometheus() -> None:
    policy = one("NetworkPolicy")["spec"]
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["podSelector"]["matchLabels"], labels)
    assert policy["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule for rule in policy["ingress"]}
    assert set(rules) == {"grpc", "metrics"}  # named container ports: nothing else is open
    assert "from" not in rules["grpc"]  # clients may be anywhere
    (source,) = rules["metrics"]["from"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    names = {p["name"] for p in container()["ports"]}
    assert set(rules) <= names


# -- the same-host sidecar examples ------------------------------------------------------------

SIDECAR = ROOT / "deploy" / "sidecar"


def _sidecar_pod() -> Doc:
    doc: Doc = yaml.safe_load((SIDECAR / "deployment.yaml").read_text())
    return doc


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1]])
def test_the_sidecar_manifest_matches_the_kubernetes_schemas(version: str) -> None:
    kubernetes_validate.validate(_sidecar_pod(), version, strict=True)


def _sidecar_parts() -> list[tuple[str, dict[str, str], list[Doc], int, float, str]]:
    """Each sidecar example's (posenc env, worker's code, mounts...), compose's and the pod's:
    ``(name, posenc env, [posenc mounts, worker mounts], worker uid, posenc memory limit in
    bytes, worker's code)``."""
    pod = _sidecar_pod()["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    posenc_env = {item["name"]: item["value"] for item in containers["posenc"]["env"]}
    k8s = (
        "kubernetes",
        posenc_env,
        [
            {m["name"]: m["mountPath"] for m in containers[n]["volumeMounts"]}
            for n in ("posenc", "worker")
        ],
        int(pod["securityContext"]["runAsUser"]),
        quantity(containers["posenc"]["resources"]["limits"]["memory"]),
        containers["worker"]["args"][0],
    )
    services = yaml.safe_load((SIDECAR / "compose.yml").read_text())["services"]
    compose = (
        "compose",
        services["posenc"]["environment"],
        [
            dict(volume.split(":", 1) for volume in services[n]["volumes"])
            for n in ("posenc", "worker")
        ],
        int(services["worker"]["user"].split(":")[0]),
        # Compose's "2048m" is 2048 MiB.
        quantity(services["posenc"]["deploy"]["resources"]["limits"]["memory"].replace("m", "Mi")),
        services["worker"]["command"][0],
    )
    return [k8s, compose]


@pytest.mark.parametrize("index", [0, 1], ids=["kubernetes", "compose"])
def test_the_sidecar_examples_share_the_socket_admit_the_worker_and_fit_the_memory(
    index: int,
) -> None:
    parts = _sidecar_parts()[index]
    _, environment, (server_mounts, worker_mounts), worker_uid, limit, code = parts
    config = ServerConfig.from_args([], environment)
    directory = os.path.dirname(config.unix_socket)
    # The socket's directory is a volume both containers mount, at the same path.
    assert directory in server_mounts.values() and directory in worker_mounts.values()
    assert f'posenc.Client("unix:{config.unix_socket}")' in code
    assert "copy=False" in code  # the worker holds a view of the server's memory
    uids, _ = shm_peers(config.shm_peers)
    assert worker_uid in uids
    needed = (
        sizing_rule_mib(config.cache_bytes / MIB, config.process_count) * MIB
    ) + config.shm_bytes
    assert limit >= needed
