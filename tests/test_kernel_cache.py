"""numba's on-disk cache of the kernel: entry points compiled by different processes, each
for one format, then loaded together by another, give the bytes of entry points compiled
in that process (the functions one factory makes have names of their own: code cached
apart never holds two of them under one symbol)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each format's rows, by both paths a row takes (straight, and by runs), as a digest.
_SCRIPT = r"""
import hashlib, sys
import numpy as np
from posenc_server import engine
from posenc_server.tables.rotary import Rotary
from posenc_server.tables.sinusoidal import Sinusoidal

for dtype in sys.argv[1:]:
    for table in (Rotary(128), Sinusoidal(512)):
        encoding = engine.Encoding.prepare(table, dtype)
        digest = hashlib.sha256(engine.encode_range(encoding, 10**6, 10**6 + 1500).tobytes())
        digest.update(engine.encode_positions(encoding, np.arange(5, 900, 7)).tobytes())
        print(dtype, digest.hexdigest())
"""


def _digests(*dtypes: str, **env: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *dtypes],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.split("\n")


@pytest.mark.slow
def test_kernels_cached_by_different_processes_load_together(tmp_path: Path) -> None:
    cache = {"NUMBA_CACHE_DIR": str(tmp_path)}
    _digests("bfloat16", **cache)  # each format compiled and cached by a process of its own
    _digests("float16", **cache)
    loaded = _digests("bfloat16", "float16", **cache)
    compiled = _digests("bfloat16", "float16", NUMBA_CACHE_LOCATOR_CLASSES="IPythonCacheLocator")
    assert loaded == compiled
