"""The Dockerfile and compose file, checked statically, and the image built and run.

The static checks run the files' commands against a server the test starts. The image is
built with podman (runc runtime, a base made from Debian packages: tests/containers.py) and
run hardened as compose runs it: from the host, through a port published on 127.0.0.1, the
CLI, the SDK and the image's own health check are checked, a SIGTERM with a stream in
flight lets the stream finish and the container exit 0, and the server runs as uid 10001
on a read-only root. tests/test_compose.py runs the compose stack.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import trustme
import yaml
from conftest import ROOT, ServerProcess, free_port
from containers import (  # noqa: F401  (fixtures)
    IMAGE,
    PYTHON_BASE,
    Podman,
    expected,
    network,
    podman_fixture,
    posenc_image_fixture,
    wheelhouse,
)
from test_operations import metrics_port

import posenc

POSENC = str(Path(sys.executable).parent / "posenc")


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def instruction(name: str) -> list[str]:
    return [value for key, value in dockerfile_instructions() if key == name]


def compose_service() -> dict[str, object]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service: dict[str, object] = compose["services"]["posenc"]
    return service


def test_image_is_slim_and_runs_as_non_root() -> None:
    # Both stages start from the base chosen by build argument, python:3.11-slim by default.
    bases = instruction("FROM")
    assert bases == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    assert "PYTHON_IMAGE=python:3.11-slim" in instruction("ARG")
    assert instruction("USER")[-1] == "10001:10001"
    assert "pip install" in " ".join(instruction("RUN")) and " ./server" in " ".join(
        instruction("RUN")
    )
    # The final stage gets the virtualenv only: no build tools, no installer.
    final = ROOT.joinpath("Dockerfile").read_text().rsplit("FROM ${PYTHON_IMAGE}\n", 1)[1]
    assert "pip install" not in final and "COPY --from=build /opt/posenc /opt/posenc" in final


def test_image_entrypoint_is_the_posenc_console_script() -> None:
    entrypoint = json.loads(instruction("ENTRYPOINT")[-1])
    assert entrypoint == ["posenc"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["posenc"] == "posenc.cli:main"
    assert json.loads(instruction("CMD")[-1]) == ["serve"]
    health = instruction("HEALTHCHECK")[-1]
    assert json.loads(health.split("CMD", 1)[1]) == compose_service()["healthcheck"]["test"][1:]  # type: ignore[index]


def test_compose_runs_serve_with_a_health_check_on_its_metrics_port() -> None:
    service = compose_service()
    assert service["build"] == "."
    assert service["command"] == ["serve"]
    # Hardened as the image intends: its user, a read-only root with /tmp (where the
    # server's metrics files go) in memory, no capabilities.
    assert service["user"] == instruction("USER")[-1]
    assert service["read_only"] is True and service["tmpfs"] == ["/tmp"]
    assert service["cap_drop"] == ["ALL"]
    assert service["security_opt"] == ["no-new-privileges:true"]
    environment = service["environment"]
    assert isinstance(environment, dict)
    port = environment["POSENC_PORT"]
    check = service["healthcheck"]
    assert isinstance(check, dict)
    # /healthz of the port the replica serves its metrics on, which it reads from there.
    assert check["test"] == ["CMD", "posenc", "health", "--http"]
    assert environment["POSENC_METRICS_PORT"] in service["expose"]  # type: ignore[operator]
    # The replicas serve the port inside the compose network; nginx publishes it on the
    # host (tests/test_deploy.py checks the balancer).
    assert port in service["expose"]  # type: ignore[operator]
    assert "ports" not in service
    assert environment["POSENC_HOST"] == "0.0.0.0"


@pytest.mark.slow  # starts server processes
def test_the_health_check_command_passes_on_a_live_server_and_fails_without_one(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    # As the container engine runs it: beside the server, with its environment.
    argv = [POSENC, *compose_service()["healthcheck"]["test"][2:]]  # type: ignore[index]
    process = spawn_server()
    environment = {**os.environ, "POSENC_METRICS_PORT": str(metrics_port(process))}

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=30)

    live = check()
    assert (live.returncode, live.stdout.strip()) == (0, "SERVING"), live.stderr
    process.kill()
    dead = check()
    assert (dead.returncode, dead.stdout.strip()) == (1, "UNREACHABLE")


@pytest.mark.slow  # starts server processes
def test_the_compose_command_serves_with_the_compose_environment() -> None:
    # `posenc serve` with the compose environment (except the ports, which must be free here).
    service = compose_service()
    environment = {k: str(v) for k, v in service["environment"].items()}  # type: ignore[attr-defined]
    environment.pop("POSENC_PORT")
    environment.pop("POSENC_METRICS_PORT")
    serve = subprocess.Popen(
        [POSENC, *service["command"], "--port", "0", "--metrics-port", "0"],  # type: ignore[misc]
        env={**environment, "PATH": str(Path(sys.executable).parent)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stderr is not None
        # The supervisor says "listening" once all its worker processes serve.
        startup = {}
        for line in serve.stderr:
            startup = json.loads(line)
            if startup["message"] == "listening" and "worker" not in startup:
                break
        assert startup["message"] == "listening"
        assert startup["address"].startswith("0.0.0.0:")
        assert startup["processes"] == int(environment["POSENC_PROCESSES"])
        info = subprocess.run(
            [POSENC, "info", "--target", f"127.0.0.1:{startup['port']}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert info.returncode == 0, info.stderr
        assert "1.0.0" in info.stdout
    finally:
        serve.terminate()
        assert serve.wait(30) == 0


# -- the image, built and run with podman -----------------------------------------------------


def posenc_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([POSENC, *args], capture_output=True, text=True, timeout=60)


def run_hardened(
    podman: Podman, name: str, network_name: str, *env: str, volumes: Sequence[str] = ()
) -> str:
    """Runs the image as compose does: read-only root, /tmp in memory, no capabilities, the
    gRPC port published on a free loopback port. Returns the host's target."""
    podman.run(
        "run", "--detach", f"--name={name}", f"--network={network_name}",
        "--read-only", "--read-only-tmpfs=false", "--tmpfs=/tmp",
        "--cap-drop=ALL", "--security-opt=no-new-privileges:true",
        f"--publish=127.0.0.1:{free_port()}:50051",
        "--env=POSENC_PROCESSES=2", *(f"--env={pair}" for pair in env),
        *(f"--volume={volume}" for volume in volumes),
        IMAGE,
    )  # fmt: skip
    podman.wait_healthy([name])
    return f"127.0.0.1:{podman.host_port(name, 50051)}"


