"""A growing client-side table: one spec's rows from position 0, fetched once, served from memory.

This is how inference engines hold their positional tables (vLLM's ``cos_sin_cache``, TGI's
rotary caches): a prefill or a decode step reads rows from memory, and only a request that
reaches past the end of the table makes a call, which extends it by a range fetch::

    table = posenc.GrowingTable(client, spec, dtype="bfloat16")
    rows = table.get(position_ids)                 # [batch, seq] -> [batch, seq, width]
    cos, sin = table.get(position_ids_t, cos_sin=True)  # tensors on position_ids_t's device

The table grows geometrically (each extension at least doubles it, up to a step of
``max_step_bytes``), so a sequence growing one row at a time makes O(log n) calls. It never
holds more than ``max_bytes``; positions beyond that, negative ones, and a few positions far
past the end (a sparse request, where growing would fetch mostly unused rows) are fetched
for the call with :meth:`posenc.Client.get_positions` and not kept.

Results take the forms of :meth:`posenc.Client.get_positions` (numpy, or torch tensors with
the ``[torch]`` extra; ``out=`` buffers; ``(cos, sin)`` pairs), through the same code.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from posenc._output import Output, is_torch_dtype, positions_of
from posenc._query import as_positions, numpy_dtype
from posenc.errors import ResourceExhaustedError
from posenc.spec import Spec
from posenc.types import DEFAULT, DTypeArg, Table, Timeout

if TYPE_CHECKING:
    from posenc._client import Client

__all__ = ["GrowingTable"]

#: Default memory cap of one table.
DEFAULT_MAX_BYTES: Final = 1 << 30
#: Default largest single extension: bounds the latency of the step that triggers it.
DEFAULT_MAX_STEP_BYTES: Final = 64 << 20
#: Default smallest table: one call holds the rows of most prompts.
DEFAULT_MIN_ROWS: Final = 4096
# Extensions larger than this are streamed into the new buffer slice by slice instead of
# fetched as one array and copied: one copy of the rows, O(chunk) transient memory.
_STREAM_BYTES: Final = 4 << 20
# A request this many times sparser than the rows it would add is fetched, not grown into.
_SPARSE: Final = 4


class GrowingTable:
    """The rows ``[0, len(self))`` of one table, held in memory and extended on demand.

    Args:
        client: The :class:`posenc.Client` rows are fetched with.
        table: The table (a :class:`posenc.Spec`, or the classic table's ``d_model``).
        dtype: The element type of the rows: a name, a numpy dtype, or a torch dtype
            (which makes every result a ``torch.Tensor``, as it does a client's).
        min_rows: The size of the first fetch, when a request needs fewer rows.
        max_bytes: The most memory the table holds; rows past it are fetched per call.
        max_step_bytes: The largest extension beyond what a request needs.
        timeout: Deadline of each fetch (``DEFAULT``: the client's).

    Thread-safe: concurrent readers see a consistent table; growth happens under a lock,
    and rows already returned are never modified (a grown table is a new buffer).
    """

    def __init__(
        self,
        client: Client,
        table: Table,
        *,
        dtype: DTypeArg = "float32",
        min_rows: int = DEFAULT_MIN_ROWS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_step_bytes: int = DEFAULT_MAX_STEP_BYTES,
        timeout: Timeout = DEFAULT,
    ) -> None:
        if min_rows < 1 or max_bytes < 1 or max_step_bytes < 1:
            raise ValueError("min_rows, max_bytes and max_step_bytes must be positive")
        self._client = client
        self._table = table
        self._dtype = numpy_dtype(dtype)
        self._torch_dtype = is_torch_dtype(dtype)  # results are tensors, as for a client
        self._min_rows = min_rows
        self._max_bytes = max_bytes
        self._max_step_bytes = max_step_bytes
        self._timeout = timeout
        self._lock = threading.Lock()
        self._rows: npt.NDArray[Any] | None = None  # the held rows, [len, width]
        self._fetches = 0

    # -- what it holds ------------------------------------------------------------------------

    @property
    def table(self) -> Table:
        """The table this holds rows of."""
        return self._table

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the rows (``ml_dtypes.bfloat16`` for bfloat16)."""
        return self._dtype

    @property
    def width(self) -> int | None:
        """Columns of a row; ``None`` until the first fetch (the server knows widths)."""
        rows = self._rows
        return None if rows is None else int(rows.shape[1])

    @property
    def fetches(self) -> int:
        """How many calls the table has made (extensions and per-call fetches)."""
        return self._fetches

    def __len__(self) -> int:
        rows = self._rows
        return 0 if rows is None else int(rows.shape[0])

    def __repr__(self) -> str:
        return f"GrowingTable({self._table!r}, dtype={self._dtype.name}, rows={len(self)})"

    def rows(self, stop: int | None = None) -> npt.NDArray[Any]:
        """The held rows ``[0, stop)`` (default: all), as a read-only view; grows to ``stop``."""
        if stop is not None:
            self.reserve(stop)
        rows = self._rows
        if rows is None:
            return np.empty((0, 0), dtype=self._dtype)
        view = rows[: len(rows) if stop is None else stop]
        view.flags.writeable = False
        return view

    # -- growth ---------------------------------------------------------------------------------

    def _max_rows(self, width: int) -> int:
        return max(self._max_bytes // (width * self._dtype.itemsize), 1)

    def reserve(self, stop: int) -> None:
        """Holds at least rows ``[0, stop)``, extending the table if needed.

        Raises:
            posenc.ResourceExhaustedError: ``stop`` rows exceed ``max_bytes``.
        """
        if stop <= len(self):
            return
        with self._lock:
            held = len(self)
            if stop <= held:
                return  # another thread grew it meanwhile
            width = self.width
            if width is not None and stop > self._max_rows(width):
                raise ResourceExhaustedError(
                    f"{stop} rows of {width} {self._dtype.name} exceed the table's "
                    f"max_bytes ({self._max_bytes})"
                )
            if width is None:
                self._first_fetch(max(stop, self._min_rows))
            else:
                step_rows = max(self._max_step_bytes // (width * self._dtype.itemsize), 1)
                target = max(stop, held + min(max(held, self._min_rows), step_rows))
                self._extend(min(target, self._max_rows(width)))

    def _first_fetch(self, stop: int) -> None:
        rows = self._client.get_range(
            0, stop, self._table, dtype=self._dtype, timeout=self._timeout
        )
        self._fetches += 1
        width = int(rows.shape[1])
        if stop > self._max_rows(width):
            # The width was unknown until now: keep what the budget allows.
            rows = np.ascontiguousarray(rows[: self._max_rows(width)])
        self._rows = rows

    def _extend(self, stop: int) -> None:
        old = self._rows
        assert old is not None
        held, width = old.shape
        grown = np.empty((stop, width), dtype=self._dtype)
        grown[:held] = old
        if (stop - held) * width * self._dtype.itemsize <= _STREAM_BYTES:
            grown[held:] = self._client.get_range(
                held, stop, self._table, dtype=self._dtype, timeout=self._timeout
            )
        else:
            for first, block in self._client.iter_range(
                held, stop, self._table, dtype=self._dtype, timeout=self._timeout
            ):
                grown[first : first + len(block)] = block
        self._fetches += 1
        self._rows = grown  # one reference swap: readers see the old or the new table

    def _grow_for(self, positions: npt.NDArray[np.int64]) -> None:
        """Extends the table over the positions of a request past its end that are near the
        end (within the next extension) or dense enough to fill what they add; the others
        (sparse, far) are fetched for the call."""
        held = len(self)
        past = np.unique(positions[positions >= held])
        if past.size == 0:
            return
        if self.width is not None:
            past = past[past < self._max_rows(self.width)]
        # The i-th position past the end is worth growing to if the rows it adds are at
        # most _SPARSE times the positions of the request they cover.
        covered = _SPARSE * np.arange(1, past.size + 1)
        worth = past + 1 - held <= np.maximum(covered, max(held, self._min_rows))
        if worth.any():
            self.reserve(int(past[np.flatnonzero(worth)[-1]]) + 1)

    # -- reading ------------------------------------------------------------------------------

    def get(
        self,
        positions: npt.ArrayLike,
        *,
        out: Any = None,
        device: Any = None,
        cos_sin: bool = False,
    ) -> Any:
        """The rows of ``positions``, of any shape ``S``: ``S + [width]``.

        Rows the table holds come from memory (it grows first when the request reaches
        past its end; see the module doc). The result takes the same forms as
        :meth:`posenc.Client.get_positions`: ``positions`` may be a ``torch.Tensor`` (the
        result is then a tensor on its device), ``device=`` asks for a tensor, ``out=``
        fills a caller's buffer (numpy or torch) without allocating, and ``cos_sin=True``
        gives a rotary table's ``(cos, sin)`` halves.
        """
        array, positions_device = positions_of(positions)
        flat = as_positions(array)
        output = Output.create(
            np.shape(array),
            self._dtype,
            out=out,
            device=device,
            cos_sin=cos_sin,
            positions_device=positions_device,
            torch_dtype=self._torch_dtype,
            rotary=isinstance(self._table, Spec) and self._table.kind == "rotary",
        )
        return output.finish(self._gather(flat, output.host))

    def _gather(self, flat: npt.NDArray[np.int64], host: npt.NDArray[Any] | None) -> Any:
        if flat.size == 0:
            if self.width is None:  # the width is the server's: one row tells it
                self.reserve(1)
            assert self.width is not None
            return np.empty((0, self.width), dtype=self._dtype)
        low, top = int(flat.min()), int(flat.max())
        if top >= len(self):
            self._grow_for(flat)
        rows = self._rows
        held = 0 if rows is None else len(rows)
        if rows is None or low < 0 or top >= held:
            return self._mixed(flat, held)
        fits = host is not None and host.shape == (len(flat), rows.shape[1])
        if top - low == len(flat) - 1 and (len(flat) == 1 or (np.diff(flat) == 1).all()):
            # A run of consecutive positions (a prefill): one block copy, several times
            # faster than a gather.
            block = rows[low : top + 1]
            if fits:
                assert host is not None
                np.copyto(host, block)
                return host
            return block.copy()
        if fits:
            # Straight into the caller's buffer: a decode loop allocates nothing.
            return np.take(rows, flat, axis=0, out=host)
        return rows[flat]

    def _mixed(self, flat: npt.NDArray[np.int64], held: int) -> npt.NDArray[Any]:
        """Rows of positions some of which the table does not hold: those are fetched, once
        each, for this call."""
        outside = (flat < 0) | (flat >= held)
        wanted, inverse = np.unique(flat[outside], return_inverse=True)
        fetched = self._client.get_positions(
            wanted, self._table, dtype=self._dtype, timeout=self._timeout
        )
        self._fetches += 1
        result = np.empty((len(flat), fetched.shape[1]), dtype=self._dtype)
        result[outside] = fetched[inverse]
        if held:
            assert self._rows is not None
            result[~outside] = self._rows[flat[~outside]]
        return result
