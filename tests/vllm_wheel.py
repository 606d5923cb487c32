"""vLLM's rotary-embedding package from its published wheels, for the vLLM tests.

Two releases (tests/engine_wheel.py): the oldest supported, 0.33.0, pinned with its
SHA-256, and the newest, resolved at test time (``POSENC_VLLM_VERSION`` names another).
``POSENC_SKIP_VLLM=1`` skips the tests that need them.
"""

from __future__ import annotations

from engine_wheel import Engine, Release

ENGINE = Engine(
    package="vllm",
    platform="manylinux_2_28_x86_64",
    # What the tests import: the rotary package and the version module (vllm.__version__).
    keep=("vllm/model_executor/layers/rotary_embedding/", "vllm/_version.py"),
    skip_env="POSENC_SKIP_VLLM",
    version_env="POSENC_VLLM_VERSION",
)
OLDEST = Release(
    ENGINE, "0.33.0", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
)
SKIP_ENV = ENGINE.skip_env
VERSION = OLDEST.version


def newest() -> Release:
    """The newest release (or ``POSENC_VLLM_VERSION``'s), unpinned."""
    return Release(ENGINE, ENGINE.newest())