@pytest.fixture(scope="module")
def served(podman: Podman, posenc_image: str) -> Iterator[tuple[str, str]]:
    """(container, host target) of one hardened posenc container."""
    with network(podman) as net:
        name = f"{net}-posenc"
        try:
            yield name, run_hardened(podman, name, net)
        finally:
            podman.run("rm", "--force", "--time=5", name, check=False)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold first build: apt-get, mmdebstrap, wheels, image
def test_the_image_serves_info_tables_and_health_on_a_loopback_port(
    podman: Podman, served: tuple[str, str]
) -> None:
    name, target = served
    info = posenc_cli("info", "--target", target)
    assert info.returncode == 0, info.stderr
    assert re.search(r"^version:\s+1\.0\.0$", info.stdout, re.MULTILINE)
    health = posenc_cli("health", "--target", target)
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
    with posenc.Client(target) as client:
        assert client.health() == "SERVING"
        assert client.server_info().version == "1.0.0"
        # A unary result, negative positions, and a streamed one (20 MiB).
        for start, stop, d_model in ((0, 1000, 512), (-4096, 4096, 64), (0, 20480, 256)):
            table = client.get_range(start, stop, d_model, timeout=60)
            assert table.shape == (stop - start, d_model) and table.dtype == "float32"
            assert table.tobytes() == expected(start, stop, d_model)
    # The image's own HEALTHCHECK, as the engine runs it.
    image = json.loads(podman.out("image", "inspect", IMAGE))[0]
    assert image["Healthcheck"]["Test"] == ["CMD", "posenc", "health", "--http"]
    assert podman.healthy(name)


