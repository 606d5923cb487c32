"""What the vLLM and SGLang integrations share: rotary caches as runs of posenc tables.

Both engines hold a rotary module's table as one ``[cos | sin]`` tensor (``rotary_dim``
columns, one row per position), built in float32 at start-up from the module's own
attributes. A :class:`Plan` says which posenc tables make up such a cache (one after the
other, each from its first position), :func:`fetch` builds it, :func:`check_rows` compares it
with the module's own. An integration declares its :class:`Engine` (its releases, served
classes and buffers), whose ``install_model`` walks a model, building and checking every
cache before it writes any (nothing is half-installed).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, TypeVar, cast

import numpy as np
import torch

import posenc
from posenc._output import as_tensor
from posenc._query import numpy_dtype

# A cache is compared with the module's own over this many leading rows (the engines'
# float32 values: their angle error grows with the position, about |p| * 2^-22 at most).
VERIFY_ROWS: Final = 16384


class UntestedReleaseWarning(UserWarning):
    """The engine's release is outside the releases posenc's integration is tested against:
    every cache is still compared with the module's own before it is installed."""


# The methods an engine's rotary class builds its cache with: a subclass that inherits them
# all (a model's own subclass that only fixes the constructor's arguments) has its
# ancestor's cache.
_CACHE_METHODS: Final = (
    "_compute_inv_freq",
    "_compute_cos_sin_cache",
    "_ensure_cos_sin_cache_length",
)


def kind_of(module: object, served: frozenset[str]) -> str:
    """The served class whose cache ``module`` holds: its own class when served, else the
    nearest served ancestor whose cache methods its class inherits unchanged, else its own
    class's name (not served). The install-time row check guards the inference."""
    cls = type(module)
    if cls.__name__ in served:
        return cls.__name__
    for base in cls.__mro__[1:]:
        if base.__name__ in served:
            same = all(getattr(cls, n, None) is getattr(base, n, None) for n in _CACHE_METHODS)
            return base.__name__ if same else cls.__name__
    return cls.__name__


_F = TypeVar("_F", bound=Callable[..., Any])


def reads_attributes(function: _F) -> _F:
    """``function`` reads a rotary module's attributes: one the module lacks (a release
    whose class differs from the tested ones) is refused in one line naming the class and
    the attribute, instead of an AttributeError from inside posenc."""

    @functools.wraps(function)
    def reading(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except AttributeError as error:
            module = next((a for a in args if isinstance(a, torch.nn.Module)), None)
            raise violation(
                "rotary_emb",
                f"{type(module).__name__} has no attribute {error.name!r}, which posenc "
                "reads its table from: this class differs from the tested releases'",
            ) from error

    return cast(_F, reading)


def descends(module: object, name: str) -> bool:
    """Whether ``module``'s class is, or derives from, a class named ``name``."""
    return any(c.__name__ == name for c in type(module).__mro__)


def violation(field: str, description: str) -> posenc.InvalidArgumentError:
    """INVALID_ARGUMENT naming ``field``."""
    return posenc.InvalidArgumentError(
        f"invalid {field}: {description}", field_violations=[(field, description)]
    )


def rotary(dim: int, theta: float, **scaling: Any) -> posenc.Spec:
    """The rotary table of ``dim`` rotated columns in the engines' ``[cos | sin]`` layout."""
    return posenc.Spec("rotary", head_dim=dim, rope_theta=theta, layout="vllm", **scaling)


def own_frequencies(dim: int, inv_freq: torch.Tensor, attention: float = 1.0) -> posenc.Spec:
    """The table of a module's own frequencies (the float32 values its code computed), the
    angles exact for those values: for a scaling posenc has no closed form of."""
    values = [float(f) for f in inv_freq.detach().cpu().double()]
    fields: dict[str, Any] = {"inv_freq": values}
    if attention != 1.0:
        fields["attention_factor"] = attention
    return posenc.Spec("rotary", head_dim=dim, layout="vllm", scaling="frequencies", **fields)


def yarn_mscale(scale: float, weight: float = 1.0) -> float:
    """YaRN's ``yarn_get_mscale(scale, weight)``, the engines' cos/sin scale (in double)."""
    return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0


def ntk_base(dim: int, theta: float, factor: float, length: float, trained: int) -> float:
    """Dynamic NTK's base for ``length`` positions of a model trained on ``trained``, as
    the engines compute it once at start-up (in double)."""
    return float(theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2)))


