"""The operator's alerting and recording rules (deploy/prometheus): valid, each alert firing
on the series that should fire it and only then (``promtool test rules``), and every metric
they read one the server exports.

promtool comes with Debian's prometheus package, installed here with apt-get when missing
(as root, as tests/containers.py installs podman).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, Spawn, apt_install, free_port
from prometheus_client import REGISTRY
from test_operations import metrics_port

import posenc
from posenc_server import metrics

RULES = ROOT / "deploy" / "prometheus"


def install_prometheus() -> str | None:
    """Install Debian's prometheus package (promtool, prometheus) when missing; the reason
    when it cannot be."""
    if shutil.which("promtool") and shutil.which("prometheus"):
        return None
    return apt_install(["prometheus"], "promtool")


@pytest.fixture(scope="module")
def promtool() -> str:
    reason = install_prometheus()
    if reason is not None:
        pytest.skip(reason)
    path = shutil.which("promtool")
    assert path is not None
    return path


def test_the_rules_are_valid_and_pass_their_unit_tests(promtool: str) -> None:
    for command, path in (("check", "rules.yml"), ("test", "rules_test.yml")):
        done = subprocess.run(
            [promtool, command, "rules", path],
            cwd=RULES,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def _rules() -> list[dict[str, str]]:
    groups = yaml.safe_load((RULES / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_rules_cover_what_an_operator_watches() -> None:
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts >= {
        "PosencReplicaDown",
        "PosencErrorRateHigh",
        "PosencOverloaded",
        "PosencCacheHitRateLow",
        "PosencLatencyHigh",
    }
    tested = yaml.safe_load((RULES / "rules_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tested
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert fired == alerts  # every alert is shown firing


def test_every_metric_the_rules_read_is_exported() -> None:
    """A renamed metric would silence its alert: every posenc_ name the rules read is one
    the server registers."""
    assert metrics.REQUESTS is not None  # registered on import
    exported = set()
    for family in REGISTRY.collect():
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
    exported.update(
        f"{name}{suffix}"
        for name in list(exported)
        for suffix in ("_total", "_bucket", "_count", "_sum")
    )
    read = {name for rule in _rules() for name in re.findall(r"\bposenc_[a-z_]+", rule["expr"])}
    assert read and read <= exported, read - exported


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_real_prometheus_scrapes_the_server_and_runs_the_rules(
    promtool: str, spawn_server: Spawn, tmp_path: Path
) -> None:
    """Debian's Prometheus scrapes a 2-process server (the supervisor's sum of its workers)
    and a replica that is gone, with the rules loaded: the live one is up with its calls
    counted, the recording rules have values, and the gone one is the pending
    PosencReplicaDown alert."""
    binary = shutil.which("prometheus")
    assert binary is not None
    server = spawn_server(0, "--processes", "2")
    with posenc.Client(server.target) as client:
        for start in range(0, 640, 64):
            client.get_range(start, start + 64, 32)
    live = f"127.0.0.1:{metrics_port(server)}"
    gone = f"127.0.0.1:{free_port()}"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES / "rules.yml")],
        "scrape_configs": [{"job_name": "posenc", "static_configs": [{"targets": [live, gone]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = free_port()
    prometheus = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        wanted = {
            "up live": f'up{{job="posenc",instance="{live}"}} == 1',
            "up gone": f'up{{job="posenc",instance="{gone}"}} == 0',
            "calls": f'posenc_requests_total{{instance="{live}",method="GetEncoding",code="OK"}}'
            " >= 10",
            "recorded": 'posenc:requests:rate5m{method="GetEncoding",code="OK"}',
            "hit ratio": "posenc:cache_hits:ratio_rate5m",
            "down alert": f'ALERTS{{alertname="PosencReplicaDown",instance="{gone}"}}',
        }
        missing = dict(wanted)
        while missing and time.monotonic() < deadline:
            for name, expr in list(missing.items()):
                with contextlib.suppress(OSError):
                    if _query(web, expr):
                        del missing[name]
            time.sleep(0.5)
        assert not missing, missing
        assert prometheus.poll() is None
    finally:
        prometheus.terminate()
        prometheus.wait(30)
