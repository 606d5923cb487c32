"""posenc.integrations.transformers on the oldest transformers release it supports.

``make test`` installs the newest supported release (the ``conformance`` extra pins it) and
tests/test_integrations_transformers.py runs against it. This test installs the oldest
(the lower end of ``TRANSFORMERS_RELEASES``) into ``.venv/transformers-<version>/`` once,
with the dependencies it declares: ``pip install --target``, held to the versions this
environment has wherever the oldest accepts them, so only what it needs older (such as
huggingface-hub 1.x and httpx) differs. The directory is reused by later runs, never
committed. The same tests then run against it in a subprocess: whole models of every family,
small positions, 2^20 and 2^24, the vision towers left alone. torch.compile's test is left
out (the newest runs it).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
transformers = pytest.importorskip("transformers")

from posenc.integrations.transformers import TRANSFORMERS_RELEASES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OLDEST = "5.17.0"
TARGET = ROOT / ".venv" / f"transformers-{OLDEST}"


# What the newest release brings that the oldest must not be held to.
_NEWER = {"transformers", "huggingface-hub", "httpx", "httpcore", "httpx2", "httpcore2"}


def _held_versions() -> list[str]:
    """``name==version`` of each distribution installed in this environment that the oldest
    may share: its site-packages only (other tests put packages of their own on sys.path,
    such as vLLM's wheel, which no constraint may name), each name once."""
    paths = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    held: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=paths):
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if name not in _NEWER and name != "posenc":
            held.setdefault(name, f"{name}=={dist.version}")
    return sorted(held.values())


def _install() -> Path:
    """The oldest release's package directory, installed on first use."""
    if (TARGET / "transformers" / "__init__.py").exists():
        return TARGET
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TARGET.name}-", dir=TARGET.parent))
    try:
        # The environment's versions where the oldest accepts them; should pip find them
        # in conflict, numpy's alone (what torch's extension is built against).
        held = _held_versions()
        failures = []
        for pins in (held, [pin for pin in held if pin.startswith("numpy==")]):
            constraints = staging.parent / f"{staging.name}.constraints.txt"
            constraints.write_text("\n".join(pins))
            command = [
                *(sys.executable, "-m", "pip", "install", "--quiet", "--retries", "10"),
                *("--target", str(staging), "--constraint", str(constraints)),
                f"transformers=={OLDEST}",
            ]
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            constraints.unlink()
            if result.returncode == 0:
                break
            failures.append(f"with {len(pins)} pins:\n{result.stderr[-3000:]}")
        else:
            raise AssertionError(
                "pip install failed:\n" + "\n".join(failures) + "\n" + "\n".join(held)
            )
        try:
            staging.rename(TARGET)  # atomic: a concurrent run's copy may have won
        except OSError:
            if not (TARGET / "transformers" / "__init__.py").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TARGET


def test_the_oldest_is_the_declared_lower_end() -> None:
    major, minor, _ = (int(part) for part in OLDEST.split("."))
    assert (major, minor) == TRANSFORMERS_RELEASES[0]
    pyproject = (ROOT / "pyproject.toml").read_text()
    low, high = TRANSFORMERS_RELEASES
    # The user-facing extra: a lower bound only (installing posenc never changes the
    # transformers a user runs); the conformance pin is the newest tested release.
    assert f'"transformers>={low[0]}.{low[1]}"' in pyproject
    (pinned,) = re.findall(r'"transformers==(\d+)\.(\d+)\.\d+"', pyproject)
    assert low <= (int(pinned[0]), int(pinned[1])) < high


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_integration_tests_pass_on_the_oldest_release() -> None:
    if transformers.__version__ == OLDEST:
        pytest.skip(f"transformers {OLDEST} is the one installed: the suite tests it directly")
    target = _install()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    env["POSENC_EXPECT_TRANSFORMERS"] = OLDEST
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "tests" / "test_integrations_transformers.py"),
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not compiled",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
