"""Figures of posenc's tables: precision drift, rotary scaling, and the properties that make
sinusoidal encodings work. Needs the ``[plot]`` extra (matplotlib, mpmath)::

    pip install 'posenc[plot]'
    posenc plot drift -o drift.png                      # or, from Python:

    import posenc, posenc.plot
    with posenc.Client() as client:
        data = posenc.plot.drift(client, posenc.Spec("sinusoidal", d_model=512))
        posenc.plot.render(posenc.plot.draw_drift(data), "drift.png")

Every figure is drawn from the data a function here returns (a frozen dataclass of numpy
arrays), so the numbers behind a picture can be checked, and are, against formulas. Where a
figure shows posenc's tables the data comes from a server through ``client``; the exact
values it is compared with are computed here with mpmath at 40 digits.

The base SDK never imports this module, and this module imports matplotlib (and mpmath)
only when it draws (or computes exact values): the figure names and the data functions of
the rotary and sinusoidal figures work without them.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from posenc._client import Client
from posenc.spec import Spec, position_axes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DPI",
    "FIGURES",
    "MAX_D_MODEL",
    "SIZE",
    "Drift",
    "GridDrift",
    "Heatmap",
    "Rotation",
    "Scalings",
    "Similarity",
    "Wavelengths",
    "default_spec",
    "draw_drift",
    "draw_grid_drift",
    "draw_heatmap",
    "draw_rotation",
    "draw_scalings",
    "draw_similarity",
    "draw_wavelengths",
    "drift",
    "drift_positions",
    "figure",
    "grid_drift",
    "heatmap",
    "render",
    "rope_scaling_specs",
    "rope_scalings",
    "rotation",
    "similarity",
    "wavelengths",
]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

SIZE: Final = (9.0, 5.0)
"""Every figure's size in inches; at :data:`DPI`, a PNG of 900 x 500 pixels."""
DPI: Final = 100
MAX_POSITION: Final = 2**42
"""The largest position the accuracy contract covers (the server's default limit)."""
MAX_D_MODEL: Final = 4096
"""The widest table the figures take: wider ones cost minutes of exact values (drift) or
gigabytes of rows (heatmap), and show nothing new."""
BASES: Final = (100.0, 10000.0, 500000.0)
"""The bases the multi-base figures compare: short, the paper's, Llama 3's."""
_DIGITS: Final = 40  # exact values: pos * inv_freq to 2**-80 relative at pos 2**42
# Values drawn on a log axis are clipped here: an error of exactly 0 has no logarithm.
_FLOOR: Final = 1e-18


# -- helpers ------------------------------------------------------------------------------


def _rows(client: Client, positions: Sequence[int] | Ints, spec: Spec) -> Floats:
    """posenc's float64 rows (within 2**-50 of the exact values, by contract)."""
    return np.asarray(
        client.get_positions(np.asarray(positions, dtype=np.int64), spec, dtype="float64"),
        dtype=np.float64,
    )


def _classic(d_model: int, base: float) -> Spec:
    """The classic interleaved table, whose pair i is columns (2i, 2i + 1) = (sin, cos)."""
    if not 2 <= d_model <= MAX_D_MODEL or d_model % 2:
        raise ValueError(
            f"the sinusoidal figures need an even d_model from 2 to {MAX_D_MODEL}, got {d_model}"
        )
    return Spec("sinusoidal", d_model=d_model, base=base, layout="interleaved")


def _angles(row: Floats, sin: slice, cos: slice) -> Floats:
    """The angle of each (sin, cos) pair of a row: at position 1, the inverse frequency
    (every inverse frequency is at most 1 < pi, so the angle is not wrapped)."""
    return np.asarray(np.arctan2(row[sin], row[cos]), dtype=np.float64)


def _log_positions(stop: int, per_octave: int) -> Ints:
    """Distinct integers from 1 to ``stop``, ``per_octave`` per doubling, ``stop`` included."""
    octaves = math.log2(stop)
    steps = np.arange(0, int(octaves * per_octave) + 1) / per_octave
    values = np.unique(np.round(2.0**steps).astype(np.int64))
    return np.unique(np.append(values[values <= stop], stop))


def drift_positions(per_octave: int = 2, stop: int = MAX_POSITION) -> Ints:
    """The positions of the drift figure: 1 to ``stop``, ``per_octave`` per doubling."""
    return _log_positions(stop, per_octave)


def _power_of_two(value: int) -> str:
    """``2^20`` for 1048576; other numbers as they are."""
    if value > 1024 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def _new_figure() -> Figure:
    from matplotlib.figure import Figure  # optional: the [plot] extra

    return Figure(figsize=SIZE, dpi=DPI, layout="constrained")


