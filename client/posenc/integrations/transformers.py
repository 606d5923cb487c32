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

The transformers releases this is tested against: :data:`TRANSFORMERS_RELEASES`; another
release gets a warning (and, with ``verify=False``, a refusal). The returned :class:`Patch`
undoes every change (``undo()``, or leaving its ``with`` block). Importing this module
imports torch, not transformers: models are recognised by the modules they hold.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import re
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Final

import torch
from torch import nn

import posenc
from posenc._configs import config_dict
from posenc._output import as_tensor
from posenc.table import DEFAULT_MAX_BYTES, DEFAULT_MIN_ROWS, GrowingTable

__all__ = ["TRANSFORMERS_RELEASES", "Patch", "UntestedReleaseWarning", "patch"]

_log = logging.getLogger(__name__)

#: The transformers releases :func:`patch` is tested against: from the first (inclusive) to
#: the second (exclusive), as ``(major, minor)``; the ``transformers`` extra declares the same.
TRANSFORMERS_RELEASES: Final = ((5, 17), (5, 25))

_SERVED: Final = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
# Rows compared with the model's own table when patching: positions where float32 is exact
# to a few ulps, so a difference means a misread config, not rounding.
_VERIFY_ROWS: Final = 64
_VERIFY_TOLERANCE: Final = 2e-4
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


def _check_release(verify: bool) -> None:
    version, release = _release()
    if not version:  # no transformers imported: modules of the caller's own
        return
    low, high = TRANSFORMERS_RELEASES
    if release is not None and low <= release < high:
        return
    supported = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if not verify:
        raise ValueError(
            f"transformers {version} is outside the releases posenc's patch is tested "
            f"against ({supported}): patch with verify=True (each table is then compared "
            "with the model's own), or install a tested release"
        )
    warnings.warn(
        f"transformers {version} is outside the releases posenc's patch is tested against "
        f"({supported}); each table is still compared with the model's own at positions "
        f"below {_VERIFY_ROWS} and refused if it differs",
        UntestedReleaseWarning,
        stacklevel=3,
    )


