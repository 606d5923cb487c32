"""Dockerfile and compose file: they run the same CLI the tests exercise, non-root, checked.

No Docker engine runs here, so the files are checked statically and their commands are run
for real against a server started by the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import yaml
from conftest import ROOT, ServerProcess

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
    bases = instruction("FROM")
    assert bases and all("slim" in base for base in bases)
    user = instruction("USER")[-1]
    assert user not in ("root", "0")
    assert "[server]" in " ".join(instruction("RUN"))


def test_image_entrypoint_is_the_posenc_console_script() -> None:
    entrypoint = json.loads(instruction("ENTRYPOINT")[-1])
    assert entrypoint == ["posenc"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["posenc"] == "posenc.cli:main"
    assert json.loads(instruction("CMD")[-1]) == ["serve"]
    health = instruction("HEALTHCHECK")[-1]
    assert json.loads(health.split("CMD", 1)[1]) == compose_service()["healthcheck"]["test"][1:]  # type: ignore[index]


def test_compose_runs_serve_with_a_health_check_on_the_served_port() -> None:
    service = compose_service()
    assert service["build"] == "."
    assert service["command"] == ["serve"]
    environment = service["environment"]
    assert isinstance(environment, dict)
    port = environment["POSENC_PORT"]
    check = service["healthcheck"]
    assert isinstance(check, dict)
    assert check["test"][:3] == ["CMD", "posenc", "health"]
    assert check["test"][-1] == f"127.0.0.1:{port}"
    # The replicas serve the port inside the compose network; nginx publishes it on the
    # host (tests/test_deploy.py checks the balancer).
    assert port in service["expose"]  # type: ignore[operator]
    assert "ports" not in service
    assert environment["POSENC_HOST"] == "0.0.0.0"


def _with_target(argv: list[str], target: str) -> list[str]:
    return [POSENC, *argv[1:-1], target]


def test_the_health_check_command_passes_on_a_live_server_and_fails_without_one(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    argv = compose_service()["healthcheck"]["test"][1:]  # type: ignore[index]
    process = spawn_server()
    live = subprocess.run(_with_target(argv, process.target), capture_output=True, timeout=30)
    assert live.returncode == 0, live.stderr
    process.kill()
    dead = subprocess.run(_with_target(argv, process.target), capture_output=True, timeout=30)
    assert dead.returncode != 0


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
