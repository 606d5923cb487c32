"""An inference engine's published wheel, cut down to the files its tests import.

vLLM and SGLang are CUDA installs that cannot run here, but their rotary-embedding modules
are plain torch. :func:`unpacked` downloads a release's wheel once with pip (``pip download
--no-deps``, the manylinux x86_64 build whatever the machine), checks its SHA-256 when one
is pinned, keeps only the files the tests import and deletes the rest: later runs reuse
them. Each engine is tested at two releases: the oldest it supports, pinned with its hash,
and the newest, resolved at test time (``pip index versions``) unless an environment
variable names one (a CI step choosing the release).

Without the network the download fails, and so do the tests that need it, with pip's
reason; each engine's skip variable (``POSENC_SKIP_VLLM=1``, ``POSENC_SKIP_SGLANG=1``) skips
them instead (an explicit opt-out, never a silent one).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

# DeepSeek-V3's rotary scaling (rope_scaling of its config.json), which both engines' suites
# build: 163840 rows of head 64, at theta 10000.
DEEPSEEK_V3_YARN: dict[str, Any] = {
    "rope_type": "deepseek_yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@dataclass(frozen=True)
class Engine:
    """Where an engine's wheels come from and what of them the tests keep."""

    package: str
    platform: str  # the wheel's manylinux tag
    keep: tuple[str, ...]  # path prefixes inside the wheel
    skip_env: str
    version_env: str  # names the "newest" release instead of resolving it

    def _target(self) -> list[str]:
        return [
            "--only-binary=:all:", "--platform", self.platform, "--python-version", "3.11",
            "--implementation", "cp", "--disable-pip-version-check",
        ]  # fmt: skip

    def newest(self) -> str:
        """The release named by :attr:`version_env`, else the newest pip finds."""
        chosen = os.environ.get(self.version_env, "").strip()
        if chosen:
            return chosen
        command = [sys.executable, "-m", "pip", "index", "versions", self.package]
        done = subprocess.run(command + self._target(), capture_output=True, text=True, timeout=300)
        match = re.search(rf"^{re.escape(self.package)} \(([^)]+)\)", done.stdout, re.M)
        if done.returncode != 0 or match is None:
            raise RuntimeError(
                f"could not resolve {self.package}'s newest release with pip (set "
                f"{self.version_env} to choose one, or {self.skip_env}=1 to skip): "
                f"{done.stderr.strip()[-2000:]}"
            )
        return match[1]


def engine(package: str, platform: str, keep: tuple[str, ...]) -> Engine:
    """The :class:`Engine` for ``package``, skipped by ``POSENC_SKIP_<PACKAGE>=1`` and
    pointed at another "newest" release by ``POSENC_<PACKAGE>_VERSION``."""
    upper = package.upper()
    return Engine(package, platform, keep, f"POSENC_SKIP_{upper}", f"POSENC_{upper}_VERSION")


