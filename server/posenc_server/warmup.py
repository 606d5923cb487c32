"""What a server process runs before it listens and reports SERVING: every path a call can
take through the engine, once, on tiny tables, so that no caller waits for an import or a
compilation.

The kernels are compiled (or loaded from numba's on-disk cache) for every array type they
are given (``engine.prepare_kernel``); then a table of every kind and layout is encoded in
every dtype, as a range, a range longer than a block's few rows and a list of positions, so
that what each dtype imports (ml_dtypes' bfloat16, most of a second) and what each kind
first runs is done here. A fresh server's first bfloat16 call paid for both before.
"""

from __future__ import annotations

from posenc_server import engine
from posenc_server.tables.axes import RotaryAxes
from posenc_server.tables.base import TableKind
from posenc_server.tables.multiaxis import MRope, SinCosGrid2d, SinCosGrid3d
from posenc_server.tables.rotary import LAYOUTS, Rotary, Yarn
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
