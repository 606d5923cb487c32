"""One call that makes a transformers model use posenc's exact positional tables.

::

    from posenc.integrations.transformers import patch

    with posenc.Client(target) as client, patch(model, client):
        model.generate(...)          # every forward takes its tables from posenc

:func:`patch` takes the model as loaded (``...ForCausalLM``, ``...ForConditionalGeneration``
or any module holding one), reads its config, builds the spec of each text positional table
it holds, checks it against the model's own table at small positions, and replaces that
table:

- M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the merged ``(cos, sin)`` of the ``[3, batch,
  seq]`` position ids; text positions from a growing table of the plain rotary spec (their
  rows), image and video positions by their coordinates;
- rotary families (Llama 3 / 4, Mistral, Ministral, Mixtral, Qwen2 / 3, Phi-3 / 4, Gemma 1-3,
  GPT-NeoX, GPT-J, GPT-OSS, DeepSeek-V2 / V3 and any model built on transformers' standard
  rotary module, one table per layer type included): ``(cos, sin)`` for the
  ``position_ids`` of each forward come from a :class:`posenc.GrowingTable`, in the dtype
  of the hidden states and the width the model's own module returns. ``dynamic`` and
  ``longrope`` follow transformers' own ``seq_len`` rule (longrope's two tables are held once
  each; a dynamic table recomputed for a new ``seq_len`` is fetched for those positions);
- sinusoidal families (Whisper's encoder, M2M100/NLLB, Speech2Text, Marian, Pegasus, XLM):
  the model's table is replaced by posenc's rows, and grows from posenc when an input
  outgrows it (never from the model's own float32 formula).

Vision towers' rotary tables (rope type ``axial``: Qwen-VL's patches, Llama 4's and
Pixtral's 2D tables) and other position modules posenc does not serve alone are left as
they are: :attr:`Patch.skipped` names each, and the ``posenc.integrations.transformers``
logger says what was patched and what was left.

Under ``torch.compile`` a rotary module's rows are one custom op (``posenc::rotary_rows``),
opaque to the compiler and run as the SDK's Python at each call: a compiled patched model
has no graph break there; GPT-J's attention (before transformers 5.24) and the sinusoidal
tables' growth are ``torch.compiler.disable``-d (graph breaks).
A patched model can be deep-copied (the copy is patched too and shares the client); pickling
it (``torch.save(model)``) is refused with a message saying what to save instead, and its
``state_dict`` holds nothing of posenc's.

A rotary module's table is verified at load against the module's own output at positions
below 64, with the position-id shapes it takes (``[axes, batch, seq]`` for a module merging
several axes), in the column order it returns. A rope type posenc does not compute (or a
config it cannot match), in a module of the standard form (an ``inv_freq`` buffer and an
attention scaling, cos and sin of position x inv_freq), is served exactly for the float32
frequencies the module holds, with a :class:`ModuleFrequenciesWarning` naming the type; a
rotary module of another form is left alone and named in :attr:`Patch.skipped`, with why.

The transformers releases this is tested against: :data:`TRANSFORMERS_RELEASES`. Another
release is served the same way, verified whatever ``verify`` says, with an
:class:`UntestedReleaseWarning` naming the tested window: a table that agrees with the
module's own is served, one that differs refused in one line naming the module, the row and
the column. No release is refused for its version alone. The returned :class:`Patch`
undoes every change (``undo()``, or leaving its ``with`` block). Importing this module
imports torch, not transformers: models are recognised by the modules they hold.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import re
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch
from torch import nn

import posenc
from posenc._configs import config_dict, table_from_config
from posenc._output import as_tensor
from posenc.integrations._patch import Patched
from posenc.table import DEFAULT_MAX_BYTES, DEFAULT_MIN_ROWS, GrowingTable

__all__ = [
    "TRANSFORMERS_RELEASES",
    "ModuleFrequenciesWarning",
    "Patch",
    "UntestedReleaseWarning",
    "patch",
]

_log = logging.getLogger(__name__)

#: The transformers releases :func:`patch` is tested against: from the first (inclusive) to
#: the second (exclusive), as ``(major, minor)``; the ``transformers`` extra declares the same.
TRANSFORMERS_RELEASES: Final = ((5, 17), (5, 26))

_SERVED: Final = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
# Rows compared with the model's own table when patching: positions where float32 is exact
# to a few ulps, so a difference means a misread config, not rounding.
_VERIFY_ROWS: Final = 64
_VERIFY_TOLERANCE: Final = 2e-4
# The column orders a rotary module's output may have: transformers' halves, GPT-J's pairs
# (Cohere's rotary module), vLLM's one half (GPT-OSS, DeepSeek-V4, complex frequencies).
_LAYOUTS: Final = ("transformers", "gptj", "vllm")
# Distinct dynamic-NTK specs remembered per module (one per seq_len a forward reached).
_SPECS_KEPT: Final = 8
# The attribute of a patched module holding what its patched methods need.
_STATE: Final = "_posenc_patch"
# Position modules of other kinds, named in Patch.skipped when left alone.
_POSITIONAL: Final = re.compile(r"rotary|position(al)?_?emb|pos_?emb", re.IGNORECASE)

_NOT_PICKLED: Final = (
    "a model patched by posenc.integrations.transformers holds a live posenc client and "
    "cannot be pickled: save model.state_dict() (it holds nothing of posenc's), or call "
    "undo() on the patch before torch.save(model) and patch the loaded model again"
)


class UntestedReleaseWarning(UserWarning):
    """The installed transformers is outside :data:`TRANSFORMERS_RELEASES`."""


def _served(dtype: torch.dtype) -> torch.dtype:
    """The dtype tables are fetched in for hidden states of ``dtype`` (others: float32)."""
    return dtype if dtype in _SERVED else torch.float32


def _release() -> tuple[str, tuple[int, int] | None]:
    """The transformers version the models come from, and its ``(major, minor)``."""
    module = sys.modules.get("transformers")
    version = str(getattr(module, "__version__", "") or "")
    match = re.match(r"(\d+)\.(\d+)", version)
    return version, (int(match[1]), int(match[2])) if match else None


def _check_release(verify: bool) -> bool:
    """Whether to verify: always outside :data:`TRANSFORMERS_RELEASES` (said in a warning),
    where each table served must agree with the model's own, else as the caller asked."""
    version, release = _release()
    if not version:  # no transformers imported: modules of the caller's own
        return verify
    low, high = TRANSFORMERS_RELEASES
    if release is not None and low <= release < high:
        return verify
    supported = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    overridden = "" if verify else " (verify=False is overridden outside that window)"
    warnings.warn(
        f"transformers {version} is outside the releases posenc's patch is tested against "
        f"({supported}): each table is compared with the model's own at positions below "
        f"{_VERIFY_ROWS}, served where it agrees and refused where it differs{overridden}",
        UntestedReleaseWarning,
        stacklevel=3,
    )
    return True