def ntk_alpha_base(dim: int, theta: float, alpha: float) -> float:
    """Dynamic NTK-alpha's base, ``theta * alpha ** (dim / (dim - 2))`` (in double)."""
    return float(theta * alpha ** (dim / (dim - 2)))


def llama3(
    dim: int, theta: float, *, factor: float, original: int, low: float, high: float
) -> posenc.Spec:
    """Llama 3's rotary table (its frequency bands scaled by ``factor``)."""
    return rotary(
        dim,
        theta,
        scaling="llama3",
        factor=factor,
        original_max_position_embeddings=original,
        low_freq_factor=low,
        high_freq_factor=high,
    )


def longrope_runs(
    dim: int,
    theta: float,
    original: int,
    max_position: int,
    factors: tuple[list[float], list[float]],
    mscales: tuple[float | None, float | None],
) -> tuple[Run, Run]:
    """Phi-3's LongRoPE cache: the short table's ``original`` rows, then the long table's
    ``max_position`` rows (its factors from position ``original + 1`` on); each scale is
    the table's attention factor, or derived by the server when None."""
    common: dict[str, Any] = {
        "scaling": "longrope",
        "original_max_position_embeddings": original,
        "max_position_embeddings": max_position,
        "short_factor": factors[0],
        "long_factor": factors[1],
    }
    short, long = dict(common), dict(common, seq_len=original + 1)
    for fields, mscale in ((short, mscales[0]), (long, mscales[1])):
        if mscale is not None:
            fields["attention_factor"] = mscale
    return Run(rotary(dim, theta, **short), original), Run(rotary(dim, theta, **long), max_position)


def fope_refused(field: str) -> posenc.InvalidArgumentError:
    """FoPE from get_rope's arguments: its cache needs the loaded module's coefficients."""
    return violation(
        field,
        "FourierRotaryEmbedding's cache mixes the model's learned coefficients: build "
        "it from the loaded module, cos_sin_cache_of(client, module)",
    )


# The engines posenc integrates, by package: their rotary classes share names, not
# attributes or row counts, so a module of one is never served as the other's.
ENGINES: Final = {"vllm": "vLLM", "sglang": "SGLang"}


def served_reason(module: object, kind: str, served: frozenset[str], package: str) -> str | None:
    """None when ``kind`` is served, else why not. ``package``: the engine being installed
    (a module of another engine's package is named as that engine's)."""
    for other, engine in ENGINES.items():
        if other != package and type(module).__module__.startswith(f"{other}."):
            return f"{kind} is {engine}'s class: install it with posenc.integrations.{other}"
    if kind in served:
        return None
    return f"{kind} is not a rotary class posenc serves (served: {', '.join(sorted(served))})"


# The classes the engines share whose caches are no run of tables: built_caches builds them.
BUILT: Final = frozenset(
    {"Llama4VisionRotaryEmbedding", "DualChunkRotaryEmbedding", "FourierRotaryEmbedding"}
)


def built_caches(client: posenc.Client, m: Any, kind: str) -> dict[str, torch.Tensor] | None:
    """The caches of the classes the engines share whose cache is no run of tables
    (dual-chunk attention's five, FoPE's, Llama 4 vision's), None for another class."""
    if kind == "DualChunkRotaryEmbedding":
        return dual_chunk_caches(client, m)
    if kind == "FourierRotaryEmbedding":
        return {"cos_sin_cache": fope_cache(client, m)}
    if kind == "Llama4VisionRotaryEmbedding":
        dim, patches = int(m.rotary_dim), int(m.max_position_embeddings)
        double = m.cos_sin_cache.dtype == torch.complex128
        return {
            "cos_sin_cache": llama4_vision_cache(client, dim, patches, float(m.base), double, None)
        }
    return None


@dataclass(frozen=True)
class Run:
    """Rows of one posenc table: positions ``start`` to ``start + rows - 1``."""

    spec: posenc.Spec
    rows: int
    start: int = 0