@pytest.mark.slow
def test_the_container_runs_as_10001_on_a_read_only_root(
    podman: Podman, served: tuple[str, str]
) -> None:
    name, _ = served
    assert json.loads(podman.out("image", "inspect", IMAGE))[0]["Config"]["User"] == ("10001:10001")
    status = dict(
        line.split(":\t", 1)
        for line in podman.out("exec", name, "cat", "/proc/1/status").splitlines()
    )
    assert status["Uid"].split() == ["10001"] * 4 and status["Gid"].split() == ["10001"] * 4
    assert int(status["CapEff"], 16) == 0 and status["NoNewPrivs"] == "1"
    assert podman.out("exec", name, "id", "-un") == "posenc"
    # Even root cannot write the root filesystem; /tmp is memory, and holds the metrics
    # and numba's cache of the engine's kernel.
    denied = podman.run("exec", "--user=0", name, "touch", "/probe", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    mounts = podman.out("exec", name, "cat", "/proc/mounts").splitlines()
    assert any(
        line.split()[1:3] == ["/", "overlay"] and ",ro" in f",{line.split()[3]}" for line in mounts
    )
    assert any(line.split()[1:3] == ["/tmp", "tmpfs"] for line in mounts)
    written = podman.out("exec", name, "ls", "/tmp").split()
    assert "numba-cache" in written and any(n.startswith("posenc-metrics-") for n in written)


@pytest.mark.slow
def test_the_image_is_slim_without_a_compiler(podman: Podman, posenc_image: str) -> None:
    size = int(podman.out("image", "inspect", "--format", "{{.Size}}", IMAGE))
    base = int(podman.out("image", "inspect", "--format", "{{.Size}}", PYTHON_BASE.tag))
    print(f"image {IMAGE}: {size / 1e6:.0f} MB, of which the base {base / 1e6:.0f} MB")
    # The virtualenv adds about 310 MB to the base: grpcio, numpy, protobuf, ... 100 MB, and
    # the engine kernel's numba with its LLVM (llvmlite) 210 MB.
    assert size - base < 400e6
    tools = podman.run(
        "run", "--rm", "--entrypoint=sh", IMAGE, "-c",
        "for tool in gcc cc c++ clang make pip; do command -v $tool; done; true",
    )  # fmt: skip
    assert tools.stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rebuild_without_changes_comes_from_the_layer_cache(
    podman: Podman, posenc_image: str
) -> None:
    """Rebuilding unchanged sources runs no step again (no pip install, no compiling of the
    engine's kernels): podman takes every step but the FROMs from its layer cache, and the
    image is the one built before."""
    before = podman.out("image", "inspect", "--format", "{{.Id}}", IMAGE)
    after, steps = podman.build_posenc_steps(podman.debian_image(PYTHON_BASE), wheelhouse())
    ran = [
        step.splitlines()[0]
        for step in steps
        if not step.split(": ", 1)[1].startswith("FROM ") and "--> Using cache " not in step
    ]
    assert steps and not ran, ran
    assert after == before


def streams_in_flight(podman: Podman, name: str) -> float:
    text = podman.metrics(name, 9464)
    match = re.search(r"^posenc_streams_in_flight (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_lets_a_stream_in_flight_finish_and_the_container_exit_0(
    podman: Podman, posenc_image: str
) -> None:
    """SIGTERM with a stream in flight: the server drains, the stream goes on to its last
    row, exact, and the container exits 0, every process saying it drained (each call in
    flight finished within the grace, by the server's own account)."""
    # 200 MiB in 1 MiB chunks. The reader stops after the first chunk until the signal has
    # been sent: the stream is in flight when it comes, however fast or slow the machine.
    start, stop, d_model = 0, 51200, 1024
    chunk_bytes = 1 << 20
    grace = 60
    with network(podman) as net:
        name = f"{net}-posenc"
        try:
            target = run_hardened(podman, name, net, f"POSENC_GRACE_SECONDS={grace}")
            outcome: dict[str, object] = {}
            first_chunk, signalled = threading.Event(), threading.Event()

            def fetch() -> None:
                parts = []
                try:
                    with posenc.Client(target) as client:
                        for _, rows in client.iter_range(
                            start, stop, d_model, chunk_bytes=chunk_bytes, timeout=240
                        ):
                            parts.append(np.array(rows))
                            if not first_chunk.is_set():
                                first_chunk.set()
                                signalled.wait(120)  # a hang guard: the signal comes first
                    outcome["table"] = np.concatenate(parts)
                except Exception as error:  # reported below
                    outcome["error"] = error
                finally:
                    first_chunk.set()

            thread = threading.Thread(target=fetch)
            thread.start()
            assert first_chunk.wait(120) and "error" not in outcome, outcome.get("error")
            assert streams_in_flight(podman, name) >= 1  # the server counts it in flight
            podman.run("kill", "--signal=TERM", name)
            signalled.set()
            assert podman.out("wait", name, timeout=grace + 120) == "0"  # a hang guard
            thread.join(120)
            logs = podman.run("logs", name).stderr
        finally:
            signalled.set()
            podman.run("rm", "--force", "--time=5", name, check=False)
    assert "error" not in outcome, outcome.get("error")
    table = outcome["table"]
    assert isinstance(table, np.ndarray)
    assert table.tobytes() == expected(start, stop, d_model)
    entries = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert any(entry["message"] == "draining" for entry in entries)
    stopped = [entry for entry in entries if entry["message"] == "stopped"]
    assert stopped and all(entry["drained"] is True for entry in stopped), stopped


@pytest.mark.slow
def test_the_images_health_check_passes_beside_tls_and_posenc_health_speaks_it(
    podman: Podman, posenc_image: str, tmp_path: Path
) -> None:
    # A TLS server configured by POSENC_TLS_* alone: the image's HEALTHCHECK passes (its
    # /healthz is plain HTTP whatever the gRPC port's TLS), `posenc health` beside it reads
    # the same variables and speaks TLS without flags, and the host reaches it with TLS only.
    authority = trustme.CA()
    issued = authority.issue_cert("posenc.internal")
    certs = tmp_path / "certs"
    certs.mkdir(mode=0o755)
    issued.cert_chain_pems[0].write_to_path(str(certs / "server.pem"))
    issued.private_key_pem.write_to_path(str(certs / "server.key"))
    for path in certs.iterdir():
        path.chmod(0o644)  # readable by uid 10001 inside the container
    with network(podman) as net:
        name = f"{net}-posenc-tls"
        try:
            target = run_hardened(
                podman, name, net,
                "POSENC_TLS_CERT_FILE=/certs/server.pem", "POSENC_TLS_KEY_FILE=/certs/server.key",
                volumes=[f"{certs}:/certs:ro"],
            )  # fmt: skip
            assert podman.healthy(name)
            beside = podman.out("exec", name, "posenc", "health")
            assert beside.strip() == "SERVING"
            plaintext = posenc_cli("health", "--target", target)
            assert plaintext.returncode == 1
            authority.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
            tls = ["--tls-ca", str(tmp_path / "ca.pem"), "--tls-server-name", "posenc.internal"]
            secure = posenc_cli("health", "--target", target, *tls)
            assert (secure.returncode, secure.stdout.strip()) == (0, "SERVING"), secure.stderr
        finally:
            podman.run("rm", "--force", "--time=5", name, check=False)
