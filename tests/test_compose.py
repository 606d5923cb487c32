"""The compose stack, run: three posenc replicas behind nginx, and Prometheus scraping them,
from docker-compose.yml.

The file's services run as podman commands (tests/containers.py, ComposeStack), each key
translated to the podman flag with the same meaning. Three substitutions, and only these:
images made from Debian packages (posenc:1.0.0 built from the Dockerfile; nginx 1.30 from
Debian 14, forky, for `server ... resolve`; Prometheus 3 from forky too) instead of registry
pulls; the host ports, free ones on 127.0.0.1; and nginx.conf's resolver address, 127.0.0.11
(Docker's DNS server), replaced by the address of podman's DNS server on the test's network.
Prometheus reads deploy/prometheus's files as they are. Every call goes from the host to
nginx on 127.0.0.1, and each replica's calls are read from its own metrics and from
Prometheus's API, on 127.0.0.1 too.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from containers import (  # noqa: F401  (fixtures)
    NGINX_BASE,
    PROMETHEUS_BASE,
    ComposeStack,
    Podman,
    expected,
    podman_fixture,
    posenc_image_fixture,
    request_counts,
)

import posenc

NGINX_CONF = Path(__file__).resolve().parent.parent / "deploy" / "nginx" / "nginx.conf"
RULES = NGINX_CONF.parent.parent / "prometheus" / "rules.yml"
METRICS_PORT = 9464

# A cold first run builds both images here (make test runs this file first): about 6 min.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass
class Stack:
    compose: ComposeStack
    target: str
    prometheus: str  # its API's base URL, from the host

    @property
    def podman(self) -> Podman:
        return self.compose.podman

    def replicas(self) -> list[str]:
        return self.compose.running("posenc")

    def calls(self) -> dict[str, int]:
        """Table calls each running replica has served, from its metrics."""
        return {
            name: request_counts(self.podman.metrics(name, METRICS_PORT))
            for name in self.replicas()
        }

    def address(self, container: str) -> str:
        """The container's address on the stack's network, which DNS answers for it."""
        networks = json.loads(self.podman.out("inspect", container))[0]["NetworkSettings"]
        address: str = networks["Networks"][self.compose.network]["IPAddress"]
        return address

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of a Prometheus API answer."""
        url = f"{self.prometheus}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """An instant query's values by their ``instance`` label ("" where it has none)."""
        result = self.api("/api/v1/query", query=expr)["result"]
        return {r["metric"].get("instance", ""): float(r["value"][1]) for r in result}


