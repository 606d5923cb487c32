"""SGLang's rotary-embedding package from its published wheels, for the SGLang tests.

Two releases (tests/engine_wheel.py): the oldest supported, 0.5.20, pinned with its
SHA-256, and the newest, resolved at test time (``POSENC_SGLANG_VERSION`` names another).
``POSENC_SKIP_SGLANG=1`` skips the tests that need them.
"""

from __future__ import annotations

from engine_wheel import Release, engine

# The rotary package and the version modules (sglang.version.__version__).
KEEP = ("sglang/srt/layers/rotary_embedding/", "sglang/version.py", "sglang/_version.py")
ENGINE = engine("sglang", "manylinux_2_34_x86_64", KEEP)
OLDEST = Release(
    ENGINE, "0.5.20", "1573527042f4f6b4ead838302818595fc77fdc611dbcc2e40cd150fbc8f8513c"
)
SKIP_ENV = ENGINE.skip_env


def newest() -> Release:
    """The newest release (or ``POSENC_SGLANG_VERSION``'s), unpinned."""
    return Release(ENGINE, ENGINE.newest())