class Patch:
    """What :func:`patch` changed in a model: undone by :meth:`undo` or on leaving a ``with``.

    Attributes:
        specs: The spec of each replaced table, by module name (``""`` is the model;
            ``name:layer_type`` for a module holding one table per layer type).
        skipped: The position modules left as they are, by module name, each with the
            reason (a vision tower's table, a learned embedding, ...).
    """

    def __init__(self, client: posenc.Client, *, min_rows: int, max_table_bytes: int) -> None:
        self.client = client
        self.specs: dict[str, posenc.Spec] = {}
        self.skipped: dict[str, str] = {}
        self._min_rows = min_rows
        self._max_table_bytes = max_table_bytes
        self._tables: dict[tuple[posenc.Spec, torch.dtype], GrowingTable] = {}
        self._undo: list[Callable[[], None]] = []

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

    def undo(self) -> None:
        """Restores every patched module as it was (its own tables and methods). Deep
        copies made while patched stay patched."""
        while self._undo:
            self._undo.pop()()
        self._tables.clear()

    def __enter__(self) -> Patch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"Patch({', '.join(self.specs) or 'nothing'})"

    def __deepcopy__(self, memo: dict[int, Any]) -> Patch:
        return self  # a deep copy of a patched model shares the patch (and its client)

    def __reduce__(self) -> Any:
        raise TypeError(_NOT_PICKLED)

    # -- replacing attributes, undoably -------------------------------------------------------

    def _override(self, module: nn.Module, name: str, value: Any) -> None:
        """Sets an instance attribute (e.g. ``forward``) that shadows the class's."""
        object.__setattr__(module, name, value)
        self._undo.append(lambda: module.__dict__.pop(name, None))

    def _bind(self, module: nn.Module, name: str, function: Callable[..., Any]) -> None:
        """Makes ``function(module, ...)`` the module's method ``name``: bound to the module,
        so that a deep copy of the model binds it to the copy."""
        self._override(module, name, types.MethodType(function, module))

    def _replace(self, module: nn.Module, name: str, value: Any) -> None:
        """Replaces a buffer or parameter, restoring the original on undo."""
        original = getattr(module, name)
        setattr(module, name, value)
        self._undo.append(lambda: setattr(module, name, original))


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
            the sign of a config read differently from the model.
        min_rows: First size of each growing table (rows from position 0).
        max_table_bytes: Memory cap of each growing table; rows past it are fetched per
            forward.

    Returns:
        The :class:`Patch`: ``undo()`` (or use it as a context manager) restores the model;
        ``specs`` names what was replaced and ``skipped`` what was left alone.

    Raises:
        ValueError: The model holds no table posenc serves, or (``verify``) a table differs,
            or (``verify=False``) transformers is outside :data:`TRANSFORMERS_RELEASES`.
        posenc.InvalidArgumentError: A text table's config names a rope type posenc does not
            serve.

    Warns:
        UntestedReleaseWarning: transformers is outside :data:`TRANSFORMERS_RELEASES`.
    """
    _check_release(verify)
    handle = Patch(client, min_rows=min_rows, max_table_bytes=max_table_bytes)
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "") or "")
    inside: list[str] = []  # modules replaced whole: their children are theirs
    try:
        for name, module in model.named_modules():
            if any(name.startswith(f"{outer}.") for outer in inside):
                continue
            if _is_rotary(module):
                reason = _vision_reason(module)
                if reason:
                    handle.skipped[name] = reason
                    continue
                _Rotary(handle, name, module).install(verify)
            elif _is_gptj_rotary(module):
                _GPTJRotary(handle, name, module, config).install(verify)
            elif _is_gptj_attention(module):
                _GPTJAttention(handle, name, module).install(verify)
                inside.append(name)
            elif _is_fairseq(module):
                _patch_fairseq(handle, name, module, verify)
            elif _is_split_embedding(module):
                _patch_split(handle, name, module, verify)
            elif model_type == "whisper" and type(module).__name__.endswith("WhisperEncoder"):
                _patch_whisper(handle, name, module, verify)
                inside.append(name)
            elif _is_xlm(module):
                _patch_xlm(handle, name, module, verify)
                inside.append(name)
            elif name and _POSITIONAL.search(f"{type(module).__name__} {name.rsplit('.', 1)[-1]}"):
                handle.skipped[name] = _other_reason(module)
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


def _check(name: str, spec: posenc.Spec, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Refuses a table that differs from the model's own at small positions."""
    if tuple(ours.shape) != tuple(theirs.shape):
        raise ValueError(
            f"{name or 'model'}: posenc's table for {spec} has shape {tuple(ours.shape)}, "
            f"the model's {tuple(theirs.shape)}"
        )
    difference = float((ours.double() - theirs.double()).abs().max()) if ours.numel() else 0.0
    if difference > _VERIFY_TOLERANCE:
        raise ValueError(
            f"{name or 'model'}: posenc's table for {spec} differs from the model's own by "
            f"{difference:.3g} at positions below {len(ours)}: the config is read differently "
            "from the model's code"
        )


# -- rotary ---------------------------------------------------------------------------------------