def _labelled(
    ax: Any, x: str, y: str, title: str, *, legend_size: int = 8, columns: int = 1
) -> Figure:
    """The axes' labels, title, grid and legend, as every line figure here sets them; the
    axes' figure."""
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend_size, ncol=columns)
    figure: Figure = ax.figure
    return figure


# -- precision drift ---------------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    """Largest absolute error of a row against the exact values, per position."""

    title: str
    positions: Ints
    posenc: Floats
    """posenc's table in ``dtype``, from the server."""
    naive: Floats
    """The naive float32 table: ``sin/cos(float32(position) * float32(inv_freq))``."""
    family: Floats | None
    """The model family's own float32 table (transformers' module), where there is one and
    transformers is installed."""
    family_label: str
    dtype: str


@dataclass(frozen=True)
class _Exact:
    """A table as pairs: the spec (in a layout of [sin block | cos block] or [cos | sin]),
    its exact inverse frequencies, where its sin and cos columns are, and its position map."""

    spec: Spec
    inv_freq: list[Any]  # mpmath.mpf
    sin: slice
    cos: slice
    offset: int = 0
    """Added to a position before it is multiplied (tensor2tensor's start_index)."""
    zero_row: int | None = None
    """A position whose row is zero (fairseq's padding_idx): left out of the figure."""


def _even_width(d_model: int) -> int:
    if not 2 <= d_model <= MAX_D_MODEL or d_model % 2:
        raise ValueError(
            f"the drift figure needs an even d_model from 2 to {MAX_D_MODEL}, got {d_model}"
        )
    return d_model


