"""vLLM's rotary-embedding package from its published wheel, for the vLLM tests.

vLLM is a CUDA install that cannot run here, but its ``rotary_embedding`` modules are plain
torch. :func:`unpacked` downloads the wheel once with pip (``pip download vllm==0.33.0
--no-deps``, the manylinux x86_64 build whatever the machine), checks its pinned SHA-256,
keeps only the files the tests import and deletes the rest: later runs reuse them.

Without the network the download fails, and so do the tests that need it, with pip's
reason. ``POSENC_SKIP_VLLM=1`` skips them instead (an explicit opt-out, never a silent one).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VERSION = "0.33.0"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
# What the tests import: the rotary package and the version module (vllm.__version__).
KEEP = ("vllm/model_executor/layers/rotary_embedding/", "vllm/_version.py")
SKIP_ENV = "POSENC_SKIP_VLLM"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One download at a time across processes sharing the cache directory."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download(into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps",
        "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
        "--python-version", "3.11", "--implementation", "cp",
        "--disable-pip-version-check", "-q", "-d", str(into),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    wheel = into / WHEEL
    if done.returncode != 0 or not wheel.exists():
        raise RuntimeError(
            f"could not download vLLM {VERSION}'s wheel with pip (the vLLM tests need it; "
            f"{SKIP_ENV}=1 skips them): {done.stderr.strip()[-2000:]}"
        )
    digest = hashlib.sha256()
    with open(wheel, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != SHA256:
        raise RuntimeError(f"{WHEEL} has SHA-256 {digest.hexdigest()}, expected {SHA256}")
    return wheel


def unpacked(cache_dir: Path) -> Path:
    """The directory holding ``vllm/`` (only the kept files), downloading it the first time."""
    root = cache_dir / "root"
    if (root / "COMPLETE").exists():
        return root
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / "lock"):
        if (root / "COMPLETE").exists():
            return root
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            wheel = _download(Path(tmp))
            staged = Path(tmp) / "root"
            with zipfile.ZipFile(wheel) as archive:
                kept = [n for n in archive.namelist() if n.startswith(KEEP)]
                archive.extractall(staged, members=kept)
            (staged / "COMPLETE").write_text(f"{WHEEL} {SHA256}\n")
            shutil.rmtree(root, ignore_errors=True)
            os.replace(staged, root)
    return root