class ModuleFrequenciesWarning(UserWarning):
    """A rotary module is served for the frequencies it holds: its rope type (named in the
    message) is one posenc does not compute, or its config could not be matched."""


class Patch(Patched):
    """What :func:`patch` changed in a model: undone by :meth:`undo` or on leaving a ``with``.

    Deep copies of the model made while patched stay patched: :meth:`undo` restores this
    model only.

    Attributes:
        specs: The spec of each replaced table, by module name (``""`` is the model;
            ``name:layer_type`` for a module holding one table per layer type).
        skipped: The position modules left as they are, by module name, each with the
            reason (a vision tower's table, a learned embedding, ...).
    """

    def __init__(self, client: posenc.Client, *, min_rows: int, max_table_bytes: int) -> None:
        super().__init__(client)
        self._min_rows = min_rows
        self._max_table_bytes = max_table_bytes
        self._tables: dict[tuple[posenc.Spec, torch.dtype], GrowingTable] = {}

    def table(self, spec: posenc.Spec, dtype: torch.dtype) -> GrowingTable:
        """The growing table of ``spec`` in ``dtype``, one per pair, shared by every module
        that uses it (e.g. an encoder and a decoder)."""
        key = (spec, dtype)
        table = self._tables.get(key)
        if table is None:
            table = GrowingTable(
                self.client,
                spec,
                dtype=dtype,
                min_rows=self._min_rows,
                max_bytes=self._max_table_bytes,
            )
            self._tables[key] = table
        return table

    @property
    def tables(self) -> list[GrowingTable]:
        """The growing tables the patched modules read from."""
        return list(self._tables.values())

    def _forget(self) -> None:
        self._tables.clear()

    def __deepcopy__(self, memo: dict[int, Any]) -> Patch:
        return self  # a deep copy of a patched model shares the patch (and its client)

    def __reduce__(self) -> Any:
        raise TypeError(_NOT_PICKLED)

    # -- replacing attributes, undoably -------------------------------------------------------

    def _bind(self, module: nn.Module, name: str, function: Callable[..., Any]) -> None:
        """Makes ``function(module, ...)`` the module's method ``name``: bound to the module,
        so that a deep copy of the model binds it to the copy."""
        self._override(module, name, types.MethodType(function, module))


class _State:
    """What a patched module's methods need, held by the module (``_posenc_patch``).

    A deep copy of the model copies it (the copy's caches are its own; the patch, client and
    tables are shared); pickling it is refused with a message saying what to save.
    """

    handle: Patch
    key: int = 0  # in _LIVE, for the compiled forward's custom op

    def _register(self) -> None:
        self.key = next(_KEYS)
        _LIVE[self.key] = self

    def _fresh(self) -> None:
        """Gives a copy its own mutable caches."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _State:
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._fresh()
        clone._register()
        return clone

    def __reduce__(self) -> Any:
        raise TypeError(_NOT_PICKLED)


def _patch_module(handle: Patch, name: str, module: nn.Module, config: Any, verify: bool) -> bool:
    """Patches ``module`` if it holds a table posenc serves (or says in ``handle.skipped``
    why not); True when it was replaced whole, children included."""
    model_type = str(getattr(config, "model_type", "") or "")
    if _is_rotary(module):
        reason = _vision_reason(module) or _Rotary(handle, name, module).install(verify)
        if reason:
            handle.skipped[name] = reason
    elif _is_gptj_rotary(module):
        _GPTJRotary(handle, name, module, config).install(verify)
    elif _is_gptj_attention(module):
        _GPTJAttention(handle, name, module).install(verify)
        return True
    elif _is_fairseq(module):
        _patch_fairseq(handle, name, module, verify)
    elif _is_split_embedding(module):
        _patch_split(handle, name, module, verify)
    elif model_type == "whisper" and type(module).__name__.endswith("WhisperEncoder"):
        _patch_whisper(handle, name, module, verify)
        return True
    elif _is_xlm(module):
        _patch_xlm(handle, name, module, verify)
        return True
    elif name and _POSITIONAL.search(f"{type(module).__name__} {name.rsplit('.', 1)[-1]}"):
        handle.skipped[name] = _other_reason(module)
    return False


def _state(module: nn.Module) -> Any:
    return module.__dict__[_STATE]


# The states of patched rotary modules, by key: the custom op of a compiled forward finds
# its module's state here (an op takes tensors and numbers, not Python objects).
_LIVE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def patch(
    model: nn.Module,
    client: posenc.Client,
    *,
    verify: bool = True,
    min_rows: int = DEFAULT_MIN_ROWS,
    max_table_bytes: int = DEFAULT_MAX_BYTES,
) -> Patch:
    """Makes every forward (and ``generate``) of ``model`` use posenc's exact tables.

    Args:
        model: A transformers ``PreTrainedModel`` as loaded (or built from a config):
            ``...ForCausalLM``, ``...ForConditionalGeneration``, or any module holding one.
        client: The :class:`posenc.Client` tables are fetched with; it must stay open while
            the model runs patched.
        verify: Compare each table with the model's own at positions below 64 before
            replacing it, refusing (``ValueError``) a difference beyond float32 rounding:
            the sign of a config read differently from the model. ``False`` serves a
            rotary table in the column order that fits the module best even if it differs;
            outside :data:`TRANSFORMERS_RELEASES` tables are verified anyway.
        min_rows: First size of each growing table (rows from position 0).
        max_table_bytes: Memory cap of each growing table; rows past it are fetched per
            forward.

    Returns:
        The :class:`Patch`: ``undo()`` (or use it as a context manager) restores the model;
        ``specs`` names what was replaced and ``skipped`` what was left alone.

    Raises:
        ValueError: The model holds no table posenc serves, or (``verify``) a table differs
            from the model's own (one line: the module, its rope type, the row and column).

    Warns:
        UntestedReleaseWarning: transformers is outside :data:`TRANSFORMERS_RELEASES`.
        ModuleFrequenciesWarning: A rotary module is served for the frequencies it holds.
    """
    verify = _check_release(verify)
    handle = Patch(client, min_rows=min_rows, max_table_bytes=max_table_bytes)
    config = getattr(model, "config", None)
    inside: list[str] = []  # modules replaced whole: their children are theirs
    try:
        for name, module in model.named_modules():
            if any(name.startswith(f"{outer}.") for outer in inside):
                continue
            if _patch_module(handle, name, module, config, verify):
                inside.append(name)
    except BaseException:
        handle.undo()
        raise
    if not handle.specs:
        left = "".join(f"; {name}: {why}" for name, why in handle.skipped.items())
        raise ValueError(f"{type(model).__name__} holds no positional table posenc serves{left}")
    _log.info(
        "posenc patched %s: %s; left alone: %s",
        type(model).__name__,
        ", ".join(f"{name or 'model'} ({spec.kind})" for name, spec in handle.specs.items()),
        ", ".join(f"{name} ({why})" for name, why in handle.skipped.items()) or "nothing",
    )
    return handle


# -- recognising modules --------------------------------------------------------------------------


def _inv_freq(module: nn.Module) -> torch.Tensor | None:
    """The rotary module's inverse frequencies (``inv_freq``, or the first of Gemma 3's
    ``{layer_type}_inv_freq``)."""
    inv_freq = getattr(module, "inv_freq", None)
    if isinstance(inv_freq, torch.Tensor):
        return inv_freq
    for name, buffer in module.named_buffers(recurse=False):
        if name.endswith("_inv_freq") and "original" not in name:
            return buffer
    return None


def _is_rotary(module: nn.Module) -> bool:
    # transformers' standard rotary module: inv_freq (per layer type: Gemma 3), rope_type and
    # config, forward(x, position_ids[, layer_type]).
    return (
        hasattr(module, "rope_type") and hasattr(module, "config") and _inv_freq(module) is not None
    )


def _vision_reason(module: nn.Module) -> str:
    """Why a rotary module is a vision tower's, left alone ("" for a text one)."""
    rope_type = module.rope_type
    kinds = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
    model_type = str(getattr(module.config, "model_type", "") or "")
    if "axial" in kinds:
        return "a vision tower's rotary table (rope type 'axial'): not served"
    if "vision" in model_type or "Vision" in type(module).__name__:
        return f"a vision tower's rotary table ({type(module).__name__}): not served"
    return ""


