"""vLLM's rotary ``cos_sin_cache``, exact, from posenc.

vLLM's rotary embedding classes hold a table of ``[cos | sin]`` halves (``rotary_dim``
columns, one row per position up to the class's own maximum), computed in float32 at
start-up. :func:`cos_sin_cache` builds the same tensor -- same shape, same rows -- with
every value correctly rounded, for the arguments of vLLM's ``get_rope``;
:func:`cos_sin_cache_of` does it from a built module's own attributes, and :func:`install`
copies a cache into its module in place after checking it is that module's table. In a
vLLM worker, :func:`install_model` does all of it for every rotary module of the model::

    def use_posenc(model):  # runs in each worker: LLM.apply_model(use_posenc)
        import posenc
        from posenc.integrations import vllm as pv

        with posenc.Client("posenc.internal:50051") as client:
            return pv.install_model(client, model)

Supported: vLLM 0.33 (:data:`SUPPORTED_VLLM`, the ``vllm`` extra); every function refuses
a process running another vLLM: row counts and formulas change between releases. Covered,
as 0.33's ``get_rope`` builds them: ``default`` (``RotaryEmbedding``; with
``mrope_section``, ``MRotaryEmbedding``'s plain cache of ``max_position *
mrope_positions_factor`` rows), ``partial_rotary_factor`` and ``rope_dim``, ``linear``
(``LinearScalingRotaryEmbedding``, one cache per factor, concatenated), ``dynamic``
(``DynamicNTKScalingRotaryEmbedding``: ``max_position`` rows at the base rescaled by
``max_trained_positions``; ``DynamicNTKAlphaRotaryEmbedding`` with ``alpha``), ``yarn``
(``YaRNScalingRotaryEmbedding``, and ``MRotaryEmbedding`` with ``mrope_section``),
``llama3`` (``Llama3RotaryEmbedding``) and ``longrope`` (``Phi3LongRoPEScaledRotaryEmbedding``:
its ``long_short_cos_sin_cache``, the short table's ``original_max_position_embeddings`` rows
then the long table's ``max_position`` rows).
"""

from __future__ import annotations

import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import torch

import posenc
from posenc._output import as_tensor
from posenc._query import numpy_dtype

__all__ = [
    "SUPPORTED_VLLM",
    "UnsupportedVLLMError",
    "cos_sin_cache",
    "cos_sin_cache_of",
    "get_rope_arguments",
    "install",
    "install_model",
    "rows_of",
    "specs",
]

_log = logging.getLogger(__name__)

#: The vLLM releases whose rotary caches this module reproduces: ``>= 0.33, < 0.34`` as
#: (major, minor) bounds, the range of pyproject.toml's ``vllm`` extra.
SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 33), (0, 34))

# install() compares this many leading rows with the module's own cache (vLLM's float32
# values: their angle error grows with the position, about |p| * 2^-22 at most).
_VERIFY_ROWS = 16384