@dataclass(frozen=True)
class Plan:
    """A cache made of posenc tables: its runs, concatenated along the rows.

    ``kept``: the frequencies after the first ``kept`` are zero in the module (Gemma 4's
    proportional rope pads them): their columns are cos 1, sin 0, whatever the table holds.
    """

    runs: tuple[Run, ...]
    kept: int | None = None

    @property
    def rows(self) -> int:
        """The cache's row count."""
        return sum(run.rows for run in self.runs)

    def grown(self, rows: int) -> Plan:
        """This plan with ``rows`` more rows of its last table (a cache an engine extends
        continues its last table at the next positions)."""
        last = self.runs[-1]
        return replace(self, runs=(*self.runs[:-1], replace(last, rows=last.rows + rows)))


def rows_of(length: float) -> int:
    """Rows of ``torch.arange(length)``, as the engines size their caches (``max_position *
    factor`` may be a float: arange counts up to its ceiling)."""
    return math.ceil(length)


def _zero_frequencies(cache: Any, kept: int) -> None:
    """Columns of frequencies past ``kept``: cos 1, sin 0 (their angle is 0 everywhere)."""
    half = cache.shape[-1] // 2
    cache[..., kept:half] = 1
    cache[..., half + kept :] = 0


def fetch_rows(
    client: posenc.Client, plan: Plan, first: int, rows: int, dtype: Any
) -> np.ndarray[Any, Any]:
    """Rows ``first`` to ``first + rows - 1`` of the plan's cache, as a numpy array in
    ``dtype`` (computed by the server in it)."""
    element = numpy_dtype(dtype)
    pieces = []
    row = 0
    for run in plan.runs:
        low, high = max(first, row), min(first + rows, row + run.rows)
        if low < high:
            start = run.start + low - row
            pieces.append(client.get_range(start, start + high - low, run.spec, dtype=element))
        row += run.rows
    cache = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    if plan.kept is not None:
        _zero_frequencies(cache, plan.kept)
    return cache


def fetch(client: posenc.Client, plan: Plan, dtype: Any, device: Any = None) -> Any:
    """The plan's whole cache as a tensor in ``dtype`` on ``device`` (default CPU)."""
    if len(plan.runs) == 1 and plan.kept is None:
        run = plan.runs[0]
        return client.get_range(
            run.start, run.start + run.rows, run.spec, dtype=dtype, device=device or "cpu"
        )
    # Several tables, one after the other: each fetched straight into its rows.
    element = numpy_dtype(dtype)
    first = plan.runs[0]
    head = client.get_range(first.start, first.start + first.rows, first.spec, dtype=element)
    cache = np.empty((plan.rows, head.shape[1]), dtype=element)
    cache[: len(head)] = head
    row = len(head)
    for run in plan.runs[1:]:
        client.get_range(run.start, run.start + run.rows, run.spec, out=cache[row : row + run.rows])
        row += run.rows
    if plan.kept is not None:
        _zero_frequencies(cache, plan.kept)
    return as_tensor(cache, device)


def release_of(package: str) -> tuple[str, tuple[int, ...] | None]:
    """The version of an imported ``package`` and its leading numbers ("" if not imported)."""
    module = sys.modules.get(package)
    version = str(getattr(module, "__version__", "") or "")
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    return version, tuple(int(part) for part in match[1].split(".")) if match else None


@dataclass(frozen=True)
class Releases:
    """The releases of an engine an integration is tested against, both ends included, as
    leading version numbers: ``(0, 33)`` to ``(0, 34)`` takes in every 0.33.x and 0.34.x."""

    engine: str
    package: str
    oldest: tuple[int, ...]
    newest: tuple[int, ...]

    def __str__(self) -> str:
        def name(release: tuple[int, ...]) -> str:
            return ".".join(map(str, release))

        return f"{self.engine} {name(self.oldest)} to {name(self.newest)}"

    def untested(self) -> str | None:
        """The running release when it is outside the window (None inside it, or when the
        engine is not imported: modules of the caller's own)."""
        version, release = release_of(self.package)
        if not version:
            return None
        if release is not None and self.oldest <= release[: len(self.oldest)] <= self.newest:
            return None
        return version

    def warn(self, what: str | None = None, stacklevel: int = 3) -> str | None:
        """Warns (once per call site of the caller ``stacklevel - 2`` frames up) when the
        running release is outside the window; returns it, else None. ``what``: the part
        of posenc that is untested there (default the engine's integration)."""
        version = self.untested()
        if version is not None:
            warnings.warn(
                f"{self.engine} {version} is outside the releases posenc's "
                f"{what or self.engine + ' integration'} is tested "
                f"against ({self}); each cache is still compared with the module's own rows "
                "when installed, and refused if one differs",
                UntestedReleaseWarning,
                stacklevel=stacklevel,
            )
        return version


