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

A rotary table in transformers' layout, whose rows repeat each half (``[c, c | s, s]``), is
fetched and held as vLLM's rows (``[c | s]``): half the bytes for the server to compute and
send, and for the table to hold; reads repeat the halves, in the pass that copies the rows
out, so a prefill costs what it did. A table made with ``views=True`` holds rows as they are
read, so that a read of consecutive held rows can be a view of them, without a copy.

:class:`AsyncGrowingTable` is the same table over a :class:`posenc.AsyncClient`: both run
one plan (``_Plan``), whose reads are steps of the client's own calls (``posenc._core``),
driven by the client as its table methods are.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Generic, TypedDict, TypeVar, Unpack

import numpy as np
import numpy.typing as npt

from posenc._core import Core, Steps
from posenc._memory import new_array
from posenc._output import (
    Output,
    as_tensor,
    cos_sin_halves,
    is_tensor,
    is_torch_dtype,
    positions_of,
    torch_module,
)
from posenc._query import as_positions, distinct, numpy_dtype
from posenc.errors import ResourceExhaustedError
from posenc.spec import Spec
from posenc.types import DEFAULT, DTypeArg, Table, Timeout

if TYPE_CHECKING:
    from posenc._async_client import AsyncClient
    from posenc._client import Client

__all__ = ["AsyncGrowingTable", "GrowingTable"]

#: Default memory cap of one table.
DEFAULT_MAX_BYTES: Final = 1 << 30
#: Default largest single extension: bounds the latency of the step that triggers it.
DEFAULT_MAX_STEP_BYTES: Final = 64 << 20
#: Default smallest table: one call holds the rows of most prompts.
DEFAULT_MIN_ROWS: Final = 4096
# A request this many times sparser than the rows it would add is fetched, not grown into.
_SPARSE: Final = 4
# Up to this many positions a call, tensors of held rows are gathered by torch
# (``_Plan.held_tensors``); larger ones (prefills) in one numpy pass into the result.
_TORCH_GATHER_MAX: Final = 4096


T = TypeVar("T")