def _exact_table(spec: Spec) -> _Exact:
    """The drift figure's view of ``spec``, with its inverse frequencies to 40 digits: the
    classic table (either schedule), tensor2tensor, whisper and fairseq tables ([sin | cos]
    over log-spaced timescales), or a rotary table without scaling."""
    import mpmath  # optional: the [plot] extra

    parameters = spec.parameters
    kind = spec.kind
    with mpmath.workdps(_DIGITS):
        if kind == "rotary" and "scaling" not in parameters:
            dim = int(int(parameters["head_dim"]) * parameters.get("partial_rotary_factor", 1.0))
            _even_width(dim)
            theta = mpmath.mpf(parameters.get("rope_theta", 10000.0))
            inv = [theta ** (-mpmath.mpf(2 * i) / dim) for i in range(dim // 2)]
            vllm = Spec("rotary", **{**parameters, "layout": "vllm"})
            return _Exact(vllm, inv, slice(dim // 2, None), slice(0, dim // 2))
        if kind in ("sinusoidal", "tensor2tensor", "whisper", "fairseq"):
            half = _even_width(int(parameters["d_model"])) // 2
            blocks = (slice(0, half), slice(half, None))
            low = mpmath.mpf(parameters.get("min_timescale", 1.0))
            high = mpmath.mpf(parameters.get("base", parameters.get("max_timescale", 10000.0)))
            # log-spaced timescales from low to high, one per sin column
            spaced = [
                low * (high / low) ** (-mpmath.mpf(i) / max(half - 1, 1)) for i in range(half)
            ]
            if kind != "sinusoidal":
                zero_row = parameters.get("padding_idx", 1) if kind == "fairseq" else None
                offset = int(parameters.get("start_index", 0))
                return _Exact(spec, spaced, *blocks, offset=offset, zero_row=zero_row)
            split = Spec("sinusoidal", **{**parameters, "layout": "split"})
            if parameters.get("schedule", "paper") == "tensor2tensor":
                return _Exact(split, spaced, *blocks)
            paper = [high ** (-mpmath.mpf(2 * i) / (2 * half)) for i in range(half)]
            return _Exact(split, paper, *blocks)
    raise ValueError(
        "the drift figure takes a sinusoidal, tensor2tensor, whisper or fairseq table or a "
        f"rotary table without scaling, got {spec!r}"
    )


def _exact_pairs(inv_freq: Sequence[Any], positions: Ints) -> tuple[Floats, Floats]:
    """Exact sin and cos of ``position * inv_freq``, rounded to float64."""
    import mpmath  # optional: the [plot] extra

    sin = np.empty((len(positions), len(inv_freq)))
    cos = np.empty_like(sin)
    with mpmath.workdps(_DIGITS):
        for row, position in enumerate(positions.tolist()):
            for column, frequency in enumerate(inv_freq):
                angle = position * frequency
                sin[row, column] = float(mpmath.sin(angle))
                cos[row, column] = float(mpmath.cos(angle))
    return sin, cos


def _naive_pairs(inv_freq: Sequence[Any], positions: Ints) -> tuple[Floats, Floats]:
    """The usual float32 code: ``position * div_term`` and its sin, cos in float32 (with
    ``div_term`` correctly rounded: the naive table's error is the angle's, not its own)."""
    div_term = np.array([float(f) for f in inv_freq], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float32 overflow never happens; rounding does
        angle = positions.astype(np.float32)[:, None] * div_term[None, :]
    return np.sin(angle).astype(np.float64), np.cos(angle).astype(np.float64)


def _family_pairs(spec: Spec, positions: Ints) -> tuple[Floats, Floats] | None:
    """transformers' own rotary module (Llama's, built from a config with this spec's
    parameters), called as a model calls it; None for other kinds or without transformers."""
    parameters = spec.parameters
    if spec.kind != "rotary" or parameters.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    try:
        torch: Any = importlib.import_module("torch")
        transformers: Any = importlib.import_module("transformers")
        llama: Any = importlib.import_module("transformers.models.llama.modeling_llama")
    except ImportError:
        return None
    head_dim = int(parameters["head_dim"])
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(parameters.get("rope_theta", 10000.0)),
        },
    )
    module = llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = module(x, torch.as_tensor(positions, dtype=torch.int64)[None, :])
    half = head_dim // 2  # transformers' rows are [cos | cos] and [sin | sin]
    return (
        sin[0, :, :half].double().numpy().astype(np.float64),
        cos[0, :, :half].double().numpy().astype(np.float64),
    )


def _largest_error(pairs: tuple[Floats, Floats], exact: tuple[Floats, Floats]) -> Floats:
    errors = [np.abs(ours - theirs).max(axis=1) for ours, theirs in zip(pairs, exact, strict=True)]
    return np.asarray(np.maximum(*errors), dtype=np.float64)


def drift(
    client: Client,
    spec: Spec,
    *,
    positions: Ints | None = None,
    dtype: str = "float32",
) -> Drift:
    """Largest error per position of posenc's ``dtype`` table, the naive float32 table and
    (rotary) transformers' float32 table, each against the exact values (mpmath).

    Args:
        client: A client of the server whose table is measured.
        spec: A sinusoidal table (either schedule, any layout), a tensor2tensor, whisper or
            fairseq table (even d_model), or a rotary table without scaling.
        positions: Positive positions; default :func:`drift_positions` (1 to 2**42). A
            fairseq table's padding row (zero) is left out.
        dtype: posenc's table type.
    """
    table = _exact_table(spec)
    where = drift_positions() if positions is None else np.asarray(positions, dtype=np.int64)
    where = where[where != table.zero_row]
    exact = _exact_pairs(table.inv_freq, where + table.offset)
    rows = client.get_positions(where, table.spec, dtype=dtype).astype(np.float64)
    ours = (rows[:, table.sin], rows[:, table.cos])
    family = _family_pairs(spec, where)
    return Drift(
        title=repr(spec),
        positions=where,
        posenc=_largest_error(ours, exact),
        naive=_largest_error(_naive_pairs(table.inv_freq, where + table.offset), exact),
        family=None if family is None else _largest_error(family, exact),
        family_label="transformers LlamaRotaryEmbedding (float32)",
        dtype=dtype,
    )


def draw_drift(data: Drift) -> Figure:
    """Error against position, log-log: posenc stays at its rounding, the others grow."""
    fig = _new_figure()
    ax = fig.add_subplot()
    ax.loglog(data.positions, np.maximum(data.naive, _FLOOR), "o-", ms=3, label="naive float32")
    if data.family is not None:
        ax.loglog(
            data.positions, np.maximum(data.family, _FLOOR), "s--", ms=3, label=data.family_label
        )
    ax.loglog(
        data.positions, np.maximum(data.posenc, _FLOOR), "o-", ms=3, label=f"posenc {data.dtype}"
    )
    if data.dtype == "float32":
        ax.axhline(2.0**-24, color="grey", ls=":", lw=1, label="1 ulp of float32 in [0.5, 1)")
    ax.set_xscale("log", base=2)
    return _labelled(
        ax, "position", "largest |value - exact| in the row", f"Precision drift: {data.title}"
    )


# -- rotary scaling ----------------------------------------------------------------------


@dataclass(frozen=True)
class Scalings:
    """Effective inverse frequency per frequency index, for each rope scaling."""

    head_dim: int
    rope_theta: float
    original: int
    """The pre-training context length the scalings extend."""
    inv_freq: Mapping[str, Floats]
    specs: Mapping[str, Spec]


def _longrope_factors(half: int) -> tuple[list[float], list[float]]:
    """Short and long LongRoPE factors of Phi-3's shape (real ones ship with checkpoints):
    near 1 for short contexts, growing with the index to 61 for long ones."""
    top = max(half - 1, 1)
    return [1.0 + 0.05 * i / top for i in range(half)], [
        1.0 + 60.0 * (i / top) ** 2 for i in range(half)
    ]


def rope_scaling_specs(
    head_dim: int = 128,
    rope_theta: float = 500000.0,
    *,
    factor: float = 8.0,
    original: int = 8192,
    seq_lens: Sequence[int] = (32768, 131072),
) -> dict[str, Spec]:
    """The scalings the figure compares, with Llama 3.1's parameters where a scaling has
    them (factor 8 over 8192 positions), in the vllm layout ([cos | sin])."""
    base: dict[str, Any] = {"head_dim": head_dim, "rope_theta": rope_theta, "layout": "vllm"}
    short, long = _longrope_factors(head_dim // 2)
    longrope: dict[str, Any] = {
        "scaling": "longrope",
        "original_max_position_embeddings": original,
        "max_position_embeddings": int(original * factor),
        "short_factor": short,
        "long_factor": long,
    }
    scaled = {"factor": factor}
    extended = {"factor": factor, "original_max_position_embeddings": original}
    dynamic = {"scaling": "dynamic", "factor": factor, "max_position_embeddings": original}
    parameters: dict[str, dict[str, Any]] = {
        "default": {},
        f"linear x{factor:g}": {"scaling": "linear", **scaled},
        **{f"dynamic, seq_len {n}": {**dynamic, "seq_len": n} for n in seq_lens},
        f"yarn x{factor:g}": {"scaling": "yarn", **extended},
        f"llama3 x{factor:g}": {
            "scaling": "llama3",
            **extended,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        "longrope short": {**longrope, "seq_len": original},
        "longrope long": {**longrope, "seq_len": int(original * factor)},
    }
    return {name: Spec("rotary", **base, **own) for name, own in parameters.items()}


def rope_scalings(
    client: Client,
    head_dim: int = 128,
    rope_theta: float = 500000.0,
    *,
    factor: float = 8.0,
    original: int = 8192,
    seq_lens: Sequence[int] = (32768, 131072),
) -> Scalings:
    """Each scaling's inverse frequencies, read from posenc's rows at position 1 (the angle
    of each cos/sin pair: what the table actually rotates by per position)."""
    specs = rope_scaling_specs(
        head_dim, rope_theta, factor=factor, original=original, seq_lens=seq_lens
    )
    half = head_dim // 2
    inv_freq = {
        label: _angles(_rows(client, [1], spec)[0], slice(half, None), slice(0, half))
        for label, spec in specs.items()
    }
    return Scalings(head_dim, rope_theta, original, inv_freq, specs)


def draw_scalings(data: Scalings) -> Figure:
    """Inverse frequency per index (log), and each scaling's stretch of the default."""
    fig = _new_figure()
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    index = np.arange(data.head_dim // 2)
    default = data.inv_freq["default"]
    for label, values in data.inv_freq.items():
        style = "k-" if label == "default" else "-"
        top.semilogy(index, values, style, lw=1.2, label=label)
        bottom.semilogy(index, default / values, style, lw=1.2)
    top.axhline(
        2 * math.pi / data.original, color="grey", ls=":", lw=1, label="wavelength = original ctx"
    )
    top.set_ylabel("inverse frequency (rad/position)")
    top.set_title(
        f"Rotary scalings: head_dim {data.head_dim}, rope_theta {data.rope_theta:g}, "
        f"original context {data.original}",
        fontsize=10,
    )
    top.legend(fontsize=7, ncol=2)
    bottom.set_ylabel("stretch (default / scaled)")
    bottom.set_xlabel("frequency index i")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return fig


# -- sinusoidal properties ---------------------------------------------------------------


@dataclass(frozen=True)
class _Classic:
    """A figure's data of the classic table of ``d_model`` columns (by base, or at one)."""

    d_model: int


@dataclass(frozen=True)
class _OneBase(_Classic):
    """A figure's data of the classic table at one ``base``."""

    base: float


@dataclass(frozen=True)
class Heatmap(_OneBase):
    """A slice of the table, and how close two of its rows at distance k come, per k."""

    table: Floats
    """Rows [0, len(table)) of the table."""
    closest: Floats
    """``closest[k - 1]``: the smallest ``|PE(p) - PE(p + k)|`` over the rows of the range
    (positions 0 to ``len(closest)``)."""

    @property
    def min_distance(self) -> float:
        """The smallest distance between two distinct rows of the range."""
        return float(self.closest.min())


def heatmap(
    client: Client, d_model: int = 128, base: float = 10000.0, *, rows: int = 256, span: int = 2048
) -> Heatmap:
    """Rows [0, rows) of the classic table, and the closest pairs of rows in [0, span)."""
    spec = _classic(d_model, base)
    table = np.asarray(client.get_range(0, span, spec, dtype="float64"), dtype=np.float64)
    norms = (table**2).sum(axis=1)
    squared = norms[:, None] + norms[None, :] - 2 * table @ table.T  # every pair of rows
    closest = np.array([np.diagonal(squared, k).min() for k in range(1, span)])
    return Heatmap(d_model, base, table[:rows], np.sqrt(np.maximum(closest, 0.0)))


def draw_heatmap(data: Heatmap) -> Figure:
    """The table slice (bounded in [-1, 1]) and how close rows k apart ever come."""
    fig = _new_figure()
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    image = left.imshow(
        data.table, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest"
    )
    fig.colorbar(image, ax=left, shrink=0.8)
    left.set_xlabel("column")
    left.set_ylabel("position")
    left.set_title(f"PE, d_model {data.d_model}, base {data.base:g}", fontsize=10)
    shifts = np.arange(1, len(data.closest) + 1)
    right.semilogx(shifts, data.closest, lw=1, label="min over p of |PE(p) - PE(p+k)|")
    right.axhline(data.min_distance, color="grey", ls=":", lw=1, label="smallest")
    right.axhline(
        math.sqrt(data.d_model), color="grey", ls="--", lw=1, label="sqrt(d_model): unrelated"
    )
    right.set_ylim(bottom=0)
    right.set_xlabel("distance k")
    right.set_ylabel("distance between rows")
    right.set_title(
        f"rows [0, {len(data.closest) + 1}): smallest distance {data.min_distance:.3f}",
        fontsize=10,
    )
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7, loc="lower right")
    return fig


@dataclass(frozen=True)
class Rotation(_OneBase):
    """``max |PE(p + k) - R(k) PE(p)|`` per position p and shift k."""

    positions: Ints
    residual: Mapping[int, Floats]
    """posenc's float64 table, ``R(k)`` from its row at position k."""
    naive: Mapping[int, Floats]
    """The same with the naive float32 table (its rows at p, p + k and k)."""


def _rotate(rows: Floats, by: Floats) -> Floats:
    """``R(k) PE(p)`` for interleaved rows ``rows`` (p) and ``by`` (k): each (sin, cos)
    pair turned by the angle whose (sin, cos) the row at k holds."""
    sin, cos = rows[..., 0::2], rows[..., 1::2]
    sin_k, cos_k = by[..., 0::2], by[..., 1::2]
    out = np.empty_like(rows)
    out[..., 0::2] = sin * cos_k + cos * sin_k  # sin(a + b)
    out[..., 1::2] = cos * cos_k - sin * sin_k  # cos(a + b)
    return out


def _naive_classic(positions: Ints, d_model: int, base: float) -> Floats:
    """The naive float32 table (as in the drift figure), interleaved, as float64."""
    sin, cos = _naive_pairs(list(base ** (-np.arange(0, d_model, 2) / d_model)), positions)
    out = np.empty((len(positions), d_model))
    out[:, 0::2], out[:, 1::2] = sin, cos
    return out


def rotation(
    client: Client,
    d_model: int = 128,
    base: float = 10000.0,
    *,
    shifts: Sequence[int] = (1, 1000, 2**20, 2**40),
    positions: Ints | None = None,
) -> Rotation:
    """How exactly ``R(k)``, built from the row at position k, moves row p to row p + k."""
    spec = _classic(d_model, base)
    where = _log_positions(2**41, 1) if positions is None else np.asarray(positions, np.int64)
    residual: dict[int, Floats] = {}
    naive: dict[int, Floats] = {}
    for k in shifts:
        rows = _rows(client, np.concatenate([where, where + k, [k]]), spec)
        before, after, by = rows[: len(where)], rows[len(where) : -1], rows[-1]
        residual[k] = np.abs(after - _rotate(before, by)).max(axis=1)
        plain = _naive_classic(np.concatenate([where, where + k, [k]]), d_model, base)
        naive[k] = np.abs(plain[len(where) : -1] - _rotate(plain[: len(where)], plain[-1])).max(
            axis=1
        )
    return Rotation(d_model, base, where, residual, naive)


def draw_rotation(data: Rotation) -> Figure:
    """The residual per position: posenc's at rounding level, the naive table's growing."""
    fig = _new_figure()
    ax = fig.add_subplot()
    for index, (k, values) in enumerate(data.residual.items()):
        color, shift = f"C{index}", _power_of_two(k)
        ax.loglog(
            data.positions, np.maximum(values, _FLOOR), "o-", ms=3, color=color, label=f"k={shift}"
        )
        ax.loglog(
            data.positions,
            np.maximum(data.naive[k], _FLOOR),
            "--",
            color=color,
            lw=1,
            label=f"k={shift}, naive float32",
        )
    ax.axhline(2.0**-50, color="grey", ls=":", lw=1, label="2^-50 (float64 contract)")
    ax.set_xscale("log", base=2)
    title = (
        f"Relative positions are rotations: d_model {data.d_model}, base {data.base:g}, "
        f"R(k) from the row at k (0 drawn at {_FLOOR:g})"
    )
    return _labelled(
        ax, "position p", "max |PE(p+k) - R(k) PE(p)|", title, legend_size=7, columns=2
    )


@dataclass(frozen=True)
class Similarity(_Classic):
    """Cosine similarity ``PE(p) . PE(p + k) / (|PE(p)| |PE(p + k)|)`` against k."""

    start: int
    """p."""
    shifts: Ints
    similarity: Mapping[float, Floats]
    """By base."""


def similarity(
    client: Client,
    d_model: int = 128,
    bases: Sequence[float] = BASES,
    *,
    start: int = 0,
    shifts: Ints | None = None,
) -> Similarity:
    """How alike two rows are, by their distance k, for several bases."""
    ks = _log_positions(2**20, 16) if shifts is None else np.asarray(shifts, dtype=np.int64)
    out: dict[float, Floats] = {}
    for base in bases:
        rows = _rows(client, np.concatenate([[start], start + ks]), _classic(d_model, base))
        norms = np.linalg.norm(rows, axis=1)
        out[base] = rows[1:] @ rows[0] / (norms[1:] * norms[0])
    return Similarity(d_model, start, ks, out)


def draw_similarity(data: Similarity) -> Figure:
    """Similarity against distance: falling with k, slower for larger bases."""
    fig = _new_figure()
    ax = fig.add_subplot()
    for base, values in data.similarity.items():
        ax.semilogx(data.shifts, values, lw=1, label=f"base {base:g}")
    ax.axhline(0, color="grey", lw=0.8)
    title = f"Similarity decays with distance: d_model {data.d_model}, p = {data.start}"
    return _labelled(ax, "distance k", "cos similarity of PE(p) and PE(p+k)", title)


@dataclass(frozen=True)
class Wavelengths(_Classic):
    """The wavelength ``2 pi / inv_freq[i]`` of each sin/cos pair, by base."""

    wavelength: Mapping[float, Floats]


def wavelengths(client: Client, d_model: int = 128, bases: Sequence[float] = BASES) -> Wavelengths:
    """Each pair's wavelength, from the angle of posenc's row at position 1."""
    out: dict[float, Floats] = {}
    for base in bases:
        row = _rows(client, [1], _classic(d_model, base))[0]
        out[base] = 2 * math.pi / _angles(row, slice(0, None, 2), slice(1, None, 2))
    return Wavelengths(d_model, out)


def draw_wavelengths(data: Wavelengths) -> Figure:
    """Wavelength per pair, from 2 pi up towards 2 pi base."""
    fig = _new_figure()
    ax = fig.add_subplot()
    for index, (base, values) in enumerate(data.wavelength.items()):
        ax.semilogy(
            np.arange(len(values)), values, lw=1.5, color=f"C{index}", label=f"base {base:g}"
        )
        ax.axhline(2 * math.pi * base, color=f"C{index}", ls=":", lw=1)
    ax.axhline(2 * math.pi, color="grey", ls=":", lw=1, label="2 pi and 2 pi base (dotted)")
    title = f"The base trade-off: wavelength per dimension, d_model {data.d_model}"
    return _labelled(ax, "pair i (columns 2i, 2i+1)", "wavelength (positions)", title)


@dataclass(frozen=True)
class Rows:
    """Rows of any table kind, with what they are the rows of."""

    spec: Spec
    rows: Floats
    """``[n, width]``, float64."""
    label: str
    """What the rows run over: positions, or coordinates."""


def table_rows(client: Client, spec: Spec, rows: int = 256) -> Rows:
    """Up to ``rows`` rows of ``spec``: a grid kind's first cells in row-major order; a kind
    of several position axes over a square of its last two axes (the others 0, as a frame
    of an image or video); any other kind at positions ``[0, rows)``."""
    if spec.grid_shape is not None:
        grid = np.asarray(client.get_grid(spec, dtype="float64"), dtype=np.float64)
        table = grid.reshape(-1, grid.shape[-1])[:rows]
        shape = " x ".join(map(str, spec.grid_shape))
        return Rows(spec, table, f"cell of the {shape} grid, row-major")
    axes = position_axes(spec.kind)
    if axes > 1:
        side = math.isqrt(rows)
        line = np.arange(side)
        coordinates = np.zeros((side * side, axes), dtype=np.int64)
        coordinates[:, -2], coordinates[:, -1] = np.repeat(line, side), np.tile(line, side)
        table = _rows(client, coordinates, spec)
        return Rows(spec, table, f"coordinate (0, .., h, w), h and w in [0, {side})")
    table = np.asarray(client.get_range(0, rows, spec, dtype="float64"), dtype=np.float64)
    return Rows(spec, table, "position")


def draw_table(data: Rows) -> Figure:
    """The rows as an image, columns across."""
    fig = _new_figure()
    axes = fig.subplots()
    image = axes.imshow(
        data.rows, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest"
    )
    fig.colorbar(image, ax=axes, shrink=0.8)
    axes.set_xlabel("column")
    axes.set_ylabel(data.label)
    axes.set_title(f"{data.spec!r}", fontsize=9)
    return fig


# -- sin-cos grids at other sizes ----------------------------------------------------------


@dataclass(frozen=True)
class GridDrift:
    """Largest absolute error of a 2D sin-cos grid against the exact values, per grid size."""

    spec: Spec
    """The grid at its base size."""
    sides: Ints
    """Cells per side of each square grid measured."""
    posenc: Floats
    """posenc's float32 grid."""
    float32_positions: Floats
    """The grid of float32 positions ``i / (n / base_size) / interpolation_scale``, values in
    float64 rounded to float32: how diffusers builds it at a size other than its buffer's."""


def _grid_sides(base: int) -> Ints:
    """Sides from half ``base`` to four times it, four per doubling."""
    return np.unique(np.round(base * 2.0 ** (np.arange(-4, 9) / 4)).astype(np.int64))


def _float32_position_axis(side: int, embed_dim: int, base: float, scale: float) -> Floats:
    """One axis's half of a grid row, ``[sin | cos]`` of ``embed_dim / 2`` columns, from
    positions computed in float32."""
    positions = np.arange(side, dtype=np.float32) / np.float32(side / base) / np.float32(scale)
    quarter = embed_dim // 4
    omega = 1.0 / 10000.0 ** (np.arange(quarter, dtype=np.float64) / quarter)
    angles = np.outer(positions.astype(np.float64), omega)
    axis = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    return np.asarray(axis.astype(np.float32), dtype=np.float64)


def grid_drift(client: Client, spec: Spec, sides: Ints | None = None) -> GridDrift:
    """Largest error of posenc's float32 grid and of the float32-position grid at each
    square size, both against posenc's float64 grid (within 2**-50 of exact).

    Args:
        client: A client of the server whose grids are measured.
        spec: A ``sincos_grid_2d`` grid with a ``base_size`` (and an
            ``interpolation_scale``; its own height and width are replaced by each size's;
            its other parameters at their defaults, as diffusers builds its grids).
        sides: Cells per side; default half the base size to four times it.
    """
    parameters = dict(spec.parameters)
    drawn = {"embed_dim", "grid_height", "grid_width", "base_size", "interpolation_scale"}
    if spec.kind != "sincos_grid_2d" or "base_size" not in parameters or parameters.keys() - drawn:
        raise ValueError(
            "the grid drift figure takes a sincos_grid_2d grid with a base_size (diffusers' "
            f"positions i / (n / base_size) / interpolation_scale) and its other parameters "
            f"at their defaults, got {spec!r}"
        )
    embed_dim = int(parameters["embed_dim"])
    base = float(parameters["base_size"])
    scale = float(parameters.get("interpolation_scale", 1.0))
    where = _grid_sides(round(base)) if sides is None else np.asarray(sides, dtype=np.int64)
    ours, theirs = [], []
    for side in where.tolist():
        sized = Spec("sincos_grid_2d", **{**parameters, "grid_height": side, "grid_width": side})
        exact = np.asarray(client.get_grid(sized, dtype="float64"), dtype=np.float64)
        exact = exact.reshape(-1, embed_dim)
        served = np.asarray(client.get_grid(sized, dtype="float32"), dtype=np.float64)
        ours.append(float(np.abs(served.reshape(-1, embed_dim) - exact).max()))
        # A cell (row r, column c) is [axis(c) | axis(r)]: the grid's error is its axis's.
        axis = _float32_position_axis(side, embed_dim, base, scale)
        cells = np.arange(side * side)
        built = np.concatenate([axis[cells % side], axis[cells // side]], axis=1)
        theirs.append(float(np.abs(built - exact).max()))
    return GridDrift(spec, where, np.asarray(ours), np.asarray(theirs))


def draw_grid_drift(data: GridDrift) -> Figure:
    """Error against grid size: float32 positions drift wherever ``i / (n / base_size) /
    scale`` is not a float32 number; posenc's grid stays at its rounding."""
    fig = _new_figure()
    ax = fig.add_subplot()
    ax.semilogy(
        data.sides,
        np.maximum(data.float32_positions, _FLOOR),
        "o-",
        ms=3,
        label="float32 positions (diffusers at a size other than its buffer's)",
    )
    ax.semilogy(data.sides, np.maximum(data.posenc, _FLOOR), "o-", ms=3, label="posenc float32")
    ax.axhline(2.0**-24, color="grey", ls=":", lw=1, label="1 ulp of float32 in [0.5, 1)")
    ax.set_xscale("log", base=2)
    parameters = data.spec.parameters
    title = (
        f"Sin-cos grids at other sizes: embed_dim {parameters['embed_dim']}, base_size "
        f"{parameters['base_size']:g}, interpolation_scale "
        f"{parameters.get('interpolation_scale', 1.0):g}"
    )
    return _labelled(ax, "grid side (patches)", "largest |value - exact| in the grid", title)


# -- figures by name ---------------------------------------------------------------------


def _base_of(spec: Spec) -> tuple[int, float]:
    if spec.kind != "sinusoidal":
        raise ValueError(f"this figure shows the classic sinusoidal table, got {spec!r}")
    parameters = spec.parameters
    return int(parameters["d_model"]), float(parameters.get("base", 10000.0))


def _rotary_of(spec: Spec) -> tuple[int, float]:
    parameters = spec.parameters
    if spec.kind != "rotary" or "scaling" in parameters:
        raise ValueError(f"the scaling figure takes a rotary table without scaling, got {spec!r}")
    return int(parameters["head_dim"]), float(parameters.get("rope_theta", 10000.0))


_DEFAULTS: Final[Mapping[str, Spec]] = {
    "drift": Spec("sinusoidal", d_model=512),
    "rope-scaling": Spec("rotary", head_dim=128, rope_theta=500000.0),
    "heatmap": Spec("sinusoidal", d_model=128),
    "rotation": Spec("sinusoidal", d_model=128),
    "similarity": Spec("sinusoidal", d_model=128),
    "wavelength": Spec("sinusoidal", d_model=128),
    "table": Spec("rotary_axes", axes_dim=[16, 24, 24]),
    # PixArt-alpha 1024's grid: 64 patches a side at 1024 px, interpolation scale 2.
    "grid-drift": Spec(
        "sincos_grid_2d",
        embed_dim=64,
        grid_height=64,
        grid_width=64,
        base_size=64.0,
        interpolation_scale=2.0,
    ),
}

FIGURES: Final[Mapping[str, Callable[[Client, Spec, Sequence[float], str], Figure]]] = {
    "drift": lambda client, spec, bases, dtype: draw_drift(drift(client, spec, dtype=dtype)),
    "rope-scaling": lambda client, spec, bases, dtype: draw_scalings(
        rope_scalings(client, *_rotary_of(spec))
    ),
    "heatmap": lambda client, spec, bases, dtype: draw_heatmap(heatmap(client, *_base_of(spec))),
    "rotation": lambda client, spec, bases, dtype: draw_rotation(rotation(client, *_base_of(spec))),
    "similarity": lambda client, spec, bases, dtype: draw_similarity(
        similarity(client, _base_of(spec)[0], bases)
    ),
    "wavelength": lambda client, spec, bases, dtype: draw_wavelengths(
        wavelengths(client, _base_of(spec)[0], bases)
    ),
    "table": lambda client, spec, bases, dtype: draw_table(table_rows(client, spec)),
    "grid-drift": lambda client, spec, bases, dtype: draw_grid_drift(grid_drift(client, spec)),
}
"""Each figure of ``posenc plot KIND``: (client, spec, bases, dtype) -> figure."""


def default_spec(kind: str) -> Spec:
    """The table figure ``kind`` shows when none is given."""
    return _DEFAULTS[kind]


def figure(
    kind: str,
    client: Client,
    spec: Spec | None = None,
    *,
    bases: Sequence[float] = BASES,
    dtype: str = "float32",
) -> Figure:
    """Figure ``kind`` (a key of :data:`FIGURES`) of ``spec`` (default: :func:`default_spec`).

    ``bases`` are those of the similarity and wavelength figures; ``dtype`` is posenc's
    table type in the drift figure.
    """
    if kind not in FIGURES:
        raise ValueError(f"unknown figure {kind!r}: one of {', '.join(FIGURES)}")
    return FIGURES[kind](client, default_spec(kind) if spec is None else spec, bases, dtype)


def render(fig: Figure, path: str | PathLike[str]) -> None:
    """Write ``fig`` to ``path`` (.png or .svg, by suffix), :data:`SIZE` at :data:`DPI`."""
    fig.savefig(path, dpi=DPI)