def _first_difference(
    buffer: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor
) -> tuple[int, int, float, float] | None:
    """The first ``(row, column)`` where ``cache`` is not ``buffer`` within both dtypes'
    rounding and the engine's float32 angle error (row ``r`` is position ``positions[r]``,
    one per row compared), with posenc's value and the module's there; None when all agree."""
    rows = len(positions)
    theirs, ours = buffer[:rows].detach().cpu(), cache[:rows].detach().cpu()
    if theirs.is_complex():
        theirs, ours = torch.view_as_real(theirs), torch.view_as_real(ours)
    theirs, ours = theirs.to(torch.float64).flatten(1), ours.to(torch.float64).flatten(1)
    scale = float(theirs.abs().max())
    real = buffer.real if buffer.is_complex() else buffer
    mine = cache.real if cache.is_complex() else cache
    slack = torch.finfo(real.dtype).eps + torch.finfo(mine.dtype).eps
    where = positions.to(torch.float64).abs()[:, None] + 1
    allowed = scale * (slack + 2.0**-20 * where)
    bad = ~((ours - theirs).abs() <= allowed)
    if not bool(bad.any()):
        return None
    row, column = divmod(int(bad.flatten().nonzero()[0]), ours.shape[1])
    return row, column, float(ours[row, column]), float(theirs[row, column])


def check_rows(
    releases: Releases,
    module: str,
    name: str,
    buffer: torch.Tensor,
    cache: torch.Tensor,
    start: int = 0,
    positions: torch.Tensor | None = None,
) -> None:
    """Refuses a cache that is not the module's table: its leading rows must equal the
    module's own within both dtypes' rounding and the engine's float32 angle error (row
    ``r`` is position ``start + r``, or ``positions[r]``).

    Raises:
        posenc.InvalidArgumentError: A row differs (``module`` and the row named).
    """
    rows = min(len(buffer), VERIFY_ROWS)
    if rows == 0:
        return
    if positions is None:
        positions = torch.arange(start, start + rows)
    difference = _first_difference(buffer, cache, positions[:rows])
    if difference is None:
        return
    row, column, ours, theirs = difference
    found = (
        f"{module}.{name} row {row} (position {int(positions[row])}), column {column} is "
        f"{ours:.6g} in posenc's table and {theirs:.6g} in the module"
    )
    version = releases.untested()
    if version is not None:
        raise violation(
            name,
            f"{found}: {releases.engine} {version}, outside the releases tested ({releases}), "
            "builds this module's cache another way; the module keeps its own",
        )
    raise violation(
        name,
        f"{found}: the cache is not the table this module was built with (check rope_theta, "
        "the scaling and max_position against its get_rope call); verify=False installs it "
        "anyway",
    )


def copy_caches(module: torch.nn.Module, caches: Mapping[str, torch.Tensor]) -> None:
    """Copies each cache into the module's buffer of that name, in place (its dtype and
    device kept: views of the buffer, such as a fused kernel's, see the new rows)."""
    with torch.no_grad():
        for name, cache in caches.items():
            buffer = getattr(module, name)
            buffer.copy_(cache.to(buffer.device))


def check_shapes(module: torch.nn.Module, caches: Mapping[str, torch.Tensor]) -> None:
    """Refuses caches whose shape is not their buffer's (or a buffer that is missing)."""
    for name, cache in caches.items():
        buffer = getattr(module, name, None)
        if not isinstance(buffer, torch.Tensor):
            raise violation(name, f"{type(module).__name__} holds no {name} buffer")
        if tuple(buffer.shape) != tuple(cache.shape):
            raise violation(
                name, f"has shape {tuple(buffer.shape)}, the cache {tuple(cache.shape)}"
            )


