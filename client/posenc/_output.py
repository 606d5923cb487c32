"""What a table method hands back: numpy rows as decoded, or shaped for the caller.

Every table method (of ``Client``, ``AsyncClient`` and ``GrowingTable``) decodes rows into a
2-D numpy array; :class:`Output` then gives them the caller's form, once for all of them:

- positions of any shape ``S`` give rows of shape ``S + [width]``;
- a ``torch.Tensor`` (on a device, in the server's dtype, bfloat16 reinterpreted bit for bit,
  never through float32) when the call asks for one: ``device=``, a torch ``dtype=``, a tensor
  ``out=``, or tensor positions;
- ``out=``: the rows are written into the caller's buffer (numpy or torch, pinned host
  memory included). A host buffer of the result's dtype is the destination the wire bytes are
  decoded into, so the call allocates no result array;
- ``cos_sin=True``: a rotary table's ``(cos, sin)`` halves (every rotary layout is ``[cos |
  sin]``, each half in the layout the spec names), as views of the rows.

torch is never imported here unless the caller passed a torch object or asked for a tensor:
``import posenc`` and the server work without it (``pip install 'posenc[torch]'``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from posenc._checks import bad_argument

__all__ = ["Output", "as_tensor", "is_tensor", "is_torch_dtype", "torch_module"]


def torch_module() -> ModuleType:
    """torch, imported on first use; ImportError naming the extra when it is missing."""
    try:
        import torch
    except ImportError as error:  # pragma: no cover - the test extras install torch
        raise ImportError("tensor results need torch: pip install 'posenc[torch]'") from error
    return torch


def _loaded_torch() -> Any:
    # A torch object can only exist once torch is imported: checking needs no import.
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (without importing torch)."""
    torch = _loaded_torch()
    return torch is not None and isinstance(value, torch.Tensor)


def is_torch_dtype(value: object) -> bool:
    """Whether ``value`` is a ``torch.dtype`` (without importing torch)."""
    torch = _loaded_torch()
    return torch is not None and isinstance(value, torch.dtype)


def torch_dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the numpy name of a torch dtype."""
    return str(dtype).removeprefix("torch.")


def as_tensor(array: npt.NDArray[Any], device: Any = None) -> Any:
    """``array`` as a tensor sharing its memory (bfloat16 through its bits), moved to
    ``device`` when one is given."""
    torch = torch_module()
    if not array.flags.writeable:
        # torch.from_numpy warns on read-only memory, and would let writes through it.
        array = array.copy()
    if array.dtype.name == "bfloat16":  # ml_dtypes' (imported only for bfloat16)
        tensor = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor if device is None else tensor.to(device)


def cos_sin_halves(rows: Any) -> tuple[Any, Any]:
    """A rotary table's rows (numpy or torch) as views of their ``(cos, sin)`` halves."""
    half = rows.shape[-1] // 2
    if is_tensor(rows):
        # narrow: a view, without the cost of torch's generic indexing (a decode step of a
        # patched model does this once per forward).
        return rows.narrow(-1, 0, half), rows.narrow(-1, half, half)
    return rows[..., :half], rows[..., half:]


def positions_of(positions: Any) -> tuple[Any, Any]:
    """Positions as numpy can read them, and the device of a tensor (None otherwise)."""
    if is_tensor(positions):
        if positions.is_floating_point() or positions.is_complex():
            raise bad_argument("positions", f"must be integers, got {positions.dtype}")
        return positions.detach().cpu().numpy(), positions.device
    return positions, None