@dataclass(frozen=True)
class Release:
    """One release of an engine; ``sha256`` pins the oldest's wheel (None: not pinned)."""

    engine: Engine
    version: str
    sha256: str | None = None

    @property
    def name(self) -> str:
        return f"{self.engine.package}-{self.version}"

    def _download(self, into: Path) -> Path:
        command = [
            sys.executable, "-m", "pip", "download", f"{self.engine.package}=={self.version}",
            "--no-deps", "-q", "-d", str(into),
        ]  # fmt: skip
        done = subprocess.run(
            command + self.engine._target(), capture_output=True, text=True, timeout=1800
        )
        wheels = sorted(into.glob(f"{self.engine.package}-{self.version}-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not download {self.name}'s wheel with pip (the tests need it; "
                f"{self.engine.skip_env}=1 skips them): {done.stderr.strip()[-2000:]}"
            )
        if self.sha256 is not None:
            digest = hashlib.sha256()
            with open(wheels[0], "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
            if digest.hexdigest() != self.sha256:
                raise RuntimeError(
                    f"{wheels[0].name} has SHA-256 {digest.hexdigest()}, expected {self.sha256}"
                )
        return wheels[0]

    def unpacked(self, cache_dir: Path) -> Path:
        """The directory holding the package (only the kept files), downloaded the first
        time into ``cache_dir``."""
        root = cache_dir / "root"
        if (root / "COMPLETE").exists():
            return root
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _locked(cache_dir / "lock"):
            if (root / "COMPLETE").exists():
                return root
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                wheel = self._download(Path(tmp))
                staged = Path(tmp) / "root"
                with zipfile.ZipFile(wheel) as archive:
                    kept = [n for n in archive.namelist() if n.startswith(self.engine.keep)]
                    archive.extractall(staged, members=kept)
                (staged / "COMPLETE").write_text(f"{wheel.name} {self.sha256 or 'unpinned'}\n")
                shutil.rmtree(root, ignore_errors=True)
                os.replace(staged, root)
        return root


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One download at a time across processes sharing the cache directory."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def stub_module(name: str, path: Path | None = None, **attributes: Any) -> ModuleType:
    """A module in ``sys.modules`` under ``name``: a package over ``path`` when given (its
    files import as usual), else ``attributes`` only (a stand-in)."""
    module = ModuleType(name)
    # A spec, as an imported module has: importlib.util.find_spec answers with it.
    module.__spec__ = ModuleSpec(name, None, is_package=path is not None)
    if path is not None:
        module.__path__ = [str(path)]
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def stub_packages(root: Path, *names: str) -> ModuleType:
    """A package module over ``root``'s folder of each dotted name in ``names`` (their files
    import as usual, their ``__init__`` files do not run); the first is returned."""
    modules = [stub_module(name, root.joinpath(*name.split("."))) for name in names]
    return modules[0]


def unload(package: str) -> None:
    """Takes ``package`` and every module under it out of ``sys.modules``."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


@contextmanager
def float64_arithmetic(prefix: str) -> Iterator[None]:
    """The engine's modules under ``prefix`` compute in float64: ``torch.float`` and
    ``torch.float32`` read as float64 inside them (the dtype argument alone would not do:
    the classes compute in ``torch.float`` whatever it is, then cast)."""
    import torch

    class Float64Torch(ModuleType):
        float = torch.float64
        float32 = torch.float64

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    modules = [m for n, m in sys.modules.items() if n.startswith(prefix) and m is not None]
    patched = [m for m in modules if getattr(m, "torch", None) is torch]
    proxy = Float64Torch("torch")
    for module in patched:
        module.torch = proxy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.torch = torch  # type: ignore[attr-defined]


@contextmanager
def loaded(request: Any, wheel: Any, stubs: Any) -> Iterator[ModuleType]:
    """The rotary package of the release ``request.param`` names (``"oldest"``, pinned, or
    ``"newest"``, resolved now) of an engine (its ``*_wheel`` and ``*_stubs`` test modules),
    in ``sys.modules`` until the block ends; skipped by the engine's skip variable."""
    import pytest

    if os.environ.get(wheel.SKIP_ENV) == "1":
        pytest.skip(f"{wheel.SKIP_ENV}=1: the engine's own classes not tested")
    if request.param == "oldest" and os.environ.get("POSENC_NEWEST") == "1":
        # make test-newest: the newest releases only (make test runs the pinned ones).
        pytest.skip("POSENC_NEWEST=1: the newest release only")
    release = wheel.OLDEST if request.param == "oldest" else wheel.newest()
    root = release.unpacked(Path(request.config.cache.mkdir(release.name)))
    try:
        yield stubs.load(root)
    finally:
        stubs.unload()


def exact_table(rows: int, dim: int, theta: float) -> Any:
    """The cos | sin cache of a default rotary table, in float64: what the engines hold."""
    import torch

    frequencies = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(rows, dtype=torch.float64), frequencies)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def assert_fixed_subclass_served_alone(base: Any, install: Any, bound: float) -> None:
    """A model's own subclass of the engine's rotary class ``base`` that only fixes the
    constructor's arguments (head 128, 2048 rows, theta 500000) holds its base class's cache
    and is served; one that computes its frequencies otherwise is left, named with the
    reason. ``install(model)`` (an integration's install_model) must serve the first alone,
    within ``bound`` of the exact table, and leave the second as it was."""
    import torch

    class FixedRotaryEmbedding(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(128, 128, 2048, 500000.0, True, torch.float32)

    class OtherRotaryEmbedding(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(128, 128, 2048, 500000.0, True, torch.float32)

        def _compute_inv_freq(self, base: float) -> Any:
            return super()._compute_inv_freq(base) / 2

    model = torch.nn.ModuleDict({"fixed": FixedRotaryEmbedding(), "other": OtherRotaryEmbedding()})
    other = model["other"].cos_sin_cache.clone()
    assert install(model) == ["fixed"]
    assert torch.equal(model["other"].cos_sin_cache, other)
    error = float(
        (model["fixed"].cos_sin_cache.double() - exact_table(2048, 128, 500000.0)).abs().max()
    )
    assert error <= bound