# Builds a module's caches (buffer name -> tensor) from its own attributes.
_Build = Callable[[posenc.Client, torch.nn.Module], dict[str, torch.Tensor]]
# Writes caches into a module; the client is the one the rows it grows later come from.
_Write = Callable[[torch.nn.Module, Mapping[str, torch.Tensor], posenc.Client | None], None]
# A module to install: its name, the module and its caches, built and checked.
_Pending = tuple[str, torch.nn.Module, dict[str, torch.Tensor]]


def _still_left(pending: list[_Pending], left: list[tuple[str, list[torch.Tensor]]]) -> list[str]:
    """The names of the modules left, but for those holding the memory of a cache installed
    here: one such (a fused kernel's view of the rotary module's buffer) reads posenc's rows."""
    written = {getattr(m, b).data_ptr() for _, m, built in pending for b in built}
    return [n for n, held in left if not any(b.data_ptr() in written for b in held)]


@dataclass(frozen=True)
class Engine:
    """An engine's integration as its module declares it, and what each does alike: which
    modules are served, checking caches against a module's own rows, installing them.

    ``served``: the rotary classes posenc serves in the engine; ``buffers``: the names of
    the buffers its rotary modules hold caches in; ``log``: the integration's logger, where
    :meth:`install_model` names what it installed and what it left.
    """

    releases: Releases
    served: frozenset[str]
    buffers: tuple[str, ...]
    log: logging.Logger

    def kind(self, module: object) -> str:
        """The served class whose cache ``module`` holds (:func:`kind_of`)."""
        return kind_of(module, self.served)

    def reason(self, module: object) -> str | None:
        """None for a module posenc serves, else why not (:func:`served_reason`)."""
        return served_reason(module, self.kind(module), self.served, self.releases.package)

    def built(
        self, client: posenc.Client, module: torch.nn.Module
    ) -> tuple[str, dict[str, torch.Tensor] | None]:
        """A served module's class, with its caches when they are no run of tables
        (:func:`built_caches`), else None: the start of a ``caches_of``.

        Raises:
            posenc.InvalidArgumentError: A class posenc does not serve.
        """
        reason = self.reason(module)
        if reason is not None:
            raise violation("rotary_emb", reason)
        kind = self.kind(module)
        return kind, built_caches(client, module, kind)

    def single(self, module: torch.nn.Module) -> str:
        """The class of a module whose one cache a ``cos_sin_cache_of`` builds, once the
        release is warned about when untested.

        Raises:
            posenc.InvalidArgumentError: Dual-chunk attention's module (five caches).
        """
        # Frames: Releases.warn, this, cos_sin_cache_of, its reads_attributes wrapper, the
        # caller: the warning names the caller's line.
        self.releases.warn(stacklevel=5)
        kind = self.kind(module)
        if kind == "DualChunkRotaryEmbedding":
            raise violation("rotary_emb", f"{kind} holds five caches: build them with caches_of")
        return kind

    def check(
        self, label: str, module: torch.nn.Module, caches: Mapping[str, torch.Tensor]
    ) -> None:
        """Refuses caches unlike the module's own (:func:`check_caches`), its row ``r`` the
        position ``position_start + r`` (SGLang's modules that start at a negative
        position; 0 for a module with no ``position_start``, as every vLLM class)."""
        start = int(getattr(module, "position_start", 0))
        check_caches(self.releases, label, module, caches, start)

    def install(
        self,
        module: torch.nn.Module,
        caches: Mapping[str, torch.Tensor],
        write: _Write,
        *,
        verify: bool,
        client: posenc.Client | None = None,
    ) -> None:
        """Writes ``caches`` into a module with ``write`` once :meth:`check` (``verify``) or
        the shapes alone accept them (an integration's ``install``)."""
        # Outside the tested releases the check is the guard: it runs whatever verify says.
        if verify or self.releases.warn(stacklevel=5) is not None:
            self.check("", module, caches)
        else:
            check_shapes(module, caches)
        write(module, caches, client)

    def install_model(
        self,
        client: posenc.Client,
        model: torch.nn.Module,
        build: _Build,
        write: _Write,
        *,
        verify: bool,
    ) -> list[str]:
        """Installs posenc's caches into every rotary module of ``model`` it serves (an
        integration's ``install_model``).

        ``build`` makes a served module's caches, :meth:`check` refuses ones that differ from
        the module's own (when ``verify``, and always outside the tested releases), ``write``
        writes them. Every cache is built and checked before any is written: a refusal
        leaves the model as it was. Modules holding one of the engine's ``buffers`` that are
        not served are left alone and logged with the reason.

        Returns:
            The name of each module installed (the first, for a module shared by several).

        Raises:
            posenc.InvalidArgumentError: No served rotary module, or a cache that differs.
        """
        # Outside the tested releases the check is the guard: it runs whatever verify says.
        verify = self.releases.warn(stacklevel=5) is not None or verify
        pending, left = self._walk(client, model, build, verify)
        left_names = _still_left(pending, left)
        if not pending:
            detail = f"; left: {'; '.join(left_names)}" if left_names else ""
            raise violation(
                "model", f"{type(model).__name__} holds no rotary module posenc serves{detail}"
            )
        for _, module, built in pending:
            write(module, built, client)
        installed = ", ".join(name for name, _, _ in pending)
        if left_names:
            self.log.warning(
                "posenc installed %s; left with their own caches: %s",
                installed,
                "; ".join(left_names),
            )
        else:
            self.log.info("posenc installed %s", installed)
        return [name for name, _, _ in pending]

    def _walk(
        self, client: posenc.Client, model: torch.nn.Module, build: _Build, verify: bool
    ) -> tuple[list[_Pending], list[tuple[str, list[torch.Tensor]]]]:
        """Each distinct module of ``model`` holding one of the buffers: to install (its
        caches built and, ``verify``, checked), or left (named with the reason, with the
        buffers it holds)."""
        pending: list[_Pending] = []
        left: list[tuple[str, list[torch.Tensor]]] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            buffers = [getattr(module, b, None) for b in self.buffers]
            held = [b for b in buffers if isinstance(b, torch.Tensor)]
            if not held or id(module) in seen:
                continue
            seen.add(id(module))
            built = self._prepare(client, name, module, build, verify)
            if isinstance(built, str):
                left.append((f"{name} ({type(module).__name__}: {built})", held))
            else:
                pending.append((name, module, built))
        return pending, left

    def _prepare(
        self,
        client: posenc.Client,
        name: str,
        module: torch.nn.Module,
        build: _Build,
        verify: bool,
    ) -> dict[str, torch.Tensor] | str:
        """A module's caches, built and (``verify``) checked, or why it keeps its own."""
        reason = self.reason(module)
        if reason is not None:
            return reason
        try:
            built = build(client, module)
        except posenc.InvalidArgumentError as error:
            # A class or a setting posenc has no table for: the module keeps its own.
            return error.field_violations[0][1] if error.field_violations else str(error)
        if verify:
            self.check(name, module, built)
        return built


