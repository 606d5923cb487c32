"""The same bytes on every CPU: the engine's output does not depend on numpy's SIMD dispatch
nor on the CPU numba compiles the engine's kernel for.

numpy picks its sin, cos and complex-multiply kernels by CPU feature (AVX2 with FMA,
AVX-512 with SVML); their last bits differ. ``NPY_DISABLE_CPU_FEATURES`` turns that dispatch
off in a fresh process, which then stands for an older CPU: every dtype's bytes must match.
``NUMBA_CPU_NAME=generic`` compiles the kernel for a baseline x86-64 (no AVX, no FMA)
instead of this machine's CPU: the same.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

# Tables of every kind and width class, float64 and float32, ranges and scattered positions.
_SCRIPT = r"""
import hashlib, json
import numpy as np
from posenc_server import engine
from posenc_server.tables.rotary import Rotary
from posenc_server.tables.scalings import Yarn
from posenc_server.tables.sinusoidal import Sinusoidal, Tensor2Tensor

tables = [
    Sinusoidal(1), Sinusoidal(7, 500000.0), Sinusoidal(512), Sinusoidal(4096, layout="split"),
    Tensor2Tensor(33, min_timescale=0.5),
    Rotary(128, 500000.0), Rotary(96, layout="vllm"),
    Rotary(64, 1e6, scaling=Yarn(factor=4.0, original_max_position_embeddings=4096)),
]
positions = np.random.default_rng(7).integers(-(2**42), 2**42, 2000)
digests = {}
for index, table in enumerate(tables):
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        encoding = engine.Encoding.prepare(table, dtype)
        digest = hashlib.sha256()
        digest.update(engine.encode_range(encoding, 10**6, 10**6 + 1500).tobytes())
        digest.update(engine.encode_range(encoding, 2**42 - 700, 2**42).tobytes())
        digest.update(engine.encode_positions(encoding, positions).tobytes())
        digests[f"{index}:{dtype}"] = digest.hexdigest()
print(json.dumps(digests))
"""


@functools.cache
def _native() -> dict[str, str]:
    """This machine's digests, as every test here compares with them: computed once."""
    return _digests(None)


def _digests(disabled: str | None, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NPY_")}
    if disabled is not None:
        env["NPY_DISABLE_CPU_FEATURES"] = disabled
    env.update(extra)
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    digests: dict[str, str] = json.loads(result.stdout)
    return digests


def _dispatched_features() -> str:
    """The CPU features numpy dispatches to on this machine (the ones that can be turned off)."""
    script = (
        "from numpy._core._multiarray_umath import __cpu_features__ as f, __cpu_dispatch__ as d;"
        "print(' '.join(x for x in d if f.get(x)))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    return result.stdout.strip()


@pytest.mark.slow
def test_bytes_do_not_depend_on_numpys_simd_dispatch() -> None:
    features = _dispatched_features()
    if not features:
        pytest.skip("numpy dispatches to no CPU feature beyond its baseline here")
    native = _native()
    baseline = _digests(features)
    differing = sorted(key for key in native if native[key] != baseline[key])
    assert not differing, f"bytes differ with NPY_DISABLE_CPU_FEATURES={features!r}: {differing}"


@pytest.mark.slow
def test_bytes_do_not_depend_on_the_cpu_the_kernel_is_compiled_for() -> None:
    native = _native()
    generic = _digests(None, NUMBA_CPU_NAME="generic")
    differing = sorted(key for key in native if native[key] != generic[key])
    assert not differing, f"bytes differ with the kernel compiled for a generic CPU: {differing}"


@pytest.mark.slow
def test_the_kernel_runs_where_numba_has_no_place_to_cache_it() -> None:
    """A server installed read-only to its user, whose home is not writable either, leaves
    numba no place for its cache (``IPythonCacheLocator`` alone finds none outside IPython):
    the kernel is then compiled in each process, with the same bytes."""
    native = _native()
    uncached = _digests(None, NUMBA_CACHE_LOCATOR_CLASSES="IPythonCacheLocator")
    assert uncached == native
