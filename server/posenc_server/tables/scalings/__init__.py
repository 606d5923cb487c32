"""The rotary scalings, one module each: a case of ``RotaryTable.scaling`` is a ``Scaling`` in
a module of its own here, registered in ``SCALINGS`` by its field name."""

from __future__ import annotations

from posenc_server.tables.scalings.base import Frequencies, Scaling
from posenc_server.tables.scalings.dynamic import Dynamic
from posenc_server.tables.scalings.frequencies import GivenFrequencies
from posenc_server.tables.scalings.linear import Linear
from posenc_server.tables.scalings.llama3 import Llama3
from posenc_server.tables.scalings.longrope import LongRope
from posenc_server.tables.scalings.proportional import Proportional
from posenc_server.tables.scalings.yarn import Yarn

__all__ = [
    "SCALINGS",
    "Dynamic",
    "Frequencies",
    "GivenFrequencies",
    "Linear",
    "Llama3",
    "LongRope",
    "Proportional",
    "Scaling",
    "Yarn",
]

SCALINGS: dict[str, type[Scaling]] = {
    scaling.NAME: scaling
    for scaling in (Linear, Dynamic, Yarn, LongRope, Llama3, GivenFrequencies, Proportional)
}
"""The cases of ``RotaryTable.scaling`` by field name."""
