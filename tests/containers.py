"""podman for the container tests: installing it, images made from Debian packages, and the
compose file run as podman commands.

No Docker engine and no image registry are reachable here, so:

- podman runs with the runc runtime (crun cannot run on this host's hybrid cgroups) and
  explicit ulimits (runc cannot raise them itself), set in a containers.conf the tests write;
- base images are root filesystems that mmdebstrap builds from Debian packages, cached by
  content (suite, packages, options) under ``POSENC_CONTAINER_CACHE`` (default
  ``~/.cache/posenc-containers``) and in podman's own image store;
- the Python packages the image installs are built as wheels on the host (cached by the
  dependency list) and handed to ``podman build`` as a read-only volume, so the build needs
  no network; the Dockerfile installs from the index when no wheelhouse is given;
- ``docker-compose.yml`` is turned into ``podman`` commands by :class:`ComposeStack`, key by
  key, failing on any key it does not know.

Containers only join a network the test creates; the host reaches them through ports
published on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, apt_install, free_port
from reference import classic

from posenc_server.engine import encode_range

IMAGE = "posenc:1.0.0"
CACHE = Path(
    os.environ.get("POSENC_CONTAINER_CACHE") or Path.home() / ".cache" / "posenc-containers"
)
APT_PACKAGES = [
    "podman",
    "runc",
    "netavark",
    "aardvark-dns",
    "iptables",
    "uidmap",
    "slirp4netns",
    "mmdebstrap",
]
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
"""
# dpkg leaves these out of the root filesystems: documentation and translations.
DPKG_EXCLUDES = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
]


@dataclass(frozen=True)
class DebianImage:
    """A base image made by mmdebstrap from Debian packages."""

    name: str
    suite: str
    packages: tuple[str, ...]
    changes: tuple[str, ...] = ()
    aptopts: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        recipe = json.dumps(
            [self.suite, self.packages, self.changes, self.aptopts, DPKG_EXCLUDES, "essential"]
        )
        return hashlib.sha256(recipe.encode()).hexdigest()[:16]

    @property
    def tag(self) -> str:
        return f"localhost/{self.name}:{self.key}"


# python:3.11-slim's counterpart: Debian 12's python3 (3.11), its venv module, CA
# certificates, useradd, and the C++ runtime that grpcio's wheel links to.
PYTHON_BASE = DebianImage(
    "posenc-base-python",
    "bookworm",
    ("python3", "python3-venv", "ca-certificates", "passwd", "libstdc++6"),
)
# `server ... resolve` (deploy/nginx/nginx.conf) is in open-source nginx from 1.27.3 on:
# Debian 12 has 1.22 and Debian 13 has 1.26, so the balancer's image comes from Debian 14
# (forky, 1.30 while it is testing): packages reach testing only after days in unstable
# without release-critical bugs, so it breaks less often than unstable, which has 1.30 too.
# Testing's Release file is re-signed weekly and carries a Valid-Until date, which a mirror
# serving a snapshot has passed: the date is not checked.
NGINX_BASE = DebianImage(
    "posenc-base-nginx",
    "forky",
    ("nginx",),
    changes=('CMD ["nginx", "-g", "daemon off;"]', "STOPSIGNAL SIGQUIT"),
    aptopts=('Acquire::Check-Valid-Until "false"',),
)

# The stand-in for prom/prometheus (docker-compose.yml): Debian 14's Prometheus 3, from the
# same suite as nginx. Its entrypoint and command are the registry image's (the binary is in
# /usr/bin here), so the compose file's `command:` means the same to both; it runs as the
# compose file's user.
PROMETHEUS_BASE = DebianImage(
    "posenc-base-prometheus",
    "forky",
    ("prometheus",),
    changes=(
        'ENTRYPOINT ["/usr/bin/prometheus"]',
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]',
    ),
    aptopts=('Acquire::Check-Valid-Until "false"',),
)


