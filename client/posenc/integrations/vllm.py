"""vLLM's rotary ``cos_sin_cache``, exact, from posenc.

vLLM's rotary embedding classes hold a table of ``[cos | sin]`` halves (``rotary_dim``
columns, one row per position up to the class's own maximum), computed in float32 at
start-up. :func:`cos_sin_cache` builds the same tensor -- same shape, same rows -- with
every value correctly rounded, for the arguments of vLLM's ``get_rope``::

    from posenc.integrations import vllm as pv

    cache = pv.cos_sin_cache(client, head_size=128, max_position=131072,
                             rope_parameters=hf_config.rope_parameters, dtype=torch.bfloat16)
    pv.install(model.model.layers[0].self_attn.rotary_emb, cache)   # or every layer's

Covered, as vLLM builds them (``get_rope`` dispatch on ``rope_type``): ``default``
(``RotaryEmbedding``), ``linear`` (``LinearScalingRotaryEmbedding``, one cache per factor,
concatenated), ``dynamic`` (``DynamicNTKScalingRotaryEmbedding``), ``yarn``
(``YaRNScalingRotaryEmbedding``), ``llama3`` (``Llama3RotaryEmbedding``) and ``longrope``
(``Phi3LongRoPEScaledRotaryEmbedding``: its ``long_short_cos_sin_cache``, the short table's
``original_max_position_embeddings`` rows then the long table's ``max_position`` rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import posenc
from posenc._output import as_tensor
from posenc._query import numpy_dtype

__all__ = ["cos_sin_cache", "install", "rows_of", "specs"]


def _violation(field: str, description: str) -> posenc.InvalidArgumentError:
    return posenc.InvalidArgumentError(
        f"invalid {field}: {description}", field_violations=[(field, description)]
    )


def rows_of(length: float) -> int:
    """Rows of ``torch.arange(length)``, as vLLM sizes its caches (``max_position * factor``
    may be a float: arange counts up to its ceiling)."""
    return math.ceil(length)


def specs(
    head_size: int, max_position: int, rope_parameters: Mapping[str, Any] | None = None
) -> list[tuple[posenc.Spec, int]]:
    """The posenc tables (vLLM layout) that make up vLLM's cache, each with its row count,
    in the order vLLM concatenates them."""
    rope = dict(rope_parameters or {})
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    common: dict[str, Any] = {"head_dim": head_size, "layout": "vllm"}
    common["rope_theta"] = float(rope.get("rope_theta", 10000))
    factor = float(rope.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        raise _violation("partial_rotary_factor", f"must be in (0, 1], got {factor}")
    if factor != 1.0:
        common["partial_rotary_factor"] = factor
    if "mrope_section" in rope or "alpha" in rope:
        raise _violation("rope_parameters", "vLLM's mrope and NTK-alpha caches are not served")
    if kind == "default":
        return [(posenc.Spec("rotary", **common), max_position)]
    if kind == "linear":
        factors = rope["factor"]
        listed: Sequence[float] = factors if isinstance(factors, Sequence) else [factors]
        return [
            (
                posenc.Spec("rotary", **common, scaling="linear", factor=float(f)),
                rows_of(max_position * f),
            )
            for f in listed
        ]
    if kind == "dynamic":
        # vLLM's "dynamic" cache is static: the NTK base at max_position * factor, which is
        # transformers' dynamic table at its initial seq_len (the base is unchanged there).
        f = float(rope["factor"])
        spec = posenc.Spec(
            "rotary", **common, scaling="dynamic", factor=f, max_position_embeddings=max_position
        )
        return [(spec, rows_of(max_position * f))]
    if kind == "llama3":
        spec = posenc.Spec(
            "rotary",
            **common,
            scaling="llama3",
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
        )
        return [(spec, max_position)]
    if kind == "yarn":
        return [_yarn(common, rope)]
    if kind == "longrope":
        return _longrope(common, rope, max_position)
    raise _violation("rope_parameters.rope_type", f"{kind!r} is not served")


def _yarn(common: dict[str, Any], rope: Mapping[str, Any]) -> tuple[posenc.Spec, int]:
    f = float(rope["factor"])
    original = int(rope["original_max_position_embeddings"])
    if float(rope.get("extrapolation_factor", 1.0)) != 1.0:
        raise _violation("rope_parameters.extrapolation_factor", "only 1 is served")
    fields: dict[str, Any] = {"factor": f, "original_max_position_embeddings": original}
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"):
        if rope.get(name) is not None:
            fields[name] = rope[name]
    if rope.get("attention_factor") is not None:
        fields["attention_factor"] = float(rope["attention_factor"])
    elif rope.get("attn_factor") is not None:
        # Older vLLM: the cos/sin scale is yarn_get_mscale(factor) * attn_factor.
        scale = 1.0 if f <= 1 else 0.1 * math.log(f) + 1.0
        fields["attention_factor"] = scale * float(rope["attn_factor"])
    spec = posenc.Spec("rotary", **common, scaling="yarn", **fields)
    # YaRNScalingRotaryEmbedding: ceil(original_max_position * factor) rows.
    return spec, rows_of(original * f)


def _longrope(
    common: dict[str, Any], rope: Mapping[str, Any], max_position: int
) -> list[tuple[posenc.Spec, int]]:
    original = int(rope["original_max_position_embeddings"])
    fields: dict[str, Any] = {
        "original_max_position_embeddings": original,
        # vLLM derives the scale from max_position / original, whatever rope["factor"] says.
        "max_position_embeddings": max_position,
        "short_factor": list(rope["short_factor"]),
        "long_factor": list(rope["long_factor"]),
    }
    short, long = dict(fields), dict(fields, seq_len=original + 1)
    if rope.get("short_mscale") is not None:
        short["attention_factor"] = float(rope["short_mscale"])
    if rope.get("long_mscale") is not None:
        long["attention_factor"] = float(rope["long_mscale"])
    return [
        (posenc.Spec("rotary", **common, scaling="longrope", **short), original),
        (posenc.Spec("rotary", **common, scaling="longrope", **long), max_position),
    ]


def cos_sin_cache(
    client: posenc.Client,
    head_size: int,
    max_position: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
) -> Any:
    """The cache tensor vLLM's rotary class for these ``get_rope`` arguments holds.

    Args:
        client: The client the rows are fetched with.
        head_size: ``head_size`` of ``get_rope`` (rotary_dim = head_size * partial factor).
        max_position: ``max_position`` of ``get_rope`` (the model's
            ``max_position_embeddings``).
        rope_parameters: ``rope_parameters`` of ``get_rope`` (``rope_type``, ``rope_theta``,
            ``partial_rotary_factor``, ``factor``, ...); ``None`` is the default rope.
        dtype: The cache's dtype (vLLM: the model's), computed by the server in it.
        device: Where the tensor goes (default CPU).

    Returns:
        ``[rows, rotary_dim]``: ``[cos | sin]`` halves, the rows of the class's cache.
    """
    parts = specs(head_size, max_position, rope_parameters)
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


def install(rotary_emb: torch.nn.Module, cache: torch.Tensor) -> None:
    """Copies ``cache`` into a vLLM rotary module's buffer (``cos_sin_cache``, or the Phi-3
    class's ``long_short_cos_sin_cache``), in place: same shape required, its dtype and
    device kept."""
    name = (
        "long_short_cos_sin_cache"
        if hasattr(rotary_emb, "long_short_cos_sin_cache")
        else "cos_sin_cache"
    )
    buffer = getattr(rotary_emb, name)
    if tuple(buffer.shape) != tuple(cache.shape):
        raise _violation(name, f"has shape {tuple(buffer.shape)}, the cache {tuple(cache.shape)}")
    with torch.no_grad():
        buffer.copy_(cache)