def _host_view(out: Any, dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
    """``out`` as a writable numpy array of ``dtype`` over the same memory, when it is one:
    a contiguous host buffer (numpy, or a CPU tensor, pinned included) of that dtype."""
    if isinstance(out, np.ndarray):
        if out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
            return None
        return out
    if out.device.type != "cpu" or not out.is_contiguous():
        return None
    if torch_dtype_name(out.dtype) != dtype.name:
        return None
    torch = torch_module()
    # Through the integer of the element's size: numpy cannot read a bfloat16 tensor.
    bits = out.detach().view(getattr(torch, f"int{8 * dtype.itemsize}"))
    array: npt.NDArray[Any] = bits.numpy().view(dtype)
    return array


@dataclass(frozen=True, slots=True)
class Output:
    """How one call's rows are handed back (see the module doc).

    ``host`` is ``out`` as a 2-D numpy array the rows can be decoded into (None when the
    rows must be copied into ``out``, or there is no ``out``); its width must match the
    table's, which only the server's response tells. ``plain``: the result is the rows
    themselves as a new numpy array, shaped ``shape + [width]`` (no ``out``, tensor or
    halves), which the core hands back without a call here.
    """

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    tensor: bool = False
    device: Any = None
    out: Any = None
    host: npt.NDArray[Any] | None = None
    cos_sin: bool = False
    plain: bool = False

    @classmethod
    def create(
        cls,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        *,
        out: Any = None,
        device: Any = None,
        cos_sin: bool = False,
        positions_device: Any,
        torch_dtype: bool,
        rotary: bool,
    ) -> Output:
        """Checks the output arguments (``out``, ``device``, ``cos_sin``) of a call whose rows
        have leading ``shape``. What the call's other arguments tell has no default, so that
        every caller says it: the device its positions are on (None: not a tensor's), whether
        its ``dtype=`` was a torch dtype, and whether its table is rotary (only a rotary one
        splits into ``cos_sin`` halves)."""
        if not isinstance(cos_sin, bool):
            raise bad_argument("cos_sin", f"must be true or false, got {cos_sin!r}")
        if cos_sin and not rotary:
            raise bad_argument("cos_sin", "splits rotary tables only: the table is not rotary")
        host = None
        out_is_tensor = is_tensor(out)
        if out is not None:
            if not (out_is_tensor or isinstance(out, np.ndarray)):
                raise bad_argument(
                    "out", f"must be a numpy array or a torch.Tensor, got {type(out).__name__}"
                )
            out_dtype = torch_dtype_name(out.dtype) if out_is_tensor else out.dtype.name
            if out_dtype != dtype.name:
                raise bad_argument(
                    "out", f"is {out_dtype}, the rows are {dtype.name}: pass dtype={out_dtype!r}"
                )
            if tuple(out.shape[:-1]) != shape or len(out.shape) != len(shape) + 1:
                raise bad_argument(
                    "out", f"has shape {tuple(out.shape)}, the rows are {(*shape, 'width')}"
                )
            if device is not None:
                raise bad_argument("device", "goes without out=: the result is out, where it is")
            if isinstance(out, np.ndarray) and not out.flags.writeable:
                raise bad_argument("out", "is read-only")
            view = _host_view(out, dtype)
            if view is not None:
                host = view.reshape(math.prod(shape), out.shape[-1])
        tensor = out_is_tensor or (
            out is None and (device is not None or torch_dtype or positions_device is not None)
        )
        if tensor:
            torch_module()  # fail now, not after the call, when torch is missing
        if device is None and out is None:
            device = positions_device
        plain = out is None and not tensor and not cos_sin
        return cls(shape, dtype, tensor, device, out, host, cos_sin, plain)

    def finish(self, rows: npt.NDArray[Any]) -> Any:
        """The call's result from its decoded ``rows`` (2-D)."""
        width = rows.shape[1]
        if self.out is not None:
            if self.out.shape[-1] != width:
                raise bad_argument(
                    "out", f"has shape {tuple(self.out.shape)}, the rows are {(*self.shape, width)}"
                )
            if self.host is None and isinstance(self.out, np.ndarray):  # not contiguous
                np.copyto(self.out, rows.reshape(self.out.shape))
            elif self.host is None:  # another device, a strided tensor
                self.out.copy_(as_tensor(rows).view(self.out.shape))
            elif rows is not self.host:  # not decoded in place (e.g. from the row cache)
                np.copyto(self.host, rows)
            result = self.out
        else:
            # A 1-D selection keeps the array itself (it owns its memory); others are views.
            result = rows if len(self.shape) == 1 else rows.reshape(*self.shape, width)
            if self.tensor:
                result = as_tensor(result, self.device)
        return cos_sin_halves(result) if self.cos_sin else result

    def slice(self, rows: npt.NDArray[Any]) -> Any:
        """A streamed slice of rows: a tensor when the call asked for tensors."""
        return as_tensor(rows, self.device) if self.tensor else rows
