"""What an encoding request asks for, in domain terms (``convert`` builds these from protobuf)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from posenc_server.errors import FieldViolation
from posenc_server.tables import TableKind


@dataclass(frozen=True)
class PositionRange:
    """Positions ``start .. stop - 1``."""

    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Number of rows selected."""
        return self.stop - self.start


@dataclass(frozen=True, eq=False)
class PositionList:
    """Explicit positions, in the order the rows are wanted."""

    positions: npt.NDArray[np.int64]

    @property
    def rows(self) -> int:
        """Number of rows selected."""
        return int(self.positions.size)


@dataclass(frozen=True, eq=False)
class CoordinateList:
    """Explicit coordinates of a table with several position axes (``[rows, axes]``), in
    the order the rows are wanted."""

    coordinates: npt.NDArray[np.int64]

    @property
    def rows(self) -> int:
        """Number of rows selected."""
        return int(self.coordinates.shape[0])


Selection = PositionRange | PositionList | CoordinateList


@dataclass(frozen=True, eq=False)
class Query:
    """A converted GetEncoding or StreamEncoding request whose spec is not resolved yet.

    ``spec_key`` is the serialized spec (the spec table's key); ``table`` is None and
    ``violations`` says why when the spec could not be converted. ``violations`` also holds
    the selection's problems.
    """

    spec_key: bytes
    table: TableKind | None
    dtype: str
    dtype_code: int
    """The ``posenc.v1.Dtype`` number responses carry."""
    selection: Selection | None
    max_chunk_bytes: int
    """0: the server's maximum (unary calls have no chunks)."""
    violations: list[FieldViolation]
    shared_session: bytes = b""
    """A GetEncoding request's region-socket session (``posenc_server.shm``), or empty."""
