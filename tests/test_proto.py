"""The contract: buf lint is clean and the committed stubs are what proto/ generates."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    assert buf, "buf not installed (dev extra: buf-bin)"
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_stubs.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh = tmp_path / "posenc_protocol" / "v1"
    committed = ROOT / "protocol" / "posenc_protocol" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, names, shallow=False)
    assert not mismatch and not errors, (
        f"stale stubs {mismatch + errors}: run `make stubs` and commit the result"
    )