# -- caches that are no run of tables (the same classes in vLLM and SGLang) --------------


def llama4_vision_cache(
    client: posenc.Client,
    dim: int,
    patches: int,
    theta: float,
    double: bool,
    device: Any,
) -> torch.Tensor:
    """Llama4VisionRotaryEmbedding's complex cache ``[patches + 1, 1, dim]``: patch ``k`` at
    ``(x, y) = (k % side, k // side)`` rotates by ``(x + 1) * f`` then ``(y + 1) * f`` for
    the ``dim / 2`` default frequencies ``f``; the last row (the class token) by 0."""
    side = int(math.sqrt(patches))
    real = torch.float64 if double else torch.float32
    table = client.get_range(0, side + 1, rotary(dim, theta), dtype=real)
    cos, sin = table.chunk(2, dim=-1)
    index = torch.arange(patches)
    x, y = index % side + 1, index // side + 1
    angles = torch.complex(torch.cat([cos[x], cos[y]], -1), torch.cat([sin[x], sin[y]], -1))
    cls = torch.ones(1, dim, dtype=angles.dtype)
    return torch.cat([angles, cls])[:, None, :].to(device or "cpu")


def dual_chunk_caches(client: posenc.Client, m: Any) -> dict[str, torch.Tensor]:
    """DualChunkRotaryEmbedding's five caches, rows of one default table: ``q`` positions
    ``0 .. c - 1`` (``c = chunk_size - local_size``), ``qc`` ``min(p + c, chunk_size)``, ``k``
    ``p % c`` for every ``p < max_position``, ``qc_no_clamp`` ``p + c``, ``q_inter``
    ``p + chunk_size``."""
    buffer = m.cos_sin_q_cache
    positions = dual_chunk_positions(m)
    table = client.get_range(
        0,
        int(m.chunk_size) * 2,
        rotary(int(m.rotary_dim), float(m.base)),
        dtype=buffer.dtype,
    )
    return {name: table[rows] for name, rows in positions.items()}