def _run(
    argv: Sequence[str], timeout: float = 600, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kwargs)


def install_podman() -> str | None:
    """Installs podman and mmdebstrap with apt-get when missing; the reason if it cannot."""
    if all(shutil.which(tool) for tool in ("podman", "runc", "mmdebstrap")):
        return None
    return apt_install(APT_PACKAGES, "podman", recommends=True)


class PodmanError(RuntimeError):
    pass


@contextlib.contextmanager
def _building() -> Iterator[None]:
    """Held while images are built: two test runs at once (make test beside a developer's
    run) must not build one image, or its cached Debian root, at the same time."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass(eq=False)
class Podman:
    """The podman CLI with the runc runtime and explicit ulimits (a containers.conf)."""

    conf: Path
    log: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def run(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        result = _run(["podman", *args], timeout=timeout, env=self.env)
        self.log.append(f"podman {' '.join(args)}  # {time.monotonic() - started:.1f} s")
        if check and result.returncode != 0:
            raise PodmanError(
                f"podman {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result

    def out(self, *args: str, timeout: float = 600) -> str:
        return self.run(*args, timeout=timeout).stdout.strip()

    def image_exists(self, tag: str) -> bool:
        return self.run("image", "exists", tag, check=False).returncode == 0

    # -- images ------------------------------------------------------------------------

    def debian_image(self, image: DebianImage) -> str:
        """The image's tag, building its root filesystem only when neither podman's store
        nor the cache holds it."""
        with _building():
            return self._debian_image(image)

    def _debian_image(self, image: DebianImage) -> str:
        if self.image_exists(image.tag):
            return image.tag
        CACHE.mkdir(parents=True, exist_ok=True)
        tarball = CACHE / f"{image.name}-{image.key}.tar"
        if not tarball.exists():
            partial = tarball.with_suffix(".partial.tar")
            argv = [
                "mmdebstrap",
                "--variant=essential",
                "--format=tar",
                # /bin -> /usr/bin and friends without the usrmerge package (and its perl).
                "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
                *(f"--dpkgopt={option}" for option in DPKG_EXCLUDES),
                *(f"--aptopt={option}" for option in image.aptopts),
                f"--include={','.join(image.packages)}",
                image.suite,
                str(partial),
            ]
            result = _run(argv, timeout=900)
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                raise PodmanError(f"mmdebstrap failed:\n{result.stderr[-4000:]}")
            partial.rename(tarball)
        changes = [arg for change in image.changes for arg in ("--change", change)]
        self.run("import", *changes, str(tarball), image.tag)
        return image.tag

    def build_posenc(self, base: str, wheelhouse: Path, tag: str = IMAGE) -> str:
        """Builds the Dockerfile on ``base`` with the host's wheels; returns the image id."""
        return self.build_posenc_steps(base, wheelhouse, tag)[0]

    def build_posenc_steps(
        self, base: str, wheelhouse: Path, tag: str = IMAGE
    ) -> tuple[str, list[str]]:
        """Builds as ``build_posenc`` does; returns the image id and podman's account of each
        step: its ``STEP n/m: ...`` line and what followed it (``--> Using cache ...`` for a
        step taken from the layer cache, none for a FROM)."""
        with _building():
            return self._build_posenc(base, wheelhouse, tag)

    def _build_posenc(self, base: str, wheelhouse: Path, tag: str) -> tuple[str, list[str]]:
        built = self.run(
            "build",
            "--format=docker",  # HEALTHCHECK is a Docker image field, not an OCI one
            "--layers",
            f"--build-arg=PYTHON_IMAGE={base}",
            "--build-arg=WHEELHOUSE=/wheelhouse",
            f"--volume={wheelhouse}:/wheelhouse:ro",
            f"--tag={tag}",
            str(ROOT),
            timeout=900,
        )
        # "STEP 2/11: ...", or "[1/2] STEP 2/11: ..." in a build of several stages.
        step = r"(?:\[\d+/\d+\] )?STEP \d+/\d+: "
        parts = re.split(f"^(?={step})", built.stdout, flags=re.MULTILINE)
        return (
            self.out("image", "inspect", "--format", "{{.Id}}", tag),
            [part for part in parts if re.match(step, part)],
        )

    # -- containers --------------------------------------------------------------------

    def healthy(self, container: str) -> bool:
        """Runs the container's health check now (no systemd here to run it on a timer)."""
        return self.run("healthcheck", "run", container, check=False).returncode == 0

    def wait_healthy(self, containers: Sequence[str], timeout: float = 240) -> None:
        # A new container's processes compile the engine's kernels before they serve: three
        # replicas of two processes on two cores take a minute or more.
        deadline = time.monotonic() + timeout
        for container in containers:
            while not self.healthy(container):
                if time.monotonic() > deadline:
                    logs = self.run("logs", container, check=False)
                    raise PodmanError(f"{container} not healthy: {logs.stdout}{logs.stderr}")
                time.sleep(0.5)

    def state(self, container: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.out("inspect", container))[0]["State"]
        return found

    def host_port(self, container: str, port: int) -> int:
        published = self.out("port", container, f"{port}/tcp")
        host, _, number = published.rpartition(":")
        assert host == "127.0.0.1", f"{container} publishes {published}, not on 127.0.0.1"
        return int(number)

    def metrics(self, container: str, port: int) -> str:
        """The Prometheus text of the container's metrics port, read inside the container."""
        script = (
            "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen("
            f"'http://127.0.0.1:{port}/metrics', timeout=10).read().decode())"
        )
        return self.out("exec", container, "python3", "-c", script, timeout=60)