@pytest.fixture(scope="module")
def stack(
    podman: Podman, posenc_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    started = time.monotonic()
    nginx_image = podman.debian_image(NGINX_BASE)
    prometheus_image = podman.debian_image(PROMETHEUS_BASE)
    print(f"nginx and prometheus images: {time.monotonic() - started:.1f} s")
    compose = ComposeStack(podman)
    compose.images = {
        compose.services["nginx"]["image"]: nginx_image,
        compose.services["prometheus"]["image"]: prometheus_image,
    }
    directory = tmp_path_factory.mktemp("compose")
    try:
        compose.create_network()
        conf, count = re.subn(
            r"^(\s*resolver) 127\.0\.0\.11 ",
            rf"\1 {compose.gateway()} ",
            NGINX_CONF.read_text(),
            flags=re.MULTILINE,
        )
        assert count == 1, "deploy/nginx/nginx.conf has no single `resolver 127.0.0.11`"
        (directory / "nginx.conf").write_text(conf)
        compose.volumes = {"./deploy/nginx/nginx.conf": directory / "nginx.conf"}
        compose.up()
        (nginx,) = compose.running("nginx")
        target = f"127.0.0.1:{podman.host_port(nginx, 50051)}"
        deadline = time.monotonic() + 30
        with posenc.Client(target) as client:
            while True:
                try:
                    if client.health(timeout=2) == "SERVING":
                        break
                except posenc.PosencError:
                    pass
                assert time.monotonic() < deadline, "nginx does not answer"
                time.sleep(0.2)
        (prometheus,) = compose.running("prometheus")
        api = f"http://127.0.0.1:{podman.host_port(prometheus, 9090)}"
        yield Stack(compose, target, api)
    finally:
        compose.down()


@dataclass
class Load:
    """Threads making bounded loops of SDK calls through nginx, each result checked exactly."""

    target: str
    threads: int = 4
    max_calls: int = 400
    made: int = 0
    exact: int = 0
    failed: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with posenc.Client(self.target) as client:
            for _ in range(self.max_calls):
                if self._stop.is_set():
                    return
                # Mostly unary calls; one in four a stream of a few MiB.
                d_model = rng.choice([64, 128, 256])
                rows = rng.randint(1, 400) if rng.random() < 0.75 else rng.randint(5000, 12000)
                start = rng.randint(-10_000, 1_000_000)
                try:
                    table = client.get_range(start, start + rows, d_model, timeout=60)
                    good = table.tobytes() == expected(start, start + rows, d_model)
                    with self._lock:
                        self.made += 1
                        self.exact += good
                except Exception as error:
                    with self._lock:
                        self.made += 1
                        self.failed.append(repr(error))

    def __enter__(self) -> Load:
        for index in range(self.threads):
            worker = threading.Thread(target=self._loop, args=(index,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(120)

    def wait_for(self, calls: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.made < calls:
            assert any(w.is_alive() for w in self._workers), (
                f"the load made all its {self.made} calls before reaching {calls}"
            )
            assert time.monotonic() < deadline, f"only {self.made} calls in {timeout} s"
            time.sleep(0.05)


def test_three_replicas_answer_and_calls_spread_over_them(stack: Stack) -> None:
    replicas = stack.replicas()
    assert len(replicas) == 3
    before = stack.calls()
    with Load(stack.target, threads=3, max_calls=50) as load:
        load.wait_for(150)
    assert not load.failed and load.exact == load.made
    after = stack.calls()
    served = {name: after[name] - before[name] for name in replicas}
    total = sum(served.values())
    print(f"{load.made} calls through nginx, per replica: {sorted(served.values())}")
    assert total >= load.made
    # Round robin per call: each replica serves about a third.
    assert all(count >= total / 6 for count in served.values()), served


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_stopping_a_replica_mid_load_loses_no_call(stack: Stack, how: str) -> None:
    """``stop``: SIGTERM, the replica drains (NOT_SERVING, calls in flight finish, new ones
    get UNAVAILABLE and the SDK retries them) and exits. ``kill``: SIGKILL, connections
    drop mid-call; nginx passes refused connections to another replica and the SDK retries
    or resumes the rest."""
    victim = stack.replicas()[0]
    # A budget no kill outlasts: the loops end when the block does, well before it.
    with Load(stack.target, threads=4, max_calls=2500) as load:
        load.wait_for(60)
        before = load.made
        served_before = stack.calls()[victim]
        stopped = time.monotonic()
        stack.podman.run(how, victim, timeout=120)
        stop_seconds = time.monotonic() - stopped
        load.wait_for(load.made + 200, timeout=120)
    assert victim not in stack.replicas()
    print(
        f"replica {how} ({stop_seconds:.1f} s) mid-load: {load.made} calls ({before} before, "
        f"{served_before} served by it), {len(load.failed)} failed, {load.exact} exact"
    )
    assert served_before > 0  # it was in the rotation
    if load.failed:  # what nginx and the replica saw, for the failure's report
        (nginx,) = stack.compose.running("nginx")
        lines = stack.podman.run("logs", nginx, check=False).stdout.splitlines()
        print("nginx, calls not OK:", *[s for s in lines if "grpc-status=0" not in s], sep="\n")
        print("replica:", stack.podman.run("logs", victim, check=False).stderr[-6000:], sep="\n")
    assert load.failed == []
    assert load.exact == load.made >= before + 200


def test_scale_to_four_is_picked_up(stack: Stack) -> None:
    started = stack.compose.scale("posenc", 4)
    assert started
    replicas = stack.replicas()
    assert len(replicas) == 4
    stack.podman.wait_healthy(replicas)
    before = stack.calls()
    # nginx re-resolves the service name every 5 s: new replicas join without a reload.
    deadline = time.monotonic() + 30
    with posenc.Client(stack.target) as client:
        while True:
            for start in range(0, 40 * 64, 64):
                table = client.get_range(start, start + 64, 128, timeout=60)
                assert table.tobytes() == expected(start, start + 64, 128)
            served = {name: count - before[name] for name, count in stack.calls().items()}
            if all(count > 0 for count in served.values()):
                break
            assert time.monotonic() < deadline, f"not every replica is used: {served}"
    print(f"scaled to 4 (started {started}): calls per replica {sorted(served.values())}")


def test_prometheus_scrapes_every_replica_and_runs_the_rules(stack: Stack) -> None:
    """Prometheus finds every running replica by DNS (after the test above, the one added by
    scaling too), each `up`, with the groups of rules.yml loaded and healthy, and its
    recording of the request rate rises with calls made through nginx."""
    started = time.monotonic()
    instances = {f"{stack.address(name)}:{METRICS_PORT}" for name in stack.replicas()}
    up: dict[str, float] = {}
    # Names re-resolved every 5 s, targets scraped every 5 s: a new replica is up within 10 s.
    deadline = time.monotonic() + 60
    while up != dict.fromkeys(instances, 1.0):
        assert time.monotonic() < deadline, f"up: {up}, replicas: {sorted(instances)}"
        time.sleep(0.5)
        with contextlib.suppress(OSError):  # until Prometheus listens
            up = stack.query('up{job="posenc"}')
    targets_seconds = time.monotonic() - started
    groups = [rule_group["name"] for rule_group in yaml.safe_load(RULES.read_text())["groups"]]
    rate = 'sum by (instance) (posenc:requests:rate5m{job="posenc"})'
    calls = 'sum(posenc_requests_total{job="posenc"})'
    rate_before, (calls_before,) = stack.query(rate), stack.query(calls).values()

    def running(rates: dict[str, float]) -> float:
        # A replica gone earlier in this module keeps its rate for 5 minutes: only the
        # running ones count.
        return sum(rates.get(instance, 0) for instance in instances)

    loaded = time.monotonic()
    # The load lasts until every replica's rate has risen: a counter's first sample is not
    # counted as an increase, so each replica must be scraped twice while it serves calls.
    # Scraped every 5 s and the rules evaluated every 5 s: within 15 s or so.
    with Load(stack.target, threads=2, max_calls=400) as load:
        deadline = loaded + 60
        while True:
            rate_after = stack.query(rate)
            each = all(rate_after.get(instance, 0) > 0 for instance in instances)
            if each and running(rate_after) > running(rate_before):
                break
            assert time.monotonic() < deadline, (rate_before, rate_after)
            time.sleep(0.5)
    assert not load.failed and load.exact == load.made
    rate_seconds = time.monotonic() - loaded
    deadline = time.monotonic() + 30
    while True:
        rules = stack.api("/api/v1/rules")["groups"]
        health = {rule["name"]: rule["health"] for group in rules for rule in group["rules"]}
        (calls_after,) = stack.query(calls).values()
        if (
            sorted(group["name"] for group in rules) == sorted(groups)
            and set(health.values()) == {"ok"}
            and calls_after >= calls_before + load.made
        ):
            break
        assert time.monotonic() < deadline, (rules, health, calls_before, calls_after, load.made)
        time.sleep(0.5)
    print(
        f"prometheus: {len(instances)} targets up in {targets_seconds:.1f} s; "
        f"posenc:requests:rate5m {running(rate_before):.2f} -> {running(rate_after):.2f}/s "
        f"in {rate_seconds:.1f} s of load; {load.made} calls, {calls_after - calls_before:.0f} "
        f"seen; {len(health)} rules ok; {time.monotonic() - started:.1f} s in all"
    )
