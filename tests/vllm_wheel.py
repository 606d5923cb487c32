"""The vLLM tests' wheels: vLLM's rotary-embedding package, as published.

Of two releases (tests/engine_wheel.py): 0.33.0, the oldest supported, pinned with its
SHA-256; and the newest, resolved when the tests run (``POSENC_VLLM_VERSION`` names
another). The tests that need them skip under ``POSENC_SKIP_VLLM=1``.
"""

from __future__ import annotations

from engine_wheel import Release, engine

# What the tests import: the rotary package and the version module (vllm.__version__).
KEEP = ("vllm/model_executor/layers/rotary_embedding/", "vllm/_version.py")
ENGINE = engine("vllm", "manylinux_2_28_x86_64", KEEP)
OLDEST = Release(
    ENGINE, "0.33.0", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
)
SKIP_ENV = ENGINE.skip_env
VERSION = OLDEST.version


def newest() -> Release:
    """The newest release (or ``POSENC_VLLM_VERSION``'s), unpinned."""
    return Release(ENGINE, ENGINE.newest())