def make_podman(directory: Path) -> Podman:
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return Podman(conf)


def wheelhouse() -> Path:
    """Wheels of the image's dependencies and build backend, built on the host with its pip
    (the index is reached through the host's trust store) and cached by the list."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    server = tomllib.loads((ROOT / "server" / "pyproject.toml").read_text())
    requirements = [
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
        # The server's own, less posenc (the image installs it from the checkout).
        *(r for r in server["project"]["dependencies"] if not r.startswith("posenc")),
    ]
    recipe = json.dumps([requirements, sys.version_info[:2], sys.platform])
    directory = CACHE / f"wheels-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}"
    with _building():
        _build_wheels(requirements, directory)
    return directory


def _build_wheels(requirements: list[str], directory: Path) -> None:
    if not directory.exists():
        partial = directory.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(partial)]
        result = _run([*argv, *requirements], timeout=900)
        if result.returncode != 0:
            raise PodmanError(f"pip wheel failed:\n{result.stderr[-4000:]}")
        partial.rename(directory)


def request_counts(metrics_text: str) -> int:
    """Table calls (every method but GetServerInfo) in ``posenc_requests_total``."""
    total = 0.0
    for line in metrics_text.splitlines():
        match = re.match(r"posenc_requests_total\{(.*)\} (\S+)$", line)
        if match and 'method="GetServerInfo"' not in match.group(1):
            total += float(match.group(2))
    return int(total)


# -- compose -----------------------------------------------------------------------------


def _seconds(value: str) -> int:
    match = re.fullmatch(r"(\d+)(s|m)", value)
    assert match, f"unsupported duration {value!r}"
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def _hostless_port(spec: str) -> tuple[str, int, int]:
    """``[HOST_IP:]HOST_PORT:CONTAINER_PORT`` as (host ip, host port, container port)."""
    parts = spec.split(":")
    ip = parts[0] if len(parts) == 3 else "0.0.0.0"
    return ip, int(parts[-2]), int(parts[-1])


@dataclass
class ComposeStack:
    """``docker-compose.yml`` run as podman commands, one container per replica.

    Every key of a service becomes the podman flag with the same meaning; an unknown key is
    an error, so the file cannot grow a setting these tests silently ignore. What a test
    must change is passed explicitly: ``images`` (images from Debian packages instead of
    registry ones), ``volumes`` (host files to mount instead), and every published host
    port becomes a free one on the same (loopback) address.
    """

    podman: Podman
    project: str = field(default_factory=lambda: f"posenc-test-{uuid.uuid4().hex[:8]}")
    images: Mapping[str, str] = field(default_factory=dict)
    volumes: Mapping[str, Path] = field(default_factory=dict)
    compose_file: Path = ROOT / "docker-compose.yml"

    HANDLED = frozenset(
        {
            "build", "image", "command", "environment", "expose", "deploy", "healthcheck",
            "stop_grace_period", "restart", "read_only", "tmpfs", "cap_drop", "cap_add",
            "security_opt", "user", "volumes", "ports", "depends_on",
        }
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.services: dict[str, dict[str, Any]] = yaml.safe_load(self.compose_file.read_text())[
            "services"
        ]
        for name, service in self.services.items():
            unknown = set(service) - self.HANDLED
            assert not unknown, f"docker-compose.yml: service {name} has unhandled {unknown}"
        self.network = self.project

    def container(self, service: str, index: int) -> str:
        return f"{self.project}-{service}-{index}"

    def replicas(self, service: str) -> int:
        return int(self.services[service].get("deploy", {}).get("replicas", 1))

    def running(self, service: str) -> list[str]:
        names = self.podman.out(
            "ps", "--filter", f"label=posenc.test.service={self.project}.{service}",
            "--format", "{{.Names}}",
        )  # fmt: skip
        return sorted(names.split())

    def run_argv(self, service: str, index: int) -> list[str]:
        spec = self.services[service]
        argv = ["run", "--detach", f"--name={self.container(service, index)}"]
        argv += [f"--network={self.network}", f"--network-alias={service}"]
        argv += [f"--label=posenc.test.service={self.project}.{service}"]
        if spec.get("read_only"):
            # Only the tmpfs mounts the file declares are writable.
            argv += ["--read-only", "--read-only-tmpfs=false"]
        argv += [f"--tmpfs={path}" for path in spec.get("tmpfs", [])]
        argv += [f"--cap-drop={cap}" for cap in spec.get("cap_drop", [])]
        argv += [f"--cap-add={cap}" for cap in spec.get("cap_add", [])]
        argv += [f"--security-opt={option}" for option in spec.get("security_opt", [])]
        if "user" in spec:
            argv.append(f"--user={spec['user']}")
        limits = spec.get("deploy", {}).get("resources", {}).get("limits", {})
        if "memory" in limits:
            argv.append(f"--memory={limits['memory']}")
        if "stop_grace_period" in spec:
            argv.append(f"--stop-timeout={_seconds(spec['stop_grace_period'])}")
        if "restart" in spec:
            argv.append(f"--restart={spec['restart']}")
        argv += [f"--env={key}={value}" for key, value in spec.get("environment", {}).items()]
        argv += [f"--expose={port}" for port in spec.get("expose", [])]
        check = spec.get("healthcheck")
        if check:
            kind, *command = check["test"]
            assert kind == "CMD", "only exec-form health checks are translated"
            argv += [
                f"--health-cmd={json.dumps(command)}",
                f"--health-interval={check.get('interval', '30s')}",
                f"--health-timeout={check.get('timeout', '30s')}",
                f"--health-retries={check.get('retries', 3)}",
                f"--health-start-period={check.get('start_period', '0s')}",
            ]
        for volume in spec.get("volumes", []):
            source, target, *mode = volume.split(":")
            host = self.volumes.get(source) or (self.compose_file.parent / source).resolve()
            argv.append(f"--volume={':'.join([str(host), target, *mode])}")
        for port in spec.get("ports", []):
            ip, _, container_port = _hostless_port(str(port))
            assert ip == "127.0.0.1", f"{service} publishes {port} beyond the loopback address"
            argv.append(f"--publish={ip}:{free_port()}:{container_port}")
        argv.append(self.images.get(spec["image"], spec["image"]))
        argv += [str(word) for word in spec.get("command", [])]
        return argv

    def create_network(self) -> None:
        """The stack's network (compose's default network), before :meth:`up`."""
        self.podman.run("network", "create", self.network)

    def up(self) -> None:
        """``docker compose up --detach``: services in dependency order, replicas included."""
        started: set[str] = set()

        def start(service: str) -> None:
            if service in started:
                return
            for dependency, condition in self.services[service].get("depends_on", {}).items():
                start(dependency)
                if condition.get("condition") == "service_healthy":
                    self.podman.wait_healthy(self.running(dependency))
            self.scale(service, self.replicas(service))
            started.add(service)

        for service in self.services:
            start(service)

    def scale(self, service: str, count: int) -> list[str]:
        """``docker compose up --scale service=count``: stopped replicas are started again
        and missing ones created; returns the replicas that were started."""
        existing = set(self.podman.out("ps", "--all", "--format", "{{.Names}}").split())
        running = set(self.running(service))
        started = []
        for index in range(1, count + 1):
            name = self.container(service, index)
            if name in running:
                continue
            if name in existing:
                self.podman.run("start", name)
            else:
                self.podman.run(*self.run_argv(service, index))
            started.append(name)
        return started

    def down(self) -> None:
        names = self.podman.out("ps", "--all", "--format", "{{.Names}}").split()
        mine = [name for name in names if name.startswith(f"{self.project}-")]
        if mine:
            self.podman.run("rm", "--force", "--time=5", *mine, check=False)
        self.podman.run("network", "rm", "--force", self.network, check=False)

    def gateway(self) -> str:
        """The network's gateway address, where podman's DNS server (aardvark-dns) answers."""
        network = json.loads(self.podman.out("network", "inspect", self.network))[0]
        gateway: str = network["subnets"][0]["gateway"]
        return gateway


@contextlib.contextmanager
def network(podman: Podman) -> Iterator[str]:
    """A podman network of the test's own, removed afterwards."""
    name = f"posenc-test-{uuid.uuid4().hex[:8]}"
    podman.run("network", "create", name)
    try:
        yield name
    finally:
        podman.run("network", "rm", "--force", name, check=False)


