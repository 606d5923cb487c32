"""Table kinds: each one frozen, hashable object that says its frequencies, its column layout,
its position map and its width, and validates its own parameters (``base.TableKind``).

``KINDS`` maps each field of ``posenc.v1.EncodingSpec.table`` to its kind.
"""

from __future__ import annotations

from posenc_server.tables.axes import RotaryAxes
from posenc_server.tables.base import Doc, Documented, Limits, TableKind
from posenc_server.tables.multiaxis import MRope, SinCosGrid2d, SinCosGrid3d
from posenc_server.tables.rotary import Rotary
from posenc_server.tables.sinusoidal import (
    Fairseq,
    Sinusoidal,
    Tensor2Tensor,
    TransformerXl,
    Whisper,
)

KINDS: dict[str, type[TableKind]] = {
    kind.NAME: kind
    for kind in (
        Sinusoidal,
        Tensor2Tensor,
        Whisper,
        Fairseq,
        TransformerXl,
        Rotary,
        MRope,
        SinCosGrid2d,
        SinCosGrid3d,
        RotaryAxes,
    )
}
"""The table kinds by ``EncodingSpec.table`` field name."""

__all__ = ["KINDS", "Doc", "Documented", "Limits", "TableKind"]