def dual_chunk_positions(m: Any) -> dict[str, torch.Tensor]:
    """The positions of each row of a dual-chunk module's five caches (below
    ``2 * chunk_size``)."""
    chunk = int(m.chunk_size)
    c = chunk - int(m.local_size)
    p = torch.arange(c)
    return {
        "cos_sin_q_cache": p,
        "cos_sin_qc_cache": (p + c).clamp(max=chunk),
        "cos_sin_k_cache": torch.arange(int(m.max_position_embeddings)) % c,
        "cos_sin_qc_no_clamp_cache": p + c,
        "cos_sin_q_inter_cache": p + chunk,
    }


def fope_cache(client: posenc.Client, m: Any) -> torch.Tensor:
    """FourierRotaryEmbedding's cache: the module's selected frequencies (the first
    ``inv_freq.shape[-1]`` default ones) at exact angles, mixed by its learned ``cos_coef``
    / ``sin_coef`` in float64, padded with 1 to ``head_size / 2``, halves repeated, one
    rounding to the buffer's dtype."""
    n = int(m.inv_freq.shape[-1])
    dim, rows = int(m.rotary_dim), int(m.max_position_embeddings)
    table = client.get_range(0, rows, rotary(dim, float(m.base)), dtype=torch.float64)
    cos, sin = table[:, :n], table[:, dim // 2 : dim // 2 + n]
    cos_coef, sin_coef = m.cos_coef.detach().cpu().double(), m.sin_coef.detach().cpu().double()
    if bool(m.fope_sep_head):
        cos = torch.einsum("tD,hDd->thd", cos, cos_coef)
        sin = torch.einsum("tD,hDd->thd", sin, sin_coef)
    else:
        cos, sin = cos @ cos_coef, sin @ sin_coef
    half = int(m.head_size) // 2
    cos = torch.nn.functional.pad(cos, (0, half - cos.shape[-1]), value=1.0)
    sin = torch.nn.functional.pad(sin, (0, half - sin.shape[-1]), value=1.0)
    buffer = m.cos_sin_cache
    return torch.cat((cos, cos, sin, sin), dim=-1).to(buffer.dtype)


def own_rows(rotary_emb: torch.nn.Module, name: str) -> torch.Tensor:
    """The module's own values of a buffer. FoPE's buffer holds the rows its coefficients
    gave at construction (before the weights were loaded): they are recomputed, as its
    first forward would."""
    m: Any = rotary_emb
    if descends(m, "FourierRotaryEmbedding") and name == "cos_sin_cache":
        with torch.no_grad():
            own: torch.Tensor = m._compute_cos_sin_cache().to(m.cos_sin_cache.dtype)
            return own
    buffer: torch.Tensor = getattr(m, name)
    return buffer


def check_caches(
    releases: Releases,
    label: str,
    rotary_emb: torch.nn.Module,
    caches: Mapping[str, torch.Tensor],
    start: int = 0,
) -> None:
    """Refuses caches of another shape than their buffers, or other values than the
    module's own (:func:`check_rows`; row ``r`` is position ``start + r``, dual-chunk
    attention's rows their own positions)."""
    check_shapes(rotary_emb, caches)
    dual = descends(rotary_emb, "DualChunkRotaryEmbedding")
    positions = dual_chunk_positions(rotary_emb) if dual else {}
    for name, cache in caches.items():
        own = own_rows(rotary_emb, name)
        label = label or type(rotary_emb).__name__
        check_rows(releases, label, name, own, cache, start, positions.get(name))
