"""How ``fetch`` writes a table: a .npy or .safetensors header, then the rows into a file
beside the output that becomes it only when complete."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from posenc.cli._shared import _usage_error
from posenc.errors import PosencError
from posenc.spec import (
    Spec,
)


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024 or unit == "EiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError("unreachable")


def _check_output(
    output: Path, formats: Sequence[str] | None = None, command: str = "fetch"
) -> None:
    """Refuse an output that cannot be written before anything is fetched."""
    formats = tuple(_FORMATS) if formats is None else formats
    if output.is_dir():
        raise _usage_error(f"-o {output} is a directory: give a file name in it", command)
    if output.suffix not in formats:
        raise _usage_error(
            f"-o {output}: unknown format {output.suffix or '(no suffix)'!r}; "
            f"the suffix chooses it: {', '.join(formats)}",
            command,
        )
    parent = output.parent
    if not parent.is_dir():
        raise _usage_error(f"-o {output}: directory {parent} does not exist", command)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _usage_error(f"-o {output}: directory {parent} is not writable", command)


def _npy(shape: tuple[int, ...], dtype: np.dtype[Any], spec: Spec) -> bytes:
    """The header of a .npy file holding an array of ``shape`` (what ``numpy.save`` writes
    before the data)."""
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": shape,
    }
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header over 64 KiB: format 2.0
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


# safetensors names of the dtypes (bfloat16 is native there, unlike in .npy).
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def _safetensors(shape: tuple[int, ...], dtype: np.dtype[Any], spec: Spec) -> bytes:
    """The header of a safetensors file holding one tensor ``table`` of ``shape``.

    The format is an 8-byte little-endian header length, a JSON header (padded with spaces
    to 8-byte alignment) and the raw little-endian bytes: written here directly, so that a
    table of any size streams into the file instead of being built in memory first.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    header = {
        "__metadata__": {"posenc.spec": json.dumps({"kind": spec.kind, **spec.parameters})},
        "table": {
            "dtype": _SAFETENSORS_DTYPES[dtype.name],
            "shape": list(shape),
            "data_offsets": [0, nbytes],
        },
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


_FORMATS = {".npy": _npy, ".safetensors": _safetensors}
"""Output formats by file suffix: the header written before the rows."""


def _seconds(elapsed: float) -> str:
    return f"{elapsed:.1f} s" if elapsed >= 1 else f"{elapsed * 1e3:.0f} ms"


# The longest file name most file systems take, in bytes.
_NAME_MAX = 255


def _partial_name(output: Path) -> Path:
    """The hidden name beside ``output`` that a table is written under until it is complete:
    within the file system's name limit whatever the length of ``output``'s own name."""
    suffix = f".{os.getpid()}.partial"
    room = _NAME_MAX - 1 - len(suffix)
    stem = os.fsencode(output.name)[:room].decode(errors="ignore")
    return output.with_name(f".{stem}{suffix}")


class _Partial:
    """The file a table is written into before it becomes ``output``.

    Where the file system has them (Linux: ext4, xfs, btrfs, tmpfs), an unnamed file in
    ``output``'s directory (``O_TMPFILE``), which the system removes whatever ends the
    process (SIGKILL included), given its name only when complete; elsewhere a hidden named
    file, removed on any error or signal this process sees.
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.named: Path | None = None
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
        tmpfile = getattr(os, "O_TMPFILE", 0)
        fd = -1
        if tmpfile and os.path.isdir("/proc/self/fd"):  # where commit() links it from
            with contextlib.suppress(OSError):  # not supported there: a named file
                fd = os.open(output.parent, flags | tmpfile, 0o666)
        if fd < 0:
            self.named = _partial_name(output)
            fd = os.open(self.named, flags | os.O_CREAT | os.O_EXCL, 0o666)
        self.fd = fd

    def reserve(self, size: int) -> None:
        """Allocates ``size`` bytes on the disk now: a disk too full to hold the table fails
        here, before anything is fetched, and no other writer can take the space after."""
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, size)  # a file system without allocation: writes tell

    def write(self, offset: int, data: memoryview) -> None:
        """Writes all of ``data`` at ``offset`` (a full disk: OSError, never a signal)."""
        while data:
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written

    def commit(self) -> None:
        """Makes the complete file ``output`` (replacing any file of that name)."""
        os.fsync(self.fd)
        if self.named is None:
            # An unnamed file gets a name by a link to it, then takes the output's by rename.
            # linkat(2) follows /proc/self/fd/N to the file only when asked to, which os.link
            # does only with a directory descriptor given.
            self.named = _partial_name(self.output)
            descriptors = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(str(self.fd), self.named, src_dir_fd=descriptors, follow_symlinks=True)
            finally:
                os.close(descriptors)
        os.replace(self.named, self.output)
        self.named = None

    def discard(self) -> None:
        """Closes the file, and removes it unless it became ``output``."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self.named is not None:
            with contextlib.suppress(OSError):
                self.named.unlink()


class _Terminated(Exception):
    """SIGTERM or SIGHUP arrived: the fetch stops, and its partial file is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _stop_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP end the fetch as Ctrl-C does, through its clean-up, instead of
    killing the process where it stands."""

    def stop(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class _Rows:
    """The rows a fetch writes: ``slices`` of ``(label, rows)``, the row of a slice's first
    row being ``label - origin`` in an array of ``shape`` (rows, columns) in ``dtype``."""

    slices: Iterator[tuple[int, npt.NDArray[Any]]]
    shape: tuple[int, int]
    dtype: np.dtype[Any]
    origin: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in the file."""
        return self.shape[1] * self.dtype.itemsize


def _write(
    output: Path,
    rows: _Rows,
    spec: Spec,
    no_progress: bool,
    file_shape: tuple[int, ...] | None = None,
) -> None:
    """Write the table into a file beside ``output`` that becomes it when complete
    (``file_shape``: the array's shape in the file, a grid's ``[*grid_shape, width]``; rows
    are written as ``rows.shape`` either way). On any failure, a full disk included, nothing
    is left behind and the error is an OSError naming ``output``."""
    started = time.monotonic()
    partial: _Partial | None = None
    try:
        with _stop_on_termination():
            partial = _Partial(output)
            header = _FORMATS[output.suffix](file_shape or rows.shape, rows.dtype, spec)
            partial.reserve(len(header) + rows.shape[0] * rows.row_bytes)
            partial.write(0, memoryview(header))
            _write_rows(partial, len(header), rows, no_progress)
    except OSError as error:
        if isinstance(error, PosencError):
            raise  # the server's failure (UNAVAILABLE is a ConnectionError), not the file's
        # Name the user's file, not the hidden one beside it.
        raise OSError(f"cannot write {output}: {error.strerror or error}") from None
    finally:
        if partial is not None:
            partial.discard()
    _report(output, rows.shape, rows.dtype, time.monotonic() - started)


def _write_rows(partial: _Partial, offset: int, rows: _Rows, no_progress: bool) -> None:
    """Writes each slice at its row's place after ``offset`` header bytes, then commits the
    file, with a progress bar on a terminal."""
    row_bytes = rows.row_bytes
    with tqdm(
        total=rows.shape[0],
        unit="row",
        unit_scale=True,
        dynamic_ncols=True,
        file=sys.stderr,
        disable=no_progress or not sys.stderr.isatty(),
    ) as bar:
        for label, block in rows.slices:
            first = label - rows.origin
            data = np.ascontiguousarray(block, dtype=rows.dtype).view(np.uint8).reshape(-1)
            partial.write(offset + first * row_bytes, data.data)
            bar.update(len(block))
            bar.set_postfix_str(_human_bytes(bar.n * row_bytes), refresh=False)
        # Writing the file's pages out can take seconds after the last row: the bar
        # says so, and its clock runs until it is done.
        bar.set_postfix_str(f"{_human_bytes(bar.n * row_bytes)}, writing to disk")
        partial.commit()


def _report(output: Path, shape: tuple[int, int], dtype: np.dtype[Any], elapsed: float) -> None:
    """The line a complete fetch ends with: what it wrote, where, and how fast."""
    elapsed = max(elapsed, 1e-9)
    size = shape[0] * shape[1] * dtype.itemsize
    print(
        f"posenc fetch: wrote {shape[0]:,} x {shape[1]} {dtype.name} rows "
        f"({_human_bytes(size)}) to {output} in {_seconds(elapsed)} "
        f"({shape[0] / elapsed:,.0f} rows/s, {_human_bytes(size / elapsed)}/s)",
        file=sys.stderr,
    )