# -- fixtures (imported by the container test modules) -----------------------------------
# Each module that imports a fixture gets its own copy of it: the work is done once per
# session all the same, in these memoized functions.


@functools.cache
def _podman(directory: Path) -> Podman | str:
    reason = install_podman()
    if reason is not None:
        return reason
    found = make_podman(directory)
    probe = found.run("info", check=False)
    if probe.returncode != 0:
        return f"podman cannot run here: {probe.stderr.strip()}"
    return found


@functools.cache
def _posenc_image(podman: Podman) -> str:
    started = time.monotonic()
    base = podman.debian_image(PYTHON_BASE)
    based = time.monotonic()
    wheels = wheelhouse()
    wheeled = time.monotonic()
    podman.build_posenc(base, wheels)
    print(
        f"posenc image: base {based - started:.1f} s, wheels {wheeled - based:.1f} s, "
        f"podman build {time.monotonic() - wheeled:.1f} s"
    )
    return IMAGE


@pytest.fixture(scope="session", name="podman")
def podman_fixture(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    """podman, installed with apt-get when missing; the tests skip only when it cannot run."""
    found = _podman(tmp_path_factory.getbasetemp() / "podman")
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="session", name="posenc_image")
def posenc_image_fixture(podman: Podman) -> str:
    """posenc:1.0.0, built from the Dockerfile on the Debian base with the host's wheels."""
    return _posenc_image(podman)


def expected(start: int, stop: int, d_model: int) -> bytes:
    """The float32 table the server must send, computed here by the engine."""
    return encode_range(classic(d_model), start, stop).tobytes()