class _Plan:
    """The growing table without its calls: its rows, its growth policy and its reads.

    Methods that may need rows from the server return the steps of ``core``'s calls
    (:mod:`posenc._core`), which the table's client drives, so that the blocking and the
    asyncio table share every decision. A read that grows the table (``grows`` says so
    beforehand) runs under the table's lock, and decides again there: another caller may have
    grown the table meanwhile.
    """

    def __init__(
        self,
        core: Core,
        timeout: Timeout,
        table: Table,
        dtype: DTypeArg,
        min_rows: int,
        max_bytes: int,
        max_step_bytes: int,
        views: bool,
    ) -> None:
        if min_rows < 1 or max_bytes < 1 or max_step_bytes < 1:
            raise ValueError("min_rows, max_bytes and max_step_bytes must be positive")
        self.core = core
        self.timeout = timeout
        self.table = table
        self.rotary = isinstance(table, Spec) and table.kind == "rotary"
        # A rotary table in transformers' layout repeats each half of a row ([c, c | s, s]):
        # it is fetched and held in vLLM's layout ([c | s]), half the bytes to compute,
        # send and keep, and its halves are repeated as rows are read (``_expand``); unless
        # reads may be views, which must be of rows in the layout asked for.
        self.views = views
        self.fetch_table: Table = table
        self.repeat = (
            self.rotary
            and not views
            and isinstance(table, Spec)  # (for the type checker: rotary tables are specs)
            and table.parameters.get("layout", "transformers") == "transformers"
        )
        if isinstance(table, Spec) and self.repeat:
            self.fetch_table = Spec("rotary", **{**table.parameters, "layout": "vllm"})
        self.dtype = numpy_dtype(dtype)
        self.torch_dtype = is_torch_dtype(dtype)  # results are tensors, as for a client
        self.min_rows = min_rows
        self.max_bytes = max_bytes
        self.max_step_bytes = max_step_bytes
        self.rows: npt.NDArray[Any] | None = None  # the held rows, [len, width]
        self._tensor: tuple[npt.NDArray[Any], Any] | None = None  # (rows, a tensor of them)
        self.fetches = 0

    @property
    def held(self) -> int:
        rows = self.rows
        return 0 if rows is None else int(rows.shape[0])

    @property
    def held_width(self) -> int | None:
        """The held rows' width (what memory holds), once a fetch told it."""
        rows = self.rows
        return None if rows is None else int(rows.shape[1])

    @property
    def width(self) -> int | None:
        """The table's width (the held rows' width, twice it when halves are repeated)."""
        held = self.held_width
        return None if held is None else held * (2 if self.repeat else 1)

    def view(self, stop: int | None) -> npt.NDArray[Any]:
        rows = self.rows
        if rows is None:
            return np.empty((0, 0), dtype=self.dtype)
        view = rows[: len(rows) if stop is None else stop]
        if self.repeat:
            view = self._expand(view, None)
        view.flags.writeable = False
        return view

    def _expand(self, rows: npt.NDArray[Any], host: npt.NDArray[Any] | None) -> npt.NDArray[Any]:
        """Held rows in the table's layout: each half repeated when ``repeat`` (into
        ``host`` when it has the result's shape), in one pass."""
        if not self.repeat:
            return rows
        count, held = rows.shape
        out = self._result((count, 2 * held), host)
        half = held // 2
        np.copyto(out.reshape(count, 2, 2, half), rows.reshape(count, 2, 1, half))
        return out

    def _result(self, shape: tuple[int, ...], host: npt.NDArray[Any] | None) -> npt.NDArray[Any]:
        """Where a read's rows go: the caller's buffer when it has their shape, else a new
        array (in a dropped result's memory when large: ``posenc._memory``)."""
        return host if host is not None and host.shape == shape else new_array(shape, self.dtype)

    def _max_rows(self, width: int) -> int:
        # ``width``: of the held rows, which are what memory holds.
        return max(self.max_bytes // (width * self.dtype.itemsize), 1)

    # -- calls ----------------------------------------------------------------------------------

    def _range(self, start: int, stop: int, out: npt.NDArray[Any] | None = None) -> Steps[Any]:
        """Rows ``[start, stop)`` of the held table (into ``out`` when given), as
        ``get_range`` fetches them."""
        return (
            yield from self.core.get_range(
                start, stop, self.fetch_table, self.dtype, {}, self.timeout, out=out
            )
        )

    def _positions(self, positions: npt.NDArray[np.int64]) -> Steps[Any]:
        """The rows of ``positions``, as ``get_positions`` fetches them."""
        return (
            yield from self.core.get_positions(
                positions, self.fetch_table, self.dtype, {}, -1, self.timeout
            )
        )

    # -- growth ---------------------------------------------------------------------------------

    def grows(
        self, stop: int | None = None, positions: npt.NDArray[np.int64] | None = None
    ) -> bool:
        """Whether ``reserve(stop)``, or ``gather(positions)``, extends the table."""
        if positions is not None:
            if positions.size == 0:
                return self.width is None
            stop = self._growth_stop(positions)
        return stop is not None and stop > self.held

    def reserve(self, stop: int) -> Steps[None]:
        """Hold at least rows ``[0, stop)``; ResourceExhaustedError past ``max_bytes``."""
        held, width = self.held, self.held_width
        if stop <= held:
            return
        if width is None:
            stop = max(stop, self.min_rows)
            rows = yield from self._range(0, stop)
            width = int(rows.shape[1])
            if stop > self._max_rows(width):
                # The width was unknown until now: keep what the budget allows.
                rows = np.ascontiguousarray(rows[: self._max_rows(width)])
        else:
            if stop > self._max_rows(width):
                raise ResourceExhaustedError(
                    f"{stop} rows of {width} {self.dtype.name} exceed the table's "
                    f"max_bytes ({self.max_bytes})"
                )
            step_rows = max(self.max_step_bytes // (width * self.dtype.itemsize), 1)
            target = max(stop, held + min(max(held, self.min_rows), step_rows))
            rows = np.empty((min(target, self._max_rows(width)), width), dtype=self.dtype)
            assert self.rows is not None
            rows[:held] = self.rows
            # Straight into the new buffer (streamed when large): one copy, O(chunk) extra.
            yield from self._range(held, len(rows), rows[held:])
        self.fetches += 1
        self.rows = rows  # one reference swap: readers see the old or the new table
        self._tensor = None  # (its tensor of the old rows would keep them alive)

    def _growth_stop(self, positions: npt.NDArray[np.int64]) -> int | None:
        """Where the table grows to for the positions of a request past its end that are
        near the end (within the next extension) or dense enough to fill what they add; the
        others (sparse, far) are fetched for the call. None: it does not grow."""
        held = self.held
        past = distinct(positions[positions >= held])
        if (width := self.held_width) is not None:
            past = past[past < self._max_rows(width)]
        if past.size == 0:
            return None
        # The i-th position past the end is worth growing to if the rows it adds are at
        # most _SPARSE times the positions of the request they cover.
        covered = _SPARSE * np.arange(1, past.size + 1)
        worth = past + 1 - held <= np.maximum(covered, max(held, self.min_rows))
        return int(past[np.flatnonzero(worth)[-1]]) + 1 if worth.any() else None

    # -- reading --------------------------------------------------------------------------------

    def held_view(self, positions: Any, out: Any, device: Any, cos_sin: bool) -> Any:
        """With ``views``: the rows of a run of consecutive held positions (a prefill) as a
        view of the held rows, in the form ``get`` gives (numpy, read-only, or a CPU tensor;
        ``(cos, sin)`` views of its halves); None where a copy is needed (views off, rows
        not held, positions that are not one run, ``out=``, another device, ``cos_sin`` of a
        table that is not rotary). Held rows are never written, so a view stays valid."""
        rows = self.rows
        if not self.views or rows is None or out is not None or (cos_sin and not self.rotary):
            return None
        tensor = is_tensor(positions) or self.torch_dtype or device is not None
        if tensor and (
            (is_tensor(positions) and positions.device.type != "cpu")
            or (device is not None and torch_module().device(device).type != "cpu")
        ):
            return None
        array, _ = positions_of(positions)
        shape = np.shape(array)
        flat = as_positions(array)
        if flat.size == 0:
            return None
        low, top = int(flat[0]), int(flat[-1])
        if not 0 <= low <= top < len(rows) or top - low != flat.size - 1:
            return None
        if flat.size > 1 and not (np.diff(flat) == 1).all():
            return None
        if tensor:
            result = self._held_tensor(rows)[low : top + 1].view(*shape, -1)
        else:
            result = rows[low : top + 1].reshape(*shape, -1)
            result.flags.writeable = False
        return cos_sin_halves(result) if cos_sin else result

    def _held_tensor(self, rows: npt.NDArray[Any]) -> Any:
        """The held rows as a tensor (the same memory), made once per buffer."""
        held = self._tensor
        if held is None or held[0] is not rows:
            held = self._tensor = (rows, as_tensor(rows))
        return held[1]

    def held_tensors(self, positions: Any, out: Any, device: Any, cos_sin: bool) -> Any:
        """A decode step's rows by torch's own indexing of the held rows, or None where the
        general path (``output``, ``gather``) is needed: positions that are not a small CPU
        integer tensor, rows not held, a buffer, another device, ``cos_sin`` of a table
        that is not rotary.

        A patched model's rotary forward asks for a few rows per decode step inside
        ``generate``: the general path's Python (some sixty calls, cold in the CPU's caches
        between the model's layers) cost the step more than the rows do. The same values,
        shape and dtype, and ``(cos, sin)`` the same halves.
        """
        rows = self.rows
        if rows is None or out is not None or not is_tensor(positions):
            return None
        torch = torch_module()
        if (
            positions.device.type != "cpu"
            or (device is not None and torch.device(device).type != "cpu")
            or positions.dtype not in (torch.int64, torch.int32)
            or not 0 < positions.numel() <= _TORCH_GATHER_MAX
            or (cos_sin and not self.rotary)
        ):
            return None
        flat = positions.reshape(-1)
        low, high = torch.aminmax(flat)
        if int(low) < 0 or int(high) >= len(rows):
            return None
        picked = self._held_tensor(rows).index_select(0, flat)
        if self.repeat:  # [c | s] held: [c, c | s, s] read
            cos, sin = picked.chunk(2, 1)
            picked = torch.cat((cos, cos, sin, sin), 1)
        rows = picked.view(*positions.shape, -1)
        return cos_sin_halves(rows) if cos_sin else rows

    def output(self, positions: npt.ArrayLike, out: Any, device: Any, cos_sin: bool) -> Any:
        """The result's form (see ``get``) and the flat positions it holds rows of."""
        array, positions_device = positions_of(positions)
        output = Output.create(
            np.shape(array),
            self.dtype,
            out=out,
            device=device,
            cos_sin=cos_sin,
            positions_device=positions_device,
            torch_dtype=self.torch_dtype,
            rotary=self.rotary,
        )
        return output, as_positions(array)

    def gather(
        self, flat: npt.NDArray[np.int64], host: npt.NDArray[Any] | None, grow: bool
    ) -> Steps[Any]:
        """The rows of ``flat``: from memory, growing first if the request reaches past the
        end (``grow``: under the table's lock), and fetched for the call where the table
        does not hold them."""
        if flat.size == 0:
            if self.width is None:  # the width is the server's: one row tells it
                yield from self.reserve(1)
            assert self.width is not None
            return np.empty((0, self.width), dtype=self.dtype)
        low, top = int(flat.min()), int(flat.max())
        if grow and top >= self.held and (stop := self._growth_stop(flat)) is not None:
            yield from self.reserve(stop)
        rows = self.rows
        held = 0 if rows is None else len(rows)
        if rows is None or low < 0 or top >= held:
            return self._expand((yield from self._mixed(flat, rows)), host)
        if top - low == len(flat) - 1 and (len(flat) == 1 or (np.diff(flat) == 1).all()):
            # A run of consecutive positions (a prefill): one block copy, several times
            # faster than a gather.
            block = rows[low : top + 1]
            if self.repeat:
                return self._expand(block, host)
            out = self._result(block.shape, host)
            np.copyto(out, block)
            return out
        if self.repeat:
            return self._expand(rows[flat], host)
        # Straight into the caller's buffer (a decode loop allocates nothing) or a new one.
        return np.take(rows, flat, axis=0, out=self._result((len(flat), rows.shape[1]), host))

    def _mixed(
        self, flat: npt.NDArray[np.int64], rows: npt.NDArray[Any] | None
    ) -> Steps[npt.NDArray[Any]]:
        """Rows of positions some of which the table does not hold: those are fetched, once
        each, for this call."""
        held = 0 if rows is None else len(rows)
        outside = (flat < 0) | (flat >= held)
        wanted, inverse = np.unique(flat[outside], return_inverse=True)
        fetched = yield from self._positions(wanted)
        self.fetches += 1
        result = np.empty((len(flat), fetched.shape[1]), dtype=self.dtype)
        result[outside] = fetched[inverse]
        if rows is not None:
            result[~outside] = rows[flat[~outside]]
        return result


ClientT = TypeVar("ClientT", "Client", "AsyncClient")


class TableOptions(TypedDict, total=False):
    """The keyword arguments of both tables (see :class:`GrowingTable`)."""

    dtype: DTypeArg
    min_rows: int
    max_bytes: int
    max_step_bytes: int
    timeout: Timeout
    views: bool


class _TableBase(Generic[ClientT]):
    """What both tables share: construction and the read-only accessors (arguments as
    described in :class:`GrowingTable`)."""

    def __init__(self, client: ClientT, table: Table, **options: Unpack[TableOptions]) -> None:
        unknown = sorted(options.keys() - TableOptions.__annotations__.keys())
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {unknown}")
        self._client: ClientT = client
        self._plan = _Plan(
            client._core,
            options.get("timeout", DEFAULT),
            table,
            options.get("dtype", "float32"),
            options.get("min_rows", DEFAULT_MIN_ROWS),
            options.get("max_bytes", DEFAULT_MAX_BYTES),
            options.get("max_step_bytes", DEFAULT_MAX_STEP_BYTES),
            options.get("views", False),
        )

    @property
    def table(self) -> Table:
        """The table this holds rows of."""
        return self._plan.table

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the rows (``ml_dtypes.bfloat16`` for bfloat16)."""
        return self._plan.dtype

    @property
    def width(self) -> int | None:
        """Columns of a row; ``None`` until the first fetch (the server knows widths)."""
        return self._plan.width

    @property
    def fetches(self) -> int:
        """How many calls the table has made (extensions and per-call fetches)."""
        return self._plan.fetches

    def __len__(self) -> int:
        return self._plan.held

    def _held(self, positions: npt.ArrayLike, out: Any, device: Any, cos_sin: bool) -> Any:
        """The rows of ``positions`` from memory, or None when the table must fetch."""
        held = self._plan.held_view(positions, out, device, cos_sin)
        return (
            held if held is not None else self._plan.held_tensors(positions, out, device, cos_sin)
        )

    def _gather(
        self, positions: npt.ArrayLike, out: Any, device: Any, cos_sin: bool
    ) -> tuple[Any, Callable[[], Steps[Any]], bool]:
        """The output of a fetch for ``positions``, the steps filling it and whether they
        grow the table."""
        output, flat = self._plan.output(positions, out, device, cos_sin)
        grows = self._plan.grows(positions=flat)
        return output, partial(self._plan.gather, flat, output.host, grows), grows

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.table!r}, dtype={self.dtype.name}, rows={len(self)})"


class GrowingTable(_TableBase["Client"]):
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
        views: Let :meth:`get` return a view of the held rows instead of a copy when it
            can: for positions that are one run of consecutive held positions (a
            prefill's ``position_ids``), without ``out=``, on the CPU. A numpy view is
            read-only; a tensor view must not be written to. The table then holds a
            rotary table in transformers' layout as it is read, not as its halves (twice
            the memory: see the module doc).

    Thread-safe: concurrent readers see a consistent table; growth happens under a lock,
    and rows already returned are never modified (a grown table is a new buffer).
    """

    def __init__(self, client: Client, table: Table, **options: Unpack[TableOptions]) -> None:
        super().__init__(client, table, **options)
        self._lock = threading.Lock()

    def rows(self, stop: int | None = None) -> npt.NDArray[Any]:
        """The held rows ``[0, stop)`` (default: all), read-only (a view, or a copy for a
        rotary table in transformers' layout: see the module doc); grows to ``stop``."""
        if stop is not None:
            self.reserve(stop)
        return self._plan.view(stop)

    def reserve(self, stop: int) -> None:
        """Holds at least rows ``[0, stop)``, extending the table if needed.

        Raises:
            posenc.ResourceExhaustedError: ``stop`` rows exceed ``max_bytes``.
        """
        self._run(lambda: self._plan.reserve(stop), self._plan.grows(stop))

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
        gives a rotary table's ``(cos, sin)`` halves. A table made with ``views=True``
        returns a view of its rows where it can (see the class doc), else a copy.
        """
        held = self._held(positions, out, device, cos_sin)
        if held is not None:
            return held
        output, steps, grows = self._gather(positions, out, device, cos_sin)
        return output.finish(self._run(steps, grows))

    def _run(self, plan: Callable[[], Steps[T]], grows: bool) -> T:
        if not grows:
            return self._client._run(plan())  # type: ignore[no-any-return]
        with self._lock:  # the plan decides again here: the table may have grown meanwhile
            return self._client._run(plan())  # type: ignore[no-any-return]


class AsyncGrowingTable(_TableBase["AsyncClient"]):
    """:class:`GrowingTable` over a :class:`posenc.AsyncClient`: ``get``, ``reserve`` and
    ``rows`` are coroutines, and growth is serialised by an ``asyncio.Lock``. Arguments and
    results as there::

        table = posenc.AsyncGrowingTable(client, spec, dtype="bfloat16")
        cos, sin = await table.get(position_ids, cos_sin=True)
    """

    def __init__(self, client: AsyncClient, table: Table, **options: Unpack[TableOptions]) -> None:
        super().__init__(client, table, **options)
        self._lock = asyncio.Lock()

    async def rows(self, stop: int | None = None) -> npt.NDArray[Any]:
        """The held rows ``[0, stop)`` (see :meth:`GrowingTable.rows`); grows to ``stop``."""
        if stop is not None:
            await self.reserve(stop)
        return self._plan.view(stop)

    async def reserve(self, stop: int) -> None:
        """Holds at least rows ``[0, stop)`` (see :meth:`GrowingTable.reserve`)."""
        await self._run(lambda: self._plan.reserve(stop), self._plan.grows(stop))

    async def get(
        self,
        positions: npt.ArrayLike,
        *,
        out: Any = None,
        device: Any = None,
        cos_sin: bool = False,
    ) -> Any:
        """The rows of ``positions`` (see :meth:`GrowingTable.get`)."""
        held = self._held(positions, out, device, cos_sin)
        if held is not None:
            return held
        output, steps, grows = self._gather(positions, out, device, cos_sin)
        return output.finish(await self._run(steps, grows))

    async def _run(self, plan: Callable[[], Steps[T]], grows: bool) -> T:
        if not grows:
            return await self._client._run(plan())  # type: ignore[no-any-return]
        async with self._lock:  # the plan decides again here: the table may have grown
            return await self._client._run(plan())  # type: ignore[no-any-return]
