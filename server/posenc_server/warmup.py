"""What a server process runs before it listens and reports SERVING: every path a call can
take through the engine, once, on tiny tables, so that no caller waits for an import or a
compilation.

The kernels are compiled (or loaded from numba's on-disk cache) for every array type they
are given (``engine.prepare_kernel``); then a table of every kind and layout is encoded in
every dtype, as a range, a range longer than a block's few rows and a list of positions, so
that what each dtype imports (ml_dtypes' bfloat16, most of a second) and what each kind
first runs is done here, not by a fresh server's first bfloat16 call. Last, what start-up
left alive is set aside from Python's collector (``freeze``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from pathlib import Path

from posenc_server import engine
from posenc_server.tables.axes import RotaryAxes
from posenc_server.tables.base import TableKind
from posenc_server.tables.multiaxis import MRope, SinCosGrid2d, SinCosGrid3d
from posenc_server.tables.rotary import LAYOUTS, Rotary
from posenc_server.tables.scalings import Yarn
from posenc_server.tables.sinusoidal import LAYOUTS as SINUSOIDAL_LAYOUTS
from posenc_server.tables.sinusoidal import (
    SCHEDULES,
    Fairseq,
    Sinusoidal,
    Tensor2Tensor,
    TransformerXl,
    Whisper,
)

# Positions of the warm-up: from 0 (zero rows, the first block), past the few rows a new
# spec's first calls rotate alone, and one far away.
_RANGES = ((0, 3), (1000, 1100))
_POSITIONS = (5, -7, 2**40)


#: A directory of kernels numba compiled ahead (the container image's, made when it is
#: built), copied into an empty ``NUMBA_CACHE_DIR`` at start.
KERNEL_CACHE_SEED = "POSENC_KERNEL_CACHE_SEED"


def seed_kernel_cache() -> None:
    """Fills an empty ``NUMBA_CACHE_DIR`` from ``POSENC_KERNEL_CACHE_SEED``.

    Compiling the kernels takes a process many seconds of CPU; numba loads compiled ones
    from its cache in a fraction of that, but the cache must be writable, and a container's is
    an empty tmpfs at every start (its root filesystem read-only). The image carries kernels
    compiled when it was built: copied here before any process compiles, they are found
    wherever the CPU matches the one they were compiled for (elsewhere numba compiles and
    caches its own). The copy is made beside the cache and renamed into place, so that
    processes starting at once never see half of it.
    """
    seed, cache = os.environ.get(KERNEL_CACHE_SEED), os.environ.get("NUMBA_CACHE_DIR")
    if not seed or not cache or not Path(seed).is_dir():
        return
    target = Path(cache)
    if target.exists() and any(target.iterdir()):
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError:
        return  # not writable: numba compiles, as without a seed
    try:
        shutil.copytree(seed, staging, dirs_exist_ok=True)
        with contextlib.suppress(OSError):
            target.rmdir()  # empty (above), unless another process filled it meanwhile
        staging.rename(target)
    except OSError:
        pass  # another process's copy is in place
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def tables() -> list[TableKind]:
    """One small table of every kind, in each of its layouts (odd widths included: their
    last column has a path of its own)."""
    found: list[TableKind] = [
        Sinusoidal(d_model, layout=layout, schedule=schedule)
        for d_model in (8, 7)
        for layout in SINUSOIDAL_LAYOUTS
        for schedule in SCHEDULES
    ]
    found += [
        Tensor2Tensor(8),
        Whisper(8),
        Fairseq(8),
        TransformerXl(8),
        *(Rotary(8, layout=layout) for layout in LAYOUTS),
        Rotary(
            8,
            partial_rotary_factor=0.5,
            scaling=Yarn(factor=2.0, original_max_position_embeddings=64),
        ),
        *(MRope(head_dim=8, mrope_section=(2, 1, 1), layout=layout) for layout in LAYOUTS),
        SinCosGrid2d(embed_dim=8, grid_height=2, grid_width=2),
        SinCosGrid3d(embed_dim=16, grid_frames=2, grid_height=2, grid_width=2),
        RotaryAxes(axes_dim=(2, 2, 4)),
    ]
    return found


def warm_up() -> None:
    """Compile the kernels and run every table kind and layout in every dtype once."""
    engine.prepare_kernel()
    for table in tables():
        for dtype in engine.DTYPES:
            encoding = engine.Encoding.prepare(table, dtype)
            for start, stop in _RANGES:
                engine.encode_range(encoding, start, stop)
            engine.encode_positions(encoding, _POSITIONS)


def freeze() -> None:
    """Collect, then move every object alive (the modules, the compiled kernels, the warm-up's
    leftovers) to the collector's permanent generation, which its collections never walk.

    A full collection of a started server's hundred thousand objects takes tens of
    milliseconds, all of them holding the GIL: the event loop, health checks and every
    stream stall meanwhile. The collector runs one whenever enough objects have survived
    since the last, at some call no one can foresee; frozen, the start-up's objects cost
    it nothing, and it walks only what the server made since.
    """
    gc.collect()
    gc.freeze()