class UnsupportedVLLMError(posenc.PosencError, RuntimeError):
    """The process runs a vLLM release outside :data:`SUPPORTED_VLLM` (FAILED_PRECONDITION)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


def _violation(field: str, description: str) -> posenc.InvalidArgumentError:
    return posenc.InvalidArgumentError(
        f"invalid {field}: {description}", field_violations=[(field, description)]
    )


def _check_vllm_version() -> None:
    """Refuses a loaded vLLM outside the supported range (nothing to check if none is)."""
    vllm = sys.modules.get("vllm")
    if vllm is None:
        return
    version = str(getattr(vllm, "__version__", ""))
    match = re.match(r"(\d+)\.(\d+)", version)
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    if match is None or not (
        (low_major, low_minor) <= (int(match[1]), int(match[2])) < (high_major, high_minor)
    ):
        raise UnsupportedVLLMError(
            f"posenc.integrations.vllm reproduces the rotary caches of vLLM "
            f">={low_major}.{low_minor},<{high_major}.{high_minor} and this process runs vLLM "
            f"{version or '(version unknown)'}, whose caches may have other rows or values; "
            f"install a supported vLLM (pip install 'posenc[vllm]')"
        )


def rows_of(length: float) -> int:
    """Rows of ``torch.arange(length)``, as vLLM sizes its caches (``max_position * factor``
    may be a float: arange counts up to its ceiling)."""
    return math.ceil(length)


def _rotary_dim(head_size: int, rope: Mapping[str, Any]) -> int:
    """get_rope's rotary_dim: ``rope_dim`` when set, else head_size * partial factor."""
    if rope.get("rope_dim"):
        return int(rope["rope_dim"])
    factor = float(rope.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        raise _violation("partial_rotary_factor", f"must be in (0, 1], got {factor}")
    return int(head_size * factor)


def specs(
    head_size: int,
    max_position: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    mrope_positions_factor: int = 4,
) -> list[tuple[posenc.Spec, int]]:
    """The posenc tables (vLLM layout) that make up vLLM's cache, each with its row count,
    in the order vLLM concatenates them. Arguments as :func:`cos_sin_cache`'s."""
    rope = dict(rope_parameters or {})
    if "rope_theta" not in rope:
        raise _violation(
            "rope_parameters.rope_theta",
            "is not set: vLLM's get_rope then takes 10000, which is not most models' base; "
            "pass the model's (vLLM puts the config's rope_theta into "
            "hf_config.rope_parameters), 10000.0 if that is really its base",
        )
    if "type" in rope and "rope_type" not in rope:
        raise _violation(
            "rope_parameters.type",
            "get_rope reads rope_type only (vLLM's config loading renames 'type'): pass "
            "hf_config.rope_parameters as vLLM loaded it",
        )
    kind = str(rope.get("rope_type", "default"))
    theta = float(rope["rope_theta"])
    dim = _rotary_dim(head_size, rope)

    def rotary(rows: int, base: float = theta, **scaling: Any) -> tuple[posenc.Spec, int]:
        spec = posenc.Spec("rotary", head_dim=dim, rope_theta=base, layout="vllm", **scaling)
        return spec, rows

    mrope = "mrope_section" in rope
    if kind == "default" and rope.get("use_fope") and not mrope:
        raise _violation("rope_parameters.use_fope", "FourierRotaryEmbedding is not served")
    if kind == "default":
        # MRotaryEmbedding's cache is the plain one, over max_position * positions_factor.
        return [rotary(max_position * (mrope_positions_factor if mrope else 1))]
    if kind == "linear":
        factors = rope["factor"]
        listed: Sequence[float] = factors if isinstance(factors, Sequence) else [factors]
        return [
            rotary(rows_of(max_position * f), scaling="linear", factor=float(f)) for f in listed
        ]
    if kind == "dynamic":
        # The base once at start-up, as the class computes it (in double), then a plain table
        # of max_position rows.
        exponent = dim / (dim - 2)
        if "alpha" in rope:
            return [rotary(max_position, theta * float(rope["alpha"]) ** exponent)]
        if "factor" in rope:
            f = float(rope["factor"])
            trained = int(rope.get("max_trained_positions", max_position))
            base = theta * ((f * max_position / trained) - (f - 1)) ** exponent
            return [rotary(max_position, base)]
        raise _violation("rope_parameters", "dynamic scaling needs 'alpha' or 'factor'")
    if kind == "llama3":
        return [
            rotary(
                max_position,
                scaling="llama3",
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
            )
        ]
    if kind == "yarn":
        # With mrope_section, MRotaryEmbedding: YaRN over original * positions_factor.
        original = int(rope["original_max_position_embeddings"])
        original *= mrope_positions_factor if mrope else 1
        f = float(rope["factor"])
        fields: dict[str, Any] = {"factor": f, "original_max_position_embeddings": original}
        for name in ("beta_fast", "beta_slow", "truncate", "attention_factor"):
            if rope.get(name) is not None:
                fields[name] = rope[name]
        if (
            rope.get("attention_factor") is None
            and rope.get("mscale")
            and rope.get("mscale_all_dim")
        ):
            # vLLM takes the mscale ratio only when both are set and non-zero.
            fields["mscale"] = float(rope["mscale"])
            fields["mscale_all_dim"] = float(rope["mscale_all_dim"])
        return [rotary(rows_of(original * f), scaling="yarn", **fields)]
    if kind == "longrope":
        original = int(rope["original_max_position_embeddings"])
        common: dict[str, Any] = {
            "scaling": "longrope",
            "original_max_position_embeddings": original,
            # vLLM derives the scale from max_position / original, whatever rope["factor"] says.
            "max_position_embeddings": max_position,
            "short_factor": list(rope["short_factor"]),
            "long_factor": list(rope["long_factor"]),
        }
        short, long = dict(common), dict(common, seq_len=original + 1)
        if rope.get("short_mscale") is not None:
            short["attention_factor"] = float(rope["short_mscale"])
        if rope.get("long_mscale") is not None:
            long["attention_factor"] = float(rope["long_mscale"])
        return [rotary(original, **short), rotary(max_position, **long)]
    served = "default, linear, dynamic, yarn, llama3, longrope"
    raise _violation("rope_parameters.rope_type", f"{kind!r} is not served (served: {served})")


# 0.33's classes served, by name: what get_rope arguments rebuild each one's cache.
_SERVED_CLASSES = (
    "RotaryEmbedding",
    "MRotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "Phi3LongRoPEScaledRotaryEmbedding",
)


def get_rope_arguments(rotary_emb: torch.nn.Module) -> tuple[int, int, dict[str, Any]]:
    """``(head_size, max_position, rope_parameters)`` that rebuild the cache of a vLLM rotary
    module from the module's own attributes (its ``base``, ``rotary_dim``, factors and
    row count), for :func:`specs` and :func:`cos_sin_cache` (``mrope_positions_factor=1``:
    an M-RoPE module's row count is already multiplied).

    Raises:
        posenc.InvalidArgumentError: A class posenc does not serve.
    """
    m: Any = rotary_emb
    kind = type(m).__name__
    if kind not in _SERVED_CLASSES:
        raise _violation(
            "rotary_emb", f"{kind} is not served (served: {', '.join(_SERVED_CLASSES)})"
        )
    rows = int(m.max_position_embeddings)
    rope: dict[str, Any] = {"rope_theta": float(m.base)}
    yarn = kind == "YaRNScalingRotaryEmbedding" or (
        kind == "MRotaryEmbedding" and m.scaling_factor is not None
    )
    if yarn:
        rope.update(
            rope_type="yarn",
            factor=float(m.scaling_factor),
            original_max_position_embeddings=rows,
            beta_fast=m.beta_fast,
            beta_slow=m.beta_slow,
            truncate=bool(m.truncate),
            attention_factor=float(m.mscale),
        )
    elif kind == "LinearScalingRotaryEmbedding":
        rope.update(rope_type="linear", factor=[float(f) for f in m.scaling_factors])
    elif kind == "DynamicNTKScalingRotaryEmbedding":
        rope.update(
            rope_type="dynamic",
            factor=float(m.scaling_factor),
            max_trained_positions=int(m.max_trained_positions),
        )
    elif kind == "DynamicNTKAlphaRotaryEmbedding":
        rope.update(rope_type="dynamic", alpha=float(m.scaling_alpha))
    elif kind == "Llama3RotaryEmbedding":
        rope.update(
            rope_type="llama3",
            factor=float(m.scaling_factor),
            low_freq_factor=float(m.low_freq_factor),
            high_freq_factor=float(m.high_freq_factor),
            original_max_position_embeddings=int(m.orig_max_position),
        )
    elif kind == "Phi3LongRoPEScaledRotaryEmbedding":
        rope.update(
            rope_type="longrope",
            original_max_position_embeddings=int(m.original_max_position_embeddings),
            short_factor=[float(f) for f in m.short_factor],
            long_factor=[float(f) for f in m.long_factor],
            short_mscale=float(m.short_mscale),
            long_mscale=float(m.long_mscale),
        )
    return int(m.rotary_dim), rows, rope


def _buffer(rotary_emb: torch.nn.Module) -> tuple[str, torch.Tensor]:
    """The module's cache: ``cos_sin_cache``, or Phi-3's ``long_short_cos_sin_cache``."""
    for name in ("long_short_cos_sin_cache", "cos_sin_cache"):
        buffer = getattr(rotary_emb, name, None)
        if isinstance(buffer, torch.Tensor):
            return name, buffer
    raise _violation(
        "rotary_emb",
        f"{type(rotary_emb).__name__} holds no cos_sin_cache or long_short_cos_sin_cache",
    )


def cos_sin_cache(
    client: posenc.Client,
    head_size: int,
    max_position: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    mrope_positions_factor: int = 4,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
) -> Any:
    """The cache tensor vLLM's rotary class for these ``get_rope`` arguments holds.

    Args:
        client: The client the rows are fetched with.
        head_size: ``head_size`` of ``get_rope`` (rotary_dim is ``rope_dim`` when set, else
            head_size * ``partial_rotary_factor``).
        max_position: ``max_position`` of ``get_rope`` (the model's
            ``max_position_embeddings``).
        rope_parameters: ``rope_parameters`` of ``get_rope`` (``rope_type``, ``rope_theta``,
            ``partial_rotary_factor``, ``factor``, ...). ``rope_theta`` is required: vLLM's
            silent default (10000) is refused rather than served.
        mrope_positions_factor: ``get_rope``'s, for ``mrope_section`` (M-RoPE) caches.
        dtype: The cache's dtype (vLLM: the model's), computed by the server in it.
        device: Where the tensor goes (default CPU).

    Returns:
        ``[rows, rotary_dim]``: ``[cos | sin]`` halves, the rows of the class's cache.

    Raises:
        posenc.InvalidArgumentError: Parameters vLLM 0.33 builds no served cache from.
        UnsupportedVLLMError: The process has imported a vLLM outside the supported range.
    """
    _check_vllm_version()
    parts = specs(
        head_size, max_position, rope_parameters, mrope_positions_factor=mrope_positions_factor
    )
    if len(parts) == 1:
        ((spec, rows),) = parts
        return client.get_range(0, rows, spec, dtype=dtype, device=device or "cpu")
    # Several tables, one after the other: each fetched straight into its rows of the cache.
    element = numpy_dtype(dtype)
    first = client.get_range(0, parts[0][1], parts[0][0], dtype=element)
    cache = np.empty((sum(rows for _, rows in parts), first.shape[1]), dtype=element)
    cache[: len(first)] = first
    row = len(first)
    for spec, rows in parts[1:]:
        client.get_range(0, rows, spec, dtype=element, out=cache[row : row + rows])
        row += rows
    return as_tensor(cache, device)


def _verify(name: str, buffer: torch.Tensor, cache: torch.Tensor) -> None:
    """Refuses a cache that is not the module's table: its leading rows must equal the
    module's own within both dtypes' rounding and vLLM's float32 angle error."""
    rows = min(len(buffer), _VERIFY_ROWS)
    if rows == 0:
        return
    theirs = buffer[:rows].detach().to("cpu", torch.float64)
    ours = cache[:rows].detach().to("cpu", torch.float64)
    scale = float(theirs.abs().max())
    slack = torch.finfo(buffer.dtype).eps + torch.finfo(cache.dtype).eps
    positions = torch.arange(1, rows + 1, dtype=torch.float64)[:, None]
    allowed = scale * (slack + 2.0**-20 * positions)
    bad = ~((ours - theirs).abs() <= allowed)
    if bool(bad.any()):
        row, column = divmod(int(bad.flatten().nonzero()[0]), ours.shape[1])
        raise _violation(
            name,
            f"row {row}, column {column} is {float(ours[row, column]):.6g} in the cache and "
            f"{float(theirs[row, column]):.6g} in the module: the cache is not the table this "
            "module was built with (check rope_theta, the scaling and max_position against "
            "its get_rope call); verify=False installs it anyway",
        )


def cos_sin_cache_of(
    client: posenc.Client,
    rotary_emb: torch.nn.Module,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """:func:`cos_sin_cache` for a vLLM rotary module, from its own attributes
    (:func:`get_rope_arguments`): its buffer's shape, dtype and device unless told."""
    _check_vllm_version()
    head_size, max_position, rope = get_rope_arguments(rotary_emb)
    _, buffer = _buffer(rotary_emb)
    return cos_sin_cache(
        client,
        head_size,
        max_position,
        rope,
        mrope_positions_factor=1,
        dtype=dtype or buffer.dtype,
        device=device or buffer.device,
    )


def install_model(
    client: posenc.Client, model: torch.nn.Module, *, verify: bool = True
) -> list[str]:
    """Installs posenc's cache into every rotary module of a vLLM model it serves.

    In a vLLM worker, e.g. through ``LLM.apply_model``. Each distinct module (``get_rope``
    shares one between layers with the same arguments) gets :func:`cos_sin_cache_of` its
    own attributes, through :func:`install`. Modules of classes posenc does not serve are
    left alone and logged.

    Returns:
        The name of each module installed (the first, for a module shared by several).

    Raises:
        posenc.InvalidArgumentError: The model holds no served rotary module, or
            (``verify``) a cache differs from a module's own.
        UnsupportedVLLMError: The process runs a vLLM outside the supported range.
    """
    _check_vllm_version()
    installed: list[str] = []
    skipped: list[str] = []
    written: set[int] = set()  # the installed buffers' memory
    for name, module in model.named_modules():
        try:
            _, buffer = _buffer(module)
        except posenc.InvalidArgumentError:
            continue
        if type(module).__name__ in _SERVED_CLASSES:
            install(module, cos_sin_cache_of(client, module), verify=verify)
            installed.append(name)
            written.add(buffer.data_ptr())
        elif buffer.data_ptr() not in written:
            # Not a view of an installed cache (a fused kernel's module may hold one).
            skipped.append(f"{name} ({type(module).__name__})")
    if not installed:
        raise _violation("model", f"{type(model).__name__} holds no rotary module posenc serves")
    _log.info(
        "posenc installed %s; left alone: %s",
        ", ".join(installed),
        ", ".join(skipped) or "nothing",
    )
    return installed


def install(rotary_emb: torch.nn.Module, cache: torch.Tensor, *, verify: bool = True) -> None:
    """Copies ``cache`` into a vLLM rotary module in place, its buffers' dtype and device kept.

    The buffer is ``cos_sin_cache`` (``long_short_cos_sin_cache`` on Phi-3's class), which
    must have the cache's shape. A platform's second copy is refreshed too: ROCm's AITER path
    keeps ``cos_sin_cache_bf16`` beside a float32 or float16 cache (bfloat16, rounded from
    ``cache``). Layers that share one module (``get_rope`` caches them) need one call.

    Args:
        rotary_emb: The module, e.g. ``model.model.layers[0].self_attn.rotary_emb``.
        cache: :func:`cos_sin_cache`'s tensor for the ``get_rope`` arguments of the module.
        verify: Compare the leading rows with the module's own cache first and refuse a
            different table (wrong ``rope_theta``, scaling or row convention). False skips it,
            for a module whose buffer no longer holds vLLM's own values.

    Raises:
        posenc.InvalidArgumentError: No such buffer, another shape, or (``verify``) another
            table.
        UnsupportedVLLMError: The process runs a vLLM outside the supported range.
    """
    _check_vllm_version()
    name, buffer = _buffer(rotary_emb)
    if tuple(buffer.shape) != tuple(cache.shape):
        raise _violation(name, f"has shape {tuple(buffer.shape)}, the cache {tuple(cache.shape)}")
    if verify:
        _verify(name, buffer, cache)
    with torch.no_grad():
        buffer.copy_(cache)
        second = getattr(rotary_emb, "cos_sin_cache_bf16", None)
        if isinstance(second, torch.Tensor) and tuple(second.shape) == tuple(cache.shape):
            second.copy_(cache)