class _Rotary(_State):
    """The forward of a transformers rotary module, from posenc: ``(cos, sin)`` of
    ``position_ids`` ``[batch, seq]`` (complex ``cos + i sin`` where the module returns
    complex frequencies: DeepSeek-V2, Llama 4), in the width the module returns (GPT-OSS:
    one half each)."""

    def __init__(self, handle: Patch, name: str, module: Any) -> None:
        self.handle = handle
        self.name = name
        self.config = module.config
        # The config's keys, read once: a dynamic-NTK decode loop makes a spec every step.
        self.values = config_dict(module.config)
        self.native = type(module).forward
        # A module returning complex frequencies (DeepSeek-V2's freqs_cis) or half-width
        # (cos, sin) (GPT-OSS) gets vLLM-layout rows, [cos | sin] without duplicated halves.
        self.complex = False
        self.layout = "transformers"
        # M-RoPE (Qwen-VL): position ids [3, batch, seq] of (t, h, w).
        self.mrope = False
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

    def install(self, verify: bool) -> None:
        module = self.module
        del self.module  # the patched forward is bound to the module (or its deep copy)
        rope_type = module.rope_type
        layer_types: list[str | None] = list(rope_type) if isinstance(rope_type, dict) else [None]
        inv_freq = _inv_freq(module)
        assert inv_freq is not None
        probe = torch.zeros(1, device=inv_freq.device)
        positions = torch.arange(_VERIFY_ROWS, device=probe.device)[None]
        # Not self.spec: its memo would keep the layout before the probe below decides it.
        if layer_types == [None] and posenc.Spec.from_config(self.values).kind == "mrope":
            # (t, h, w) position ids [3, 1, seq]: a 4 x 4 x 4 video's, every axis its own.
            self.mrope = True
            cells = torch.arange(_VERIFY_ROWS, device=probe.device)
            positions = torch.stack([cells // 16, cells // 4 % 4, cells % 4])[:, None, :]
        try:
            # A fresh module: float32 frequencies (a model cast to bfloat16 rounded its
            # inv_freq buffer too), initial dynamic state, and the model's own untouched.
            reference = type(module)(self.config).to(probe.device)
        except TypeError:
            reference = module
        natives = {}
        for layer_type in layer_types:
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            natives[layer_type] = self.native(reference, probe, positions, **kwargs)
        native = natives[layer_types[0]]
        self.complex = isinstance(native, torch.Tensor) and native.is_complex()
        if self.complex:
            self.layout = "vllm"
        else:
            full = posenc.Spec.from_config(self.values, layer_type=layer_types[0])
            if full.kind == "rotary" and native[0].shape[-1] * 2 == _width(full):
                self.layout = "vllm"  # half-width cos and sin (GPT-OSS)
        for layer_type in layer_types:
            self.cached[layer_type] = int(getattr(module, "max_seq_len_cached", 0) or 0)
            spec = self.spec(layer_type, None)
            self.handle.specs[self.name if layer_type is None else f"{self.name}:{layer_type}"] = (
                spec
            )
            if verify:
                # One direct fetch: no table is held for the probe's dtype.
                cos, sin = self.handle.client.get_positions(
                    positions.movedim(0, -1) if self.mrope else positions,
                    spec,
                    dtype=torch.float32,
                    cos_sin=True,
                )
                native = natives[layer_type]
                if self.complex:
                    ours = torch.view_as_real(torch.complex(cos, sin))
                    _check(self.name, spec, ours, torch.view_as_real(native))
                else:
                    _check(self.name, spec, torch.cat([cos, sin], -1), torch.cat(native, -1))
        # The width of the module's cos (and sin), for the compiled forward's shapes.
        self.width = int(native.shape[-1] if self.complex else native[0].shape[-1])
        self.rope_types = dict(rope_type) if isinstance(rope_type, dict) else rope_type
        self._register()
        self.handle._override(module, _STATE, self)
        self.handle._bind(module, "forward", _rotary_forward)

    def rope_type(self, layer_type: str | None) -> str:
        rope_type = self.rope_types
        return str(rope_type[layer_type] if isinstance(rope_type, dict) else rope_type)

    def spec(self, layer_type: str | None, seq_len: int | None) -> posenc.Spec:
        key = (layer_type, seq_len)
        spec = self.specs.get(key)
        if spec is None:
            if len(self.specs) >= _SPECS_KEPT + 2:
                self.specs.clear()
            spec = posenc.Spec.from_config(
                self.values, layout=self.layout, seq_len=seq_len, layer_type=layer_type
            )
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
        rope_type = self.rope_type(layer_type)
        seq_len = self.seq_len(rope_type, position_ids, layer_type)
        spec = self.spec(layer_type, seq_len)
        dtype = torch.float32 if self.complex else _served(x.dtype)
        if seq_len is not None and "dynamic" in rope_type:
            # A table for this seq_len only (it changes as the sequence grows): the rows of
            # this forward, not a table from position 0.
            cos, sin = self.handle.client.get_positions(
                position_ids, spec, dtype=dtype, device=x.device, cos_sin=True
            )
            self.prefetch_next(position_ids, layer_type, dtype)
        else:
            key = (spec, dtype)
            table = self.tables.get(key)
            if table is None:
                table = self.tables[key] = self.handle.table(spec, dtype)
            cos, sin = table.get(position_ids, device=x.device, cos_sin=True)
        if dtype != self.dtype(x):
            return cos.to(x.dtype), sin.to(x.dtype)
        return cos, sin

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


class _GPTJRotary(_State):
    """GPT-J's rotary module (transformers 5.24): ``(sin, cos)`` of ``position_ids``, one
    half of ``rotary_dim`` each, from posenc at any position (the module's own buffer stops
    at ``n_positions``)."""

    def __init__(self, handle: Patch, name: str, module: Any, config: Any) -> None:
        self.handle = handle
        self.name = name
        # The module keeps no config: the model's.
        self.spec = posenc.Spec.from_config(config, layout="vllm")
        self.module = module

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
        self._register()
        self.handle._override(module, _STATE, self)
        self.handle._bind(module, "forward", _gptj_rotary_forward)

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


class _GPTJAttention(_State):
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

    def install(self, verify: bool) -> None:
        module = self.module
        del self.module
        self.handle.specs[self.name] = self.spec
        if verify:
            positions = torch.arange(_VERIFY_ROWS)
            cos, sin = self.handle.client.get_positions(
                positions, self.spec, dtype=torch.float32, cos_sin=True
            )
            native = module.embed_positions[:_VERIFY_ROWS].cpu()
            _check(self.name, self.spec, torch.cat([sin, cos], -1), native)
        self.handle._override(module, _STATE, self)
        self.handle._bind(module, "forward", _gptj_attention_forward)

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


def _patch_split(handle: Patch, name: str, module: Any, verify: bool) -> None:
    """Marian/Pegasus: the weight of an ``nn.Embedding`` ``[sin | cos]``, grown on demand."""
    weight: torch.Tensor = module.weight
    spec = posenc.Spec("sinusoidal", d_model=weight.shape[1], layout="split")
    handle._override(module, _STATE, _Sinusoid(handle, spec))
    handle.specs[name] = spec
    table = handle.table(spec, _served(weight.dtype))
    _verify_rows(name, spec, table, weight, verify)
    table.reserve(len(weight))
    handle._replace(module, "weight", _frozen(_whole(table, weight)))
    handle._replace(module, "num_embeddings", len(table))
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
    top = int(position_ids.max()) + 1 if position_ids.numel() else 0
    if top > len(current):
        grown = _state(module).grown(top, current)
        module.weight = _frozen(grown)
        module.num_embeddings = len(grown)
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
    weight = embedding.weight
    spec = posenc.Spec("sinusoidal", d_model=weight.shape[1])
    path = f"{name}.position_embeddings" if name else "position_embeddings"
    handle._override(module, _STATE, _Sinusoid(handle, spec))
    handle.specs[path] = spec
    table = handle.table(spec, _served(weight.dtype))
    _verify_rows(path, spec, table, weight, verify)
    table.reserve(len(weight))
    handle._replace(embedding, "weight", _frozen(_whole(table, weight)))
    handle._replace(embedding, "num_embeddings", len(table))
    handle._replace(module, "position_ids", torch.arange(len(table), device=weight.device)[None])
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
    current: torch.Tensor = embedding.weight
    if top > len(current):
        grown = _state(module).grown(top, current)
        embedding.weight = _frozen(grown)
        embedding.num_embeddings = len(grown)
        module.position_ids = torch.arange(len(grown), device=current.device)[None]