def _other_reason(module: nn.Module) -> str:
    name = type(module).__name__
    if isinstance(module, nn.Embedding):
        return "learned position embeddings (nn.Embedding): nothing to compute"
    if "Vision" in name or "Patch" in name:
        return f"a vision tower's position table ({name}): not served"
    return f"{name}: not a table posenc serves"


def _is_gptj_rotary(module: nn.Module) -> bool:
    # transformers 5.24's GPTJRotaryEmbedding: embed_positions [max, sin | cos] and
    # forward(x, position_ids) -> (sin, cos).
    return (
        isinstance(getattr(module, "embed_positions", None), torch.Tensor)
        and hasattr(module, "pos_embd_dim")
        and not hasattr(module, "rotary_dim")
    )


def _is_gptj_attention(module: nn.Module) -> bool:
    # GPT-J's attention up to transformers 5.2x: embed_positions and _get_embed_positions.
    return (
        isinstance(getattr(module, "embed_positions", None), torch.Tensor)
        and hasattr(module, "rotary_dim")
        and callable(getattr(module, "_get_embed_positions", None))
    )


def _is_fairseq(module: nn.Module) -> bool:
    # fairseq's SinusoidalPositionalEmbedding ports (M2M100, NLLB, Speech2Text): a weights
    # buffer that forward rebuilds with make_weights when an input outgrows it.
    return (
        isinstance(getattr(module, "weights", None), torch.Tensor)
        and callable(getattr(module, "make_weights", None))
        and hasattr(module, "padding_idx")
        and hasattr(module, "embedding_dim")
    )


def _is_split_embedding(module: nn.Module) -> bool:
    # Marian's and Pegasus' SinusoidalPositionalEmbedding: an nn.Embedding of [sin | cos].
    return isinstance(module, nn.Embedding) and callable(getattr(module, "create_weight", None))


def _is_xlm(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (
        isinstance(getattr(module, "position_embeddings", None), nn.Embedding)
        and isinstance(getattr(module, "position_ids", None), torch.Tensor)
        and bool(getattr(config, "sinusoidal_embeddings", False))
    )


def _difference(ours: torch.Tensor, theirs: torch.Tensor, *, halves: bool = False) -> str:
    """Where two tables of equal shape first differ beyond float32 rounding ("" if nowhere):
    the row (its position, from 0) and the column (of cos or of sin for ``[cos | sin]``
    rows), with both values."""
    if not ours.numel():
        return ""
    width = ours.shape[-1]
    mine, native = (t.double().reshape(-1, width) for t in (ours, theirs))
    bad = ((mine - native).abs() > _VERIFY_TOLERANCE) | mine.isnan() | native.isnan()
    if not bool(bad.any()):
        return ""
    row, column = (int(i) for i in bad.nonzero()[0])
    where = f"column {column}"
    if halves:
        part, index = divmod(column, width // 2)
        where = f"{('cos', 'sin')[part]} column {index}"
    return (
        f"differs from the model's own at row {row}, {where}: {float(mine[row, column]):.6g} "
        f"against {float(native[row, column]):.6g}"
    )


def _check(name: str, spec: posenc.Spec, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Refuses a table that differs from the model's own at small positions."""
    if tuple(ours.shape) != tuple(theirs.shape):
        raise ValueError(
            f"{name or 'model'}: posenc's table for {spec} has shape {tuple(ours.shape)}, "
            f"the model's {tuple(theirs.shape)}"
        )
    where = _difference(ours, theirs)
    if where:
        raise ValueError(
            f"{name or 'model'}: posenc's table for {spec} {where}: the config is read "
            "differently from the model's code"
        )


# -- rotary ---------------------------------------------------------------------------------------


class _Rotary(_State):
    """The forward of a transformers rotary module, from posenc: ``(cos, sin)`` of
    ``position_ids`` (complex ``cos + i sin`` where the module returns complex frequencies:
    DeepSeek-V2, Llama 4), in the width and column order the module returns.

    Each layer type's table is the first of these that equals the module's own output at
    small positions: the spec of its config (its layer type's own config where the model
    has per-layer ones, Gemma 4's head sizes); that spec at the head size of the module's
    own frequency buffer; the module's own frequencies (``scaling="frequencies"``, the
    fallback for a rope type posenc does not compute, with a warning). Its column order is
    the one of transformers (halves), GPT-J (pairs: Cohere) or vLLM (one half: GPT-OSS,
    DeepSeek-V4) that the output has. A module that merges several position axes (M-RoPE:
    position ids ``[axes, batch, seq]``) takes each column's angle from the axis its own
    output does.
    """

    def __init__(self, handle: Patch, name: str, module: Any) -> None:
        self.handle = handle
        self.name = name
        self.config = module.config
        self.values: dict[str, Any] = {}
        self.native = type(module).forward
        self.complex = False
        # The layout and spec of each layer type's table.
        self.layouts: dict[str | None, str] = {}
        self.base: dict[str | None, posenc.Spec] = {}
        # M-RoPE by its spec (Qwen-VL, a MRopeTable spec) ...
        self.mrope = False
        # ... or by the axis of each cos and sin column of a module merging `axes` axes.
        self.axes = 0
        self.column_axes: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        # transformers' dynamic-NTK state (dynamic_rope_update), per layer type.
        self.cached: dict[str | None, int] = {}
        self.original = int(getattr(module, "original_max_seq_len", 0) or 0)
        self.specs: dict[tuple[str | None, int | None], posenc.Spec] = {}
        self.tables: dict[tuple[posenc.Spec, torch.dtype], GrowingTable] = {}
        self.module = module  # while installing only

    def _fresh(self) -> None:
        self.cached = dict(self.cached)
        self.specs = dict(self.specs)
        self.tables = dict(self.tables)

    # -- installing ---------------------------------------------------------------------------

    def install(self, verify: bool) -> str:
        """Patches the module; returns why it was left alone ("" when patched), or raises a
        one-line ValueError naming the module and what differs."""
        module = self.module
        del self.module  # the patched forward is bound to the module (or its deep copy)
        rope_type = module.rope_type
        if isinstance(rope_type, dict) and not rope_type:
            return f"{type(module).__name__}: a rotary module with no rope type per layer type"
        layer_types: list[str | None] = list(rope_type) if isinstance(rope_type, dict) else [None]
        self.rope_types = dict(rope_type) if isinstance(rope_type, dict) else rope_type
        inv_freq = _inv_freq(module)
        assert inv_freq is not None
        probe = torch.zeros(1, device=inv_freq.device)
        reference = _reference_module(module, self.config, probe.device)
        try:
            self.values = config_dict(self.config)
        except posenc.InvalidArgumentError:
            self.values = {}
        call = _Call(self.native, reference, probe)
        try:
            call.standard(layer_types)
        except _NotStandard as why:
            return f"{type(module).__name__}: {why}"
        self.axes = call.axes
        self.complex = call.complex
        chosen: dict[str | None, posenc.Spec] = {}
        for layer_type in layer_types:
            spec, layout = self._choose(call, reference, layer_type, verify)
            self.base[layer_type] = spec
            self.layouts[layer_type] = layout
            self.cached[layer_type] = int(getattr(module, "max_seq_len_cached", 0) or 0)
            chosen[layer_type] = self.spec(layer_type, None)
        for layer_type, spec in chosen.items():
            self.handle.specs[self.name if layer_type is None else f"{self.name}:{layer_type}"] = (
                spec
            )
        # The width of the module's cos (and sin), for the compiled forward's shapes.
        self.width = call.width
        self._register()
        self.handle._override(module, _STATE, self)
        self.handle._bind(module, "forward", _rotary_forward)
        return ""

    def _candidates(self, reference: Any, layer_type: str | None) -> Iterator[tuple[str, Any]]:
        """The tables a layer type may be, in order of preference: ``(why, spec)``, where
        ``spec`` is a :class:`posenc.Spec` (without its layout) or the error that stopped
        its config from giving one."""
        config_spec = yield from self._config_candidates(layer_type)
        buffer = _layer_inv_freq(reference, layer_type)
        count = 0 if buffer is None else int(buffer.numel())
        if config_spec is not None and count and _width(config_spec) != 2 * count:
            # The head size its frequency buffer was made for (a per-layer head size or
            # partial factor the config keeps elsewhere).
            parameters = config_spec.parameters
            if parameters.get("scaling") != "proportional":
                parameters.pop("partial_rotary_factor", None)
            parameters["head_dim"] = 2 * count
            with contextlib.suppress(posenc.InvalidArgumentError):
                yield "head", posenc.Spec("rotary", **parameters)
        rope_type = self.rope_type(layer_type)
        if buffer is not None and count and "dynamic" not in rope_type and rope_type != "longrope":
            scale = _attention_scaling(reference, layer_type)
            yield "frequencies", _frequencies_spec(buffer, scale)

    def _config_candidates(
        self, layer_type: str | None
    ) -> Generator[tuple[str, Any], None, posenc.Spec | None]:
        """The tables the config gives a layer type (or the errors it stops at); returns
        its plain rotary spec, if one."""
        values = self._layer_values(layer_type)
        config_spec: posenc.Spec | None = None
        # A module merging several axes: its M-RoPE spec (Qwen-VL's sections), then its
        # plain table, each column's axis read from its own output.
        for sections in (True, False) if self.axes else (True,):
            try:
                kind, parameters = table_from_config(
                    values, layout="vllm", layer_type=layer_type, sections=sections
                )
                spec = posenc.Spec(kind, **parameters)
            except posenc.InvalidArgumentError as error:
                yield "config", error
                continue
            if kind == "rotary":
                config_spec = spec
            if kind in ("rotary", "mrope"):
                yield "config", spec
        return config_spec

    def _layer_values(self, layer_type: str | None) -> dict[str, Any]:
        """The config's keys for one layer type: its own config where the model has
        per-layer ones (Gemma 4's full-attention head size), else the model's."""
        if layer_type is not None:
            per_layer = getattr(self.config, "per_layer_config", None)
            with contextlib.suppress(Exception):
                if per_layer is not None:
                    return config_dict(per_layer[layer_type])
        return self.values

    def _choose(
        self, call: _Call, reference: Any, layer_type: str | None, verify: bool
    ) -> tuple[posenc.Spec, str]:
        """The first candidate table that equals the module's own output, and its layout;
        a one-line ValueError naming the module, the rope type and what differs if none."""
        rope_type = self.rope_type(layer_type)
        native = call.text(layer_type)
        first: str = ""
        fallback: tuple[posenc.Spec, str] | None = None
        for source, candidate in self._candidates(reference, layer_type):
            if not isinstance(candidate, posenc.Spec):
                first = first or f"its config gives no table ({candidate})"
                continue
            if candidate.kind == "mrope":
                if call.axes != 3:
                    continue
                found, difference = self._match_mrope(call, layer_type, candidate)
                if found is not None:
                    return found
                first = first or difference
                continue
            layout, difference = self._match_rotary(call, native, layer_type, candidate)
            if layout and not difference:
                if source == "frequencies":
                    self._warn_frequencies(rope_type, first)
                return candidate, layout
            if layout and fallback is None:
                fallback = (candidate, layout)
            first = first or f"posenc's table for {candidate} {difference}"
        if not verify and fallback is not None:
            return fallback
        what = first or "its output is not cos and sin of position x its inv_freq"
        raise ValueError(
            f"{self.name or 'model'} ({type(reference).__name__}, rope type {rope_type!r}"
            f"{'' if layer_type is None else f', layer type {layer_type!r}'}): {what}"
        )

    def _match_mrope(
        self, call: _Call, layer_type: str | None, candidate: posenc.Spec
    ) -> tuple[tuple[posenc.Spec, str] | None, str]:
        """The M-RoPE spec and layout whose rows equal the module's, or where the last
        layout tried differs."""
        difference = ""
        for layout in _LAYOUTS:
            spec = posenc.Spec("mrope", **(candidate.parameters | {"layout": layout}))
            try:
                difference = self._check_mrope(call, layer_type, spec)
            except posenc.InvalidArgumentError as error:
                difference = f"(refused: {error})"
            if not difference:
                self.mrope = True
                return (spec, layout), ""
        return None, f"posenc's table for {spec} {difference}"

    def _match_rotary(
        self, call: _Call, native: Any, layer_type: str | None, spec: posenc.Spec
    ) -> tuple[str, str]:
        """The layout in which the spec's rows are the module's ("" if none), and where
        they differ ("" where they do not)."""
        try:
            cos, sin = self.handle.client.get_positions(
                call.positions, spec, dtype=torch.float32, cos_sin=True
            )
        except posenc.InvalidArgumentError as error:
            return "", f"is refused ({error})"
        layout, difference = _match_layout(cos, sin, native)
        if layout and call.axes:
            self.column_axes[layer_type] = call.column_axes(layer_type)
            difference = self._check_axes(call, layer_type, spec, layout)
        return layout, difference

    def _warn_frequencies(self, rope_type: str, why: str) -> None:
        warnings.warn(
            f"{self.name or 'model'}: rope type {rope_type!r} is served for the float32 "
            f"frequencies its module holds (exact angles of those values), not computed from "
            f"its config ({why or 'a rope type posenc does not compute'})",
            ModuleFrequenciesWarning,
            stacklevel=6,  # patch()'s caller
        )

    def _check_mrope(self, call: _Call, layer_type: str | None, spec: posenc.Spec) -> str:
        """Where the M-RoPE spec's rows differ from the module's at (t, h, w) positions."""
        positions = call.grid()
        cos, sin = self.handle.client.get_positions(
            positions.movedim(0, -1), spec, dtype=torch.float32, cos_sin=True
        )
        native = call.halves(positions, layer_type)
        if native[0].shape != cos.shape:
            return f"has cos of shape {tuple(cos.shape)}, the model's {tuple(native[0].shape)}"
        return _difference(torch.cat([cos, sin], -1), torch.cat(native, -1), halves=True)

    def _check_axes(
        self, call: _Call, layer_type: str | None, spec: posenc.Spec, layout: str
    ) -> str:
        """Where the rows merged from each column's axis differ from the module's at
        positions whose axes differ."""
        positions = call.grid()
        self.layouts[layer_type] = layout
        self.base[layer_type] = spec
        cos, sin = self.merged(positions, layer_type, spec.parameters | {"layout": layout})
        native = call.halves(positions, layer_type)
        return _difference(torch.cat([cos, sin], -1), torch.cat(native, -1), halves=True)

    # -- serving ------------------------------------------------------------------------------

    def rope_type(self, layer_type: str | None) -> str:
        rope_type = self.rope_types
        return str(rope_type[layer_type] if isinstance(rope_type, dict) else rope_type)

    def spec(self, layer_type: str | None, seq_len: int | None) -> posenc.Spec:
        key = (layer_type, seq_len)
        spec = self.specs.get(key)
        if spec is None:
            if len(self.specs) >= _SPECS_KEPT + 2:
                self.specs.clear()
            base = self.base[layer_type]
            parameters = base.parameters | {"layout": self.layouts[layer_type]}
            if seq_len is not None and parameters.get("scaling") in ("dynamic", "longrope"):
                values = self._layer_values(layer_type)
                _, config = table_from_config(
                    values, layout=self.layouts[layer_type], seq_len=seq_len, layer_type=layer_type
                )
                parameters["seq_len"] = config.get("seq_len")
                if parameters["seq_len"] is None:
                    del parameters["seq_len"]
            spec = posenc.Spec(base.kind, **parameters)
            self.specs[key] = spec
        return spec

    def seq_len(
        self, rope_type: str, position_ids: torch.Tensor, layer_type: str | None
    ) -> int | None:
        """transformers' seq_len for this forward (dynamic_rope_update), or None."""
        if "dynamic" in rope_type:
            seq_len = int(position_ids.max()) + 1
            cached = self.cached[layer_type]
            if seq_len > cached:  # growth
                cached = seq_len
            if seq_len < self.original < cached:  # reset to the initial table
                cached = self.original
            self.cached[layer_type] = cached
            return cached if cached > self.original else None
        if rope_type == "longrope":
            original = int(
                self.spec(layer_type, None).parameters["original_max_position_embeddings"]
            )
            # Two tables: the normalised seq_len of the long one, or the short one.
            return original + 1 if int(position_ids.max()) + 1 > original else None
        return None

    def dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype of :meth:`rows`' halves for hidden states ``x``."""
        return torch.float32 if self.complex else x.dtype

    def rows(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``position_ids``: in ``x``'s dtype, or float32 for a module
        returning complex frequencies (the caller makes them complex)."""
        if self.mrope:
            return self.mrope_rows(x, position_ids)
        dtype = torch.float32 if self.complex else _served(x.dtype)
        if self.axes:
            spec = self.spec(layer_type, None)
            cos, sin = self.merged(position_ids, layer_type, spec.parameters, dtype, x.device)
        else:
            rope_type = self.rope_type(layer_type)
            seq_len = self.seq_len(rope_type, position_ids, layer_type)
            spec = self.spec(layer_type, seq_len)
            cos, sin = self.fetch(
                spec, position_ids, dtype, x.device, dynamic="dynamic" in rope_type
            )
            if seq_len is not None and "dynamic" in rope_type:
                self.prefetch_next(position_ids, layer_type, dtype)
        if dtype != self.dtype(x):
            return cos.to(x.dtype), sin.to(x.dtype)
        return cos, sin

    def fetch(
        self,
        spec: posenc.Spec,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | None = None,
        *,
        dynamic: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``spec`` at ``position_ids``: from its growing table, or (a
        dynamic-NTK table for one seq_len, which changes as the sequence grows) the rows of
        these positions only."""
        if dynamic and "seq_len" in spec.parameters:
            cos, sin = self.handle.client.get_positions(
                position_ids, spec, dtype=dtype, device=device, cos_sin=True
            )
            return cos, sin
        key = (spec, dtype)
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = self.handle.table(spec, dtype)
        cos, sin = table.get(position_ids, device=device, cos_sin=True)
        return cos, sin

    def merged(
        self,
        position_ids: torch.Tensor,
        layer_type: str | None,
        parameters: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of a module merging several position axes: each column's value from the
        table at the position of the axis that column takes its angle from (text positions,
        every axis equal, are one table's rows)."""
        spec = posenc.Spec("rotary", **parameters)
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(self.axes, -1, -1)
        if bool((position_ids == position_ids[:1]).all()):
            return self.fetch(spec, position_ids[0], dtype, device)
        cos_axes, sin_axes = self.column_axes[layer_type]
        rows = [self.fetch(spec, position_ids[a], dtype, device) for a in range(self.axes)]
        merged = []
        for part, axes in ((0, cos_axes), (1, sin_axes)):
            stacked = torch.stack([row[part] for row in rows])
            index = axes.to(stacked.device).expand(1, *stacked.shape[1:])
            merged.append(stacked.gather(0, index)[0])
        return merged[0], merged[1]

    def prefetch_next(
        self, position_ids: torch.Tensor, layer_type: str | None, dtype: torch.dtype
    ) -> None:
        """Fetch the next decode step's rows in the background, while the model computes.

        A dynamic-NTK table changes with every token the sequence grows, so the row cache's
        read-ahead (rows of one table) cannot serve the next step; but that step is known:
        each sequence's next position, in the table of the ``seq_len`` it brings. A step
        that goes otherwise (a new prompt, a batch that changed) makes its own call.
        """
        following = position_ids[..., -1:] + 1
        seq_len = max(self.cached[layer_type], int(following.max()) + 1)
        self.handle.client.prefetch(following, self.spec(layer_type, seq_len), dtype=dtype)

    def mrope_rows(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's merged ``(cos, sin)``: text positions (every axis equal, decode steps
        included) from the growing table of the plain rotary spec, whose rows they are;
        image and video positions fetched by their coordinates."""
        spec = self.spec(None, None)
        dtype = _served(x.dtype)
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        if bool((position_ids == position_ids[:1]).all()):
            text = posenc.Spec(
                "rotary",
                head_dim=spec.parameters["head_dim"],
                layout=spec.parameters.get("layout", "transformers"),
                **{k: v for k, v in spec.parameters.items() if k == "rope_theta"},
            )
            table = self.handle.table(text, dtype)
            cos, sin = table.get(position_ids[0], device=x.device, cos_sin=True)
        else:
            cos, sin = self.handle.client.get_positions(
                position_ids.movedim(0, -1), spec, dtype=dtype, device=x.device, cos_sin=True
            )
        if dtype != x.dtype:
            return cos.to(x.dtype), sin.to(x.dtype)
        return cos, sin


class _NotStandard(Exception):
    """A rotary module whose forward is not ``forward(x, position_ids[, layer_type])`` giving
    cos and sin (or complex frequencies): the reason."""


class _Call:
    """The native forward of a fresh module at probe positions: its shapes, its position
    axes and, for a module merging several, each column's axis."""

    def __init__(self, native: Callable[..., Any], module: Any, probe: torch.Tensor) -> None:
        self.native = native
        self.module = module
        self.probe = probe
        self.positions = torch.arange(_VERIFY_ROWS, device=probe.device)[None]
        self.axes = 0
        self.complex = False
        self.width = 0

    def halves(
        self, position_ids: torch.Tensor, layer_type: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the module at ``position_ids`` (its complex output split)."""
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        try:
            with torch.no_grad():
                output = self.native(self.module, self.probe, position_ids, **kwargs)
        except Exception as error:  # the module's own code: its reason, in one line
            raise _NotStandard(
                f"forward(x, position_ids of shape {list(position_ids.shape)}) raised "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            ) from None
        if isinstance(output, torch.Tensor) and output.is_complex():
            self.complex = True
            return output.real.float().cpu(), output.imag.float().cpu()
        if (
            isinstance(output, tuple | list)
            and len(output) == 2
            and all(isinstance(t, torch.Tensor) for t in output)
            and output[0].shape == output[1].shape
        ):
            return output[0].float().cpu(), output[1].float().cpu()
        raise _NotStandard("its forward returns neither (cos, sin) nor complex frequencies")

    def standard(self, layer_types: list[str | None]) -> None:
        """Finds the module's position axes: 0 for ``[batch, seq]`` position ids, else the
        count of ``[axes, batch, seq]`` ones whose rows it merges (some releases' M-RoPE
        modules take only those)."""
        layer_type = layer_types[0]
        two: tuple[torch.Tensor, torch.Tensor] | None = None
        try:
            two = self.halves(self.positions, layer_type)
        except _NotStandard as error:
            refused = error
        shape = (1, _VERIFY_ROWS)
        for axes in (3, 2, 4):
            try:
                several = self.halves(self.positions[None].expand(axes, -1, -1), layer_type)
            except _NotStandard:
                continue
            if (two is None and several[0].shape[:2] == shape and several[0].ndim == 3) or (
                two is not None and several[0].shape == two[0].shape
            ):
                self.axes = axes
                self.width = int(several[0].shape[-1])
                return
        if two is None:
            raise refused
        if two[0].ndim != 3 or two[0].shape[:2] != shape:
            raise _NotStandard(
                f"its cos for position ids [1, {_VERIFY_ROWS}] has shape {list(two[0].shape)}"
            )
        self.width = int(two[0].shape[-1])

    def text(self, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's rows at positions 0 .. 63 (every axis equal)."""
        positions = self.positions
        if self.axes:
            positions = positions[None].expand(self.axes, -1, -1)
        return self.halves(positions, layer_type)

    def grid(self) -> torch.Tensor:
        """``[axes, 1, 64]`` positions whose axes differ: the cells of a 4 x 4 x 4 video
        (8 x 8 for two axes), every axis its own."""
        cells = torch.arange(_VERIFY_ROWS, device=self.probe.device)
        if self.axes == 2:
            return torch.stack([cells // 8, cells % 8])[:, None, :]
        digits = [cells // 4**k % 4 for k in range(self.axes)][::-1]
        return torch.stack(digits)[:, None, :]

    def column_axes(self, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The axis each cos and each sin column takes its angle from (0 for columns of a
        zero frequency, which no axis moves)."""
        moved = []
        for axis in range(self.axes):
            positions = torch.zeros(self.axes, 1, _VERIFY_ROWS, dtype=torch.long)
            positions[axis] = self.positions[0]
            cos, sin = self.halves(positions.to(self.probe.device), layer_type)
            moved.append(
                [
                    ((part - part[:, :1]).abs().amax(dim=(0, 1)) > _VERIFY_TOLERANCE)
                    for part in (cos, sin)
                ]
            )
        result = []
        for part in (0, 1):
            flags = torch.stack([m[part] for m in moved])  # [axes, width]
            axes = flags.float().argmax(dim=0)
            result.append(axes.view(1, 1, 1, -1))
        return result[0], result[1]


def _reference_module(module: nn.Module, config: Any, device: torch.device) -> nn.Module:
    """A fresh module of ``module``'s class: float32 frequencies (a model cast to bfloat16
    rounded its inv_freq buffer too), initial dynamic state, and the model's own untouched;
    ``module`` itself when its class takes more than the config."""
    try:
        return type(module)(config).to(device)
    except Exception:
        return module


def _match_layout(
    cos: torch.Tensor, sin: torch.Tensor, native: tuple[torch.Tensor, torch.Tensor]
) -> tuple[str, str]:
    """The layout whose arrangement of vLLM-layout rows ``(cos, sin)`` is the module's
    output, and where the closest one differs ("" when it is equal); ``("", why)`` when no
    layout has the module's width."""
    theirs = torch.cat(native, -1)
    fits = []
    for layout in _LAYOUTS:
        mine = torch.cat(_arranged(layout, cos, sin), -1)
        if mine.shape == theirs.shape:
            difference = _difference(mine, theirs, halves=True)
            if not difference:
                return layout, ""
            fits.append((layout, difference))
    if fits:
        return fits[0]
    return "", (f"has {cos.shape[-1]} frequencies, the module's cos {native[0].shape[-1]} columns")


def _arranged(layout: str, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """vLLM-layout halves in another layout's column order."""
    if layout == "transformers":
        return [torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)]
    if layout == "gptj":
        return [cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)]
    return [cos, sin]


def _layer_inv_freq(module: nn.Module, layer_type: str | None) -> torch.Tensor | None:
    """A layer type's frequency buffer (``{layer_type}_inv_freq``), else ``inv_freq``."""
    if layer_type is not None:
        buffer = getattr(module, f"{layer_type}_inv_freq", None)
        if isinstance(buffer, torch.Tensor):
            return buffer
    return _inv_freq(module)


def _frequencies_spec(buffer: torch.Tensor, scale: float) -> posenc.Spec | Exception:
    """The table of a module's own frequencies (its ``inv_freq`` buffer) at exact angles,
    scaled by ``scale``, or the error that stops one."""
    try:
        return posenc.Spec(
            "rotary",
            head_dim=2 * int(buffer.numel()),
            layout="vllm",
            scaling="frequencies",
            inv_freq=buffer.detach().double().cpu().tolist(),
            **({} if scale == 1.0 else {"attention_factor": scale}),
        )
    except posenc.InvalidArgumentError as error:
        return error


def _attention_scaling(module: nn.Module, layer_type: str | None) -> float:
    """A layer type's attention scaling (``{layer_type}_attention_scaling``), else the
    module's; 1 when it keeps none."""
    for name in (f"{layer_type}_attention_scaling", "attention_scaling"):
        value = getattr(module, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
    return 1.0


def _width(spec: posenc.Spec) -> int:
    """A rotary spec's rotary_dim: the width of transformers' cos (and of its sin)."""
    parameters = spec.parameters
    return int(parameters["head_dim"] * parameters.get("partial_rotary_factor", 1.0))


# The patched forwards, bound to their modules. The rows come from the SDK's Python (and
# maybe a call), which dynamo must not trace: under torch.compile a rotary module's rows are
# one custom op (posenc::rotary_rows), opaque to the compiler and run as Python at each call,
# so a compiled model has no graph break there; the other patched forwards are graph breaks
# (torch.compiler.disable).


def _rotary_forward(
    module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
) -> Any:
    state = module.__dict__[_STATE]
    if torch.compiler.is_compiling():
        # x gives the dtype and device only: detached, the op needs no autograd formula.
        both = torch.ops.posenc.rotary_rows(x.detach(), position_ids, state.key, layer_type or "")
        cos, sin = both.chunk(2, dim=-1)
    else:
        cos, sin = state.rows(x, position_ids, layer_type)
    return torch.complex(cos, sin) if state.complex else (cos, sin)


@torch.library.custom_op("posenc::rotary_rows", mutates_args=())
def _rotary_rows(
    x: torch.Tensor, position_ids: torch.Tensor, key: int, layer_type: str
) -> torch.Tensor:
    """The patched rotary module ``key``'s ``[cos | sin]`` (one new tensor: an op's outputs
    may not alias each other)."""
    cos, sin = _LIVE[key].rows(x, position_ids, layer_type or None)
    return torch.cat([cos, sin], dim=-1)


@_rotary_rows.register_fake
def _rotary_rows_shape(
    x: torch.Tensor, position_ids: torch.Tensor, key: int, layer_type: str
) -> torch.Tensor:
    state = _LIVE[key]
    shape = (*position_ids.shape[-2:], 2 * state.width)
    return x.new_empty(shape, dtype=state.dtype(x))


def _gptj_rotary_forward(module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
    cos, sin = _rotary_forward(module, x, position_ids)
    return sin, cos


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _gptj_attention_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _state(module).forward(module, *args, **kwargs)


class _GPTJ(_State):
    """A GPT-J module whose ``[sin | cos]`` rows come from posenc: installed once the table
    is checked (``verify``) against the leading rows of its ``embed_positions`` buffer, its
    forward replaced by ``FORWARD``."""

    FORWARD: Callable[..., Any]
    # Whether the state is registered in _LIVE, for the compiled forward's custom op.
    REGISTERED: bool = False

    handle: Patch
    name: str
    spec: posenc.Spec
    module: Any

    def install(self, verify: bool) -> None:
        module = self.module
        del self.module
        self.handle.specs[self.name] = self.spec
        if verify:
            cos, sin = self.handle.client.get_positions(
                torch.arange(_VERIFY_ROWS), self.spec, dtype=torch.float32, cos_sin=True
            )
            native = module.embed_positions[:_VERIFY_ROWS].cpu()
            _check(self.name, self.spec, torch.cat([sin, cos], -1), native)
        if self.REGISTERED:
            self._register()
        self.handle._override(module, _STATE, self)
        self.handle._bind(module, "forward", type(self).FORWARD)


class _GPTJRotary(_GPTJ):
    """GPT-J's rotary module (transformers 5.24): ``(sin, cos)`` of ``position_ids``, one
    half of ``rotary_dim`` each, from posenc at any position (the module's own buffer stops
    at ``n_positions``)."""

    def __init__(self, handle: Patch, name: str, module: Any, config: Any) -> None:
        self.handle = handle
        self.name = name
        # The module keeps no config: the model's.
        self.spec = posenc.Spec.from_config(config, layout="vllm")
        self.module = module

    FORWARD = staticmethod(_gptj_rotary_forward)
    REGISTERED = True

    complex: Final = False

    @property
    def width(self) -> int:
        return _width(self.spec) // 2

    def dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def rows(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.handle.table(self.spec, _served(x.dtype))
        cos, sin = table.get(position_ids, device=x.device, cos_sin=True)
        return cos.to(x.dtype), sin.to(x.dtype)


class _GPTJAttention(_GPTJ):
    """GPT-J's attention (transformers before 5.24) with its ``embed_positions`` rows from
    posenc.

    GPT-J gathers ``[sin | cos]`` rows of a ``max_position_embeddings``-row buffer at
    ``position_ids``; the patched forward hands it exactly the rows of this forward's
    positions (gathered at ``0 .. seq-1``), so any position works, not only those below
    the buffer's length.
    """

    def __init__(self, handle: Patch, name: str, module: Any) -> None:
        self.handle = handle
        self.name = name
        self.native = type(module).forward
        self.signature = inspect.signature(self.native)
        self.spec = posenc.Spec.from_config(module.config, layout="vllm")
        self.module = module

    FORWARD = staticmethod(_gptj_attention_forward)

    def forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(module, *args, **kwargs)
        position_ids = bound.arguments["position_ids"]
        hidden = bound.arguments["hidden_states"]
        table = self.handle.table(self.spec, _served(hidden.dtype))
        cos, sin = table.get(position_ids, device=hidden.device, cos_sin=True)
        sincos = torch.cat([sin, cos], dim=-1)
        batch, length = position_ids.shape
        bound.arguments["position_ids"] = torch.arange(length, device=position_ids.device).expand(
            batch, length
        )
        with _instance_method(module, "_get_embed_positions", lambda _ids: sincos):
            return self.native(*bound.args, **bound.kwargs)


@contextmanager
def _instance_method(module: nn.Module, name: str, value: Callable[..., Any]) -> Iterator[None]:
    object.__setattr__(module, name, value)
    try:
        yield
    finally:
        module.__dict__.pop(name, None)


# -- sinusoidal -----------------------------------------------------------------------------------


def _whole(table: GrowingTable, like: torch.Tensor | None = None) -> torch.Tensor:
    """Every row the table holds, as a tensor on ``like``'s device in its dtype."""
    tensor: torch.Tensor = as_tensor(table.rows())
    return tensor if like is None else tensor.to(device=like.device, dtype=like.dtype)


def _verify_rows(
    name: str, spec: posenc.Spec, table: GrowingTable, theirs: torch.Tensor, verify: bool
) -> None:
    if verify:
        rows = min(_VERIFY_ROWS * 4, len(theirs))
        table.reserve(rows)
        _check(name, spec, _whole(table).float()[:rows], theirs[:rows].detach().cpu().float())


class _Sinusoid(_State):
    """A patched sinusoidal module's table: its spec, grown from posenc."""

    def __init__(self, handle: Patch, spec: posenc.Spec) -> None:
        self.handle = handle
        self.spec = spec

    def grown(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """At least ``rows`` rows from position 0, as ``like`` (device, dtype)."""
        table = self.handle.table(self.spec, _served(like.dtype))
        table.reserve(rows)
        return _whole(table, like)


def _patch_fairseq(handle: Patch, name: str, module: Any, verify: bool) -> None:
    spec = posenc.Spec("fairseq", d_model=module.embedding_dim, padding_idx=module.padding_idx)
    handle._override(module, _STATE, _Sinusoid(handle, spec))
    handle.specs[name] = spec
    weights: torch.Tensor = module.weights
    table = handle.table(spec, _served(weights.dtype))
    _verify_rows(name, spec, table, weights, verify)
    table.reserve(len(weights))
    handle._replace(module, "weights", _whole(table, weights))
    handle._bind(module, "make_weights", _fairseq_make_weights)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _fairseq_make_weights(
    module: Any, num_embeddings: int, embedding_dim: int, padding_idx: Any = None
) -> None:
    # The module's forward calls this when an input outgrows the table: grow from posenc.
    module.weights = _state(module).grown(num_embeddings, module.weights)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _replace_embedding(
    handle: Patch, path: str, module: Any, embedding: Any, spec: posenc.Spec, verify: bool
) -> int:
    """Replaces the weight of ``embedding`` (an ``nn.Embedding`` of ``module``, or
    ``module`` itself) with posenc's rows of ``spec`` once they match its own (``verify``),
    ``module`` holding the table it grows from; the rows it holds."""
    weight: torch.Tensor = embedding.weight
    handle._override(module, _STATE, _Sinusoid(handle, spec))
    handle.specs[path] = spec
    table = handle.table(spec, _served(weight.dtype))
    _verify_rows(path, spec, table, weight, verify)
    table.reserve(len(weight))
    handle._replace(embedding, "weight", _frozen(_whole(table, weight)))
    handle._replace(embedding, "num_embeddings", len(table))
    return len(table)


def _grow_embedding(module: Any, embedding: Any, rows: int) -> bool:
    """Grows the weight of a replaced ``embedding`` (``module``'s, or ``module``) to at least
    ``rows`` rows of posenc's table; whether it grew."""
    current: torch.Tensor = embedding.weight
    if rows <= len(current):
        return False
    grown = _state(module).grown(rows, current)
    embedding.weight = _frozen(grown)
    embedding.num_embeddings = len(grown)
    return True


def _patch_split(handle: Patch, name: str, module: Any, verify: bool) -> None:
    """Marian/Pegasus: the weight of an ``nn.Embedding`` ``[sin | cos]``, grown on demand."""
    spec = posenc.Spec("sinusoidal", d_model=module.weight.shape[1], layout="split")
    _replace_embedding(handle, name, module, module, spec, verify)
    handle._bind(module, "forward", _split_forward)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _split_forward(
    module: Any,
    input_ids_shape: torch.Size,
    past_key_values_length: int = 0,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    current: torch.Tensor = module.weight
    if position_ids is None:
        seq_len = input_ids_shape[1]
        position_ids = torch.arange(
            past_key_values_length,
            past_key_values_length + seq_len,
            dtype=torch.long,
            device=current.device,
        )
    _grow_embedding(module, module, int(position_ids.max()) + 1 if position_ids.numel() else 0)
    with torch.no_grad():
        return nn.functional.embedding(position_ids, module.weight)


def _patch_whisper(handle: Patch, name: str, module: Any, verify: bool) -> None:
    """Whisper's encoder adds all of its ``max_source_positions`` rows to every input (its
    input length is fixed), so its table is replaced and never needs to grow."""
    embedding = module.embed_positions
    weight = embedding.weight
    spec = posenc.Spec("whisper", d_model=weight.shape[1])
    path = f"{name}.embed_positions" if name else "embed_positions"
    handle.specs[path] = spec
    table = handle.table(spec, _served(weight.dtype))
    _verify_rows(path, spec, table, weight, verify)
    rows = table.rows(len(weight))
    exact = as_tensor(rows, weight.device).to(weight.dtype)
    handle._replace(embedding, "weight", _frozen(exact))


def _patch_xlm(handle: Patch, name: str, module: Any, verify: bool) -> None:
    """XLM's sinusoidal position embeddings (interleaved), grown with its ``position_ids``
    buffer before a forward whose input outgrows them."""
    embedding = module.position_embeddings
    device = embedding.weight.device
    spec = posenc.Spec("sinusoidal", d_model=embedding.weight.shape[1])
    path = f"{name}.position_embeddings" if name else "position_embeddings"
    rows = _replace_embedding(handle, path, module, embedding, spec, verify)
    handle._replace(module, "position_ids", torch.arange(rows, device=device)[None])
    hook = module.register_forward_pre_hook(_xlm_grow, with_kwargs=True)
    handle._undo.append(hook.remove)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _xlm_grow(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    positions = kwargs.get("position_ids")
    top = 0 if tokens is None else int(tokens.shape[1])
    if positions is not None and positions.numel():
        top = max(top, int(positions.max()) + 1)
    embedding = module.position_embeddings
    if _grow_embedding(module, embedding, top):
        weight = embedding.weight
        module.position_ids = torch.arange(len(weight), device=weight.device)[None]
