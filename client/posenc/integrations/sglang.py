"""SGLang's rotary ``cos_sin_cache``, exact, from posenc, kept exact as SGLang grows it.

SGLang's rotary classes (``sglang.srt.layers.rotary_embedding``) hold vLLM's layout: one
``[cos | sin]`` row per position, ``rotary_dim`` columns, computed in float32 at start-up.
:func:`cos_sin_cache` builds the same tensor, every value correctly rounded, for the
arguments of SGLang's ``get_rope``; :func:`cos_sin_cache_of` does it from a built module's own
attributes, :func:`install` copies a cache into its module in place after checking it is
that module's table, and :func:`install_model` does all of it for every rotary module of a
loaded model::

    import posenc
    from posenc.integrations import sglang as ps

    client = posenc.Client("posenc.internal:50051")  # kept open: the caches may grow
    ps.install_model(model, client)  # e.g. model_runner.model, once loaded

Where SGLang differs from vLLM, the caches follow SGLang: ``MRotaryEmbedding`` holds
``max_position`` rows (not four times as many), dynamic NTK ``max_position * factor`` rows at
the base of the older formula, YaRN's scale includes ``attn_factor``, and Bailing's video
rope starts at position ``-max_position``. SGLang grows a cache at run time
(``_ensure_cos_sin_cache_length``, called for every rotary module before CUDA-graph capture
and by its indexers): an installed module's rows past the installed ones then come from
posenc too, continuing the same table, while the client is open (a closed client leaves
SGLang's own rows, with a warning). The ``cos_sin_cache_as(dtype)`` copy SGLang keeps is
dropped on install, so no pre-install cast is served.

Tested against SGLang 0.5.20 and 0.5.23 (:data:`TESTED_SGLANG`); another release is served
once each cache agrees with the module's own rows (:class:`UntestedReleaseWarning`), and
refused in one line naming the module and the row otherwise. SGLang importing some of vLLM
for its fallback kernels changes nothing here: only SGLang's version is read.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Final

import torch

import posenc
from posenc._output import as_tensor
from posenc.integrations import _caches
from posenc.integrations._caches import (
    Plan,
    Run,
    UntestedReleaseWarning,
    rotary,
    violation,
)

__all__ = [
    "TESTED_SGLANG",
    "UntestedReleaseWarning",
    "caches_of",
    "cos_sin_cache",
    "cos_sin_cache_of",
    "install",
    "install_model",
]

_log = logging.getLogger(__name__)

#: The SGLang releases the tests run this module against, both included.
TESTED_SGLANG: Final[tuple[tuple[int, int, int], tuple[int, int, int]]] = ((0, 5, 20), (0, 5, 23))

_RELEASES: Final = _caches.Releases("SGLang", "sglang", *TESTED_SGLANG)

# The classes whose cache is the plain default table over max_position_embeddings rows.
_PLAIN: Final = frozenset({"RotaryEmbedding", "MRotaryEmbedding", "Ernie4_5_VLRotaryEmbedding"})
_YARN: Final = frozenset(
    {"YaRNScalingRotaryEmbedding", "YaRNScalingMRotaryEmbedding", "DeepseekScalingRotaryEmbedding"}
)
_SERVED_CLASSES: Final = (
    _PLAIN
    | _YARN
    | _caches.BUILT
    | {
        "LinearScalingRotaryEmbedding",
        "DynamicNTKScalingRotaryEmbedding",
        "DynamicNTKAlphaRotaryEmbedding",
        "Llama3RotaryEmbedding",
        "Gemma4RotaryEmbedding",
        "Phi3LongRoPEScaledRotaryEmbedding",
        "BailingMRotaryEmbedding",
    }
)
_PHI3_BUFFERS: Final = ("short_cos_sin_cache", "long_cos_sin_cache", "long_short_cos_sin_cache")


_BUFFERS: Final = ("cos_sin_cache", *_PHI3_BUFFERS, "cos_sin_q_cache")
_ENGINE: Final = _caches.Engine(_RELEASES, _SERVED_CLASSES, _BUFFERS, _log)
_kind, _served = _ENGINE.kind, _ENGINE.reason


def _yarn(m: Any, original: int) -> posenc.Spec:
    """SGLang's YaRN frequencies (over ``original``) and its scale, the module's ``mscale``
    (``attn_factor`` included). An ``extrapolation_factor`` other than 1 scales the ramp,
    a form posenc's YaRN has not: the module's own float32 frequencies are served then,
    their angles exact."""
    extrapolation = float(getattr(m, "extrapolation_factor", 1))
    if extrapolation != 1:
        compute = getattr(m, "_compute_inv_freq", None)
        if compute is None:  # get_rope's arguments only: no frequencies to take
            raise violation(
                "rope_scaling.extrapolation_factor",
                f"{extrapolation:g} scales YaRN's ramp, which has no closed form here: "
                "build the cache from the module, cos_sin_cache_of(client, module)",
            )
        bailing = _kind(m) == "BailingMRotaryEmbedding"
        with torch.no_grad():
            inv_freq = compute(m.base if bailing else m.scaling_factor)
        return _caches.own_frequencies(int(m.rotary_dim), inv_freq, float(m.mscale))
    return rotary(
        int(m.rotary_dim),
        float(m.base),
        scaling="yarn",
        factor=float(m.scaling_factor),
        original_max_position_embeddings=original,
        beta_fast=float(m.beta_fast),
        beta_slow=float(m.beta_slow),
        truncate=bool(getattr(m, "truncate", True)),
        attention_factor=float(m.mscale),
    )


@dataclass(frozen=True)
class _Built:
    """A served module, as its cache's plan reads it."""

    m: Any
    dim: int
    theta: float
    rows: int
    start: int  # 0.5.23's Bailing video rope: negative

    def one(
        self, spec: posenc.Spec, count: int | None = None, kept: int | None = None
    ) -> dict[str, Plan]:
        """A ``cos_sin_cache`` of one table from ``start``, ``count`` rows (default all)."""
        rows = self.rows if count is None else count
        return {"cos_sin_cache": Plan((Run(spec, rows, self.start),), kept)}


def _plain_plan(b: _Built) -> dict[str, Plan]:
    return b.one(rotary(b.dim, b.theta))


def _linear_plan(b: _Built) -> dict[str, Plan]:
    runs = tuple(
        Run(rotary(b.dim, b.theta, scaling="linear", factor=float(f)), _caches.rows_of(b.rows * f))
        for f in b.m.scaling_factors
    )
    return {"cos_sin_cache": Plan(runs)}


def _dynamic_plan(b: _Built) -> dict[str, Plan]:
    # max_position * factor rows at the base of the older formula (in double, as the class
    # computes it): the base rescaled for that length.
    f = float(b.m.scaling_factor)
    length = b.rows * f
    base = _caches.ntk_base(b.dim, b.theta, f, length, b.rows)
    return b.one(rotary(b.dim, base), _caches.rows_of(length))


def _alpha_plan(b: _Built) -> dict[str, Plan]:
    return b.one(rotary(b.dim, _caches.ntk_alpha_base(b.dim, b.theta, float(b.m.scaling_alpha))))


def _yarn_plan(b: _Built) -> dict[str, Plan]:
    return b.one(_yarn(b.m, b.rows), _caches.rows_of(b.rows * float(b.m.scaling_factor)))


def _bailing_plan(b: _Built) -> dict[str, Plan]:
    # Rows from position_start (-max_position with video rope); YaRN above factor 1.
    if float(b.m.scaling_factor) > 1:
        return b.one(_yarn(b.m, int(b.m.original_max_position_embeddings)))
    return b.one(rotary(b.dim, b.theta))


def _llama3_plan(b: _Built) -> dict[str, Plan]:
    m = b.m
    spec = _caches.llama3(
        b.dim,
        b.theta,
        factor=float(m.scaling_factor),
        original=int(m.orig_max_position),
        low=float(m.low_freq_factor),
        high=float(m.high_freq_factor),
    )
    return b.one(spec)


def _gemma4_plan(b: _Built) -> dict[str, Plan]:
    # The head's frequencies, zero past rope_angles (its rotary_dim is the head's).
    return b.one(rotary(int(b.m.head_size), b.theta), kept=int(b.m.rope_angles))


def _longrope_plan(b: _Built) -> dict[str, Plan]:
    m = b.m
    original = int(m.original_max_position_embeddings)
    factors = [float(f) for f in m.short_factor], [float(f) for f in m.long_factor]
    mscales = float(m.short_mscale), float(m.long_mscale)
    short, long = _caches.longrope_runs(b.dim, b.theta, original, b.rows, factors, mscales)
    return {
        "short_cos_sin_cache": Plan((short,)),
        "long_cos_sin_cache": Plan((long,)),
        "long_short_cos_sin_cache": Plan((short, long)),
    }


# The plans of each served class whose caches are runs of tables, by buffer name.
_PLANS: Final[Mapping[str, Callable[[_Built], dict[str, Plan]]]] = {
    **dict.fromkeys(_PLAIN, _plain_plan),
    **dict.fromkeys(_YARN, _yarn_plan),
    "LinearScalingRotaryEmbedding": _linear_plan,
    "DynamicNTKScalingRotaryEmbedding": _dynamic_plan,
    "DynamicNTKAlphaRotaryEmbedding": _alpha_plan,
    "BailingMRotaryEmbedding": _bailing_plan,
    "Llama3RotaryEmbedding": _llama3_plan,
    "Gemma4RotaryEmbedding": _gemma4_plan,
    "Phi3LongRoPEScaledRotaryEmbedding": _longrope_plan,
}


def _plans(rotary_emb: torch.nn.Module) -> dict[str, Plan]:
    """The posenc tables of each cache buffer of a module served by a plan, by name."""
    m: Any = rotary_emb
    kind = _kind(m)
    dim, theta, rows = int(m.rotary_dim), float(m.base), int(m.max_position_embeddings)
    plan = _PLANS.get(kind)
    if plan is None:
        raise violation("rotary_emb", _served(m) or f"{kind} is built by caches_of")
    return plan(_Built(m, dim, theta, rows, int(getattr(m, "position_start", 0))))


def _fitted(plan: Plan, buffer: torch.Tensor) -> Plan:
    """The plan over the buffer's rows: a cache SGLang has grown continues its last table."""
    return plan.grown(len(buffer) - plan.rows) if len(buffer) > plan.rows else plan


@_caches.reads_attributes
def caches_of(client: posenc.Client, rotary_emb: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every cache buffer of an SGLang rotary module, by name, built from its own
    attributes in its buffers' dtype, over their current rows (on CPU).

    Raises:
        posenc.InvalidArgumentError: A class or a setting posenc does not serve.
    """
    m: Any = rotary_emb
    _, built = _ENGINE.built(client, m)
    if built is not None:
        return built
    caches = {}
    for name, plan in _plans(m).items():
        buffer = getattr(m, name)
        caches[name] = _caches.fetch(client, _fitted(plan, buffer), buffer.dtype)
    return caches


@_caches.reads_attributes
def cos_sin_cache_of(
    client: posenc.Client,
    rotary_emb: torch.nn.Module,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """The ``cos_sin_cache`` (Phi-3: ``long_short_cos_sin_cache``) of an SGLang rotary
    module from its own attributes, over its current rows: its buffer's dtype and device
    unless told.

    Raises:
        posenc.InvalidArgumentError: A class or a setting posenc does not serve, or one with
            several caches (dual-chunk attention: :func:`caches_of`).
    """
    m: Any = rotary_emb
    kind = _ENGINE.single(m)
    name = "long_short_cos_sin_cache" if kind == "Phi3LongRoPEScaledRotaryEmbedding" else None
    if kind in _caches.BUILT or dtype is None:
        caches = caches_of(client, m)
        cache = caches[name or "cos_sin_cache"]
        if dtype is not None:
            cache = cache.to(dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype))
        return cache.to(device or getattr(m, name or "cos_sin_cache").device)
    plan = _plans(m)[name or "cos_sin_cache"]
    buffer = getattr(m, name or "cos_sin_cache")
    return _caches.fetch(client, _fitted(plan, buffer), dtype, device or buffer.device)


def _scaling_name(rope_scaling: Mapping[str, Any]) -> str:
    if "rope_type" in rope_scaling:
        return str(rope_scaling["rope_type"])
    if "type" in rope_scaling:
        return str(rope_scaling["type"])
    raise violation("rope_scaling", f"names no rope_type (or type): {dict(rope_scaling)}")


@dataclass(frozen=True)
class _Arguments:
    """SGLang's ``get_rope`` arguments, as the module it builds from them reads them."""

    attributes: Mapping[str, Any]  # head_size, rotary_dim, max_position_embeddings, base
    rope: Mapping[str, Any]
    original: int
    factors: Any  # a list for linear (one cache per factor)
    factor: float
    yarn: Mapping[str, Any]  # YaRN's settings beyond the factor, with SGLang's defaults

    def named(self, kind: str, **attributes: Any) -> Any:
        """A stand-in for the module: the class's name, the attributes it sets."""
        return type(kind, (SimpleNamespace,), {})(**{**self.attributes, **attributes})


def _bailing_module(a: _Arguments) -> Any:
    # BailingMRotaryEmbedding: from -max_position, max_position + original * factor rows.
    max_position = int(a.attributes["max_position_embeddings"])
    factor = a.factor
    mscale = _caches.yarn_mscale(factor) * a.yarn["attn_factor"] if factor > 1 else 1.0
    return a.named(
        "BailingMRotaryEmbedding",
        **a.yarn,
        scaling_factor=factor,
        original_max_position_embeddings=a.original,
        mscale=mscale,
        position_start=-max_position,
        max_position_embeddings=max_position + int(a.original * factor),
    )


def _default_module(a: _Arguments) -> Any:
    if a.rope.get("use_fope"):
        raise _caches.fope_refused("rope_scaling.use_fope")
    return a.named("MRotaryEmbedding" if "mrope_section" in a.rope else "RotaryEmbedding")


def _llama3_module(a: _Arguments) -> Any:
    return a.named(
        "Llama3RotaryEmbedding",
        scaling_factor=a.factor,
        low_freq_factor=float(a.rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(a.rope.get("high_freq_factor", 4.0)),
        orig_max_position=a.original,
    )


def _linear_module(a: _Arguments) -> Any:
    listed = list(a.factors) if isinstance(a.factors, list | tuple) else [a.factors]
    return a.named("LinearScalingRotaryEmbedding", scaling_factors=listed)


def _dynamic_module(a: _Arguments) -> Any:
    if "alpha" in a.rope:
        return a.named("DynamicNTKAlphaRotaryEmbedding", scaling_alpha=float(a.rope["alpha"]))
    return a.named("DynamicNTKScalingRotaryEmbedding", scaling_factor=a.factor)


def _yarn_module(a: _Arguments, cls: str, ratio: float) -> Any:
    return a.named(
        cls,
        **a.yarn,
        scaling_factor=a.factor,
        max_position_embeddings=a.original,
        mscale=float(ratio * a.yarn["attn_factor"]),
    )


def _mscale_ratio(a: _Arguments, mscale: float, mscale_all_dim: float) -> float:
    return _caches.yarn_mscale(a.factor, mscale) / _caches.yarn_mscale(a.factor, mscale_all_dim)


def _yarn_scaling_module(a: _Arguments) -> Any:
    rope = a.rope
    if "mrope_section" in rope:
        return _yarn_module(a, "YaRNScalingMRotaryEmbedding", _caches.yarn_mscale(a.factor))
    if rope.get("mscale") is not None and rope.get("mscale_all_dim") is not None:
        ratio = _mscale_ratio(a, float(rope["mscale"]), float(rope["mscale_all_dim"]))
        return _yarn_module(a, "YaRNScalingRotaryEmbedding", ratio)
    return _yarn_module(a, "YaRNScalingRotaryEmbedding", _caches.yarn_mscale(a.factor))


def _deepseek_module(a: _Arguments) -> Any:
    ratio = _mscale_ratio(a, float(a.rope.get("mscale", 1)), float(a.rope.get("mscale_all_dim", 0)))
    return _yarn_module(a, "DeepseekScalingRotaryEmbedding", ratio)


def _longrope_module(a: _Arguments) -> Any:
    scale = int(a.attributes["max_position_embeddings"]) / a.original
    derived = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(a.original))
    return a.named(
        "Phi3LongRoPEScaledRotaryEmbedding",
        original_max_position_embeddings=a.original,
        short_factor=list(a.rope["short_factor"]),
        long_factor=list(a.rope["long_factor"]),
        short_mscale=a.rope.get("short_mscale", derived),
        long_mscale=a.rope.get("long_mscale", derived),
    )


def _proportional_module(a: _Arguments) -> Any:
    rotary_dim, head_size = a.attributes["rotary_dim"], a.attributes["head_size"]
    return a.named("Gemma4RotaryEmbedding", rope_angles=rotary_dim // 2, rotary_dim=head_size)


# The module get_rope builds for each rope type it is given.
_MODULES: Final[Mapping[str, Callable[[_Arguments], Any]]] = {
    "default": _default_module,
    "llama3": _llama3_module,
    "linear": _linear_module,
    "dynamic": _dynamic_module,
    "yarn": _yarn_scaling_module,
    "deepseek_yarn": _deepseek_module,
    "longrope": _longrope_module,
    "proportional": _proportional_module,
}


def _module_of(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None,
    partial_rotary_factor: float,
) -> Any:
    """The attributes of the module SGLang's ``get_rope`` builds for these arguments, as
    its classes set them (a stand-in with the class's name, for :func:`_plans`)."""
    if partial_rotary_factor < 1.0:
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    attributes = {
        "head_size": head_size,
        "rotary_dim": rotary_dim,
        "max_position_embeddings": max_position,
        "base": base,
    }
    if rope_scaling is None:
        return _Arguments(attributes, {}, max_position, 1.0, 1.0, {}).named("RotaryEmbedding")
    rope = dict(rope_scaling)
    kind = _scaling_name(rope)
    yarn = {
        "extrapolation_factor": rope.get("extrapolation_factor", 1),
        "attn_factor": float(rope.get("attn_factor", 1)),
        "beta_fast": rope.get("beta_fast", 32),
        "beta_slow": rope.get("beta_slow", 1),
        "truncate": rope.get("truncate", True),
    }
    original = int(rope.get("original_max_position_embeddings", max_position))
    factors = rope.get("factor", 1.0)
    factor = float(factors) if not isinstance(factors, list | tuple) else 1.0
    a = _Arguments(attributes, rope, original, factors, factor, yarn)
    if "mrope_section" in rope and rope.get("video_rope") and kind in ("default", "yarn"):
        return _bailing_module(a)
    build = _MODULES.get(kind)
    if build is None:
        served = ", ".join(_MODULES)
        raise violation("rope_scaling.rope_type", f"{kind!r} is not served (served: {served})")
    return build(a)


def cos_sin_cache(
    client: posenc.Client,
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
    *,
    partial_rotary_factor: float = 1.0,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
) -> Any:
    """The cache SGLang's rotary class for these ``get_rope`` arguments holds at start-up.

    Args:
        client: The client the rows are fetched with.
        head_size, rotary_dim, max_position, base, rope_scaling, partial_rotary_factor:
            SGLang's ``get_rope`` arguments of the same names (``rope_scaling``: the
            model's, ``rope_type`` or ``type`` naming the scaling).
        dtype: The cache's dtype (SGLang keeps float32 on CUDA, the model's dtype on CPU),
            computed by the server in it.
        device: Where the tensor goes (default CPU).

    Returns:
        ``[rows, rotary_dim]`` (Gemma 4: ``head_size`` columns): ``[cos | sin]`` halves.
        Phi-3's class: its ``long_short_cos_sin_cache``.

    Raises:
        posenc.InvalidArgumentError: Arguments SGLang builds no served cache from.
    """
    _RELEASES.warn("SGLang integration")
    m = _module_of(head_size, rotary_dim, max_position, base, rope_scaling, partial_rotary_factor)
    plans = _plans(m)
    plan = plans.get("long_short_cos_sin_cache") or plans["cos_sin_cache"]
    return _caches.fetch(client, plan, dtype, device)


class _Growth:
    """An installed module's ``_ensure_cos_sin_cache_length``: SGLang's own, then the rows
    it added (or rebuilt: Bailing's scaled cache) replaced by posenc's of the same table."""

    def __init__(self, module: Any, client: posenc.Client, plan: Plan, original: Any) -> None:
        self.module, self.client, self.plan, self.original = module, client, plan, original

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copied module's growth: the same wrapping, of the copy (the client is shared:
        a connection cannot be copied)."""
        copy = memo.get(id(self.module))
        if copy is None:  # the wrapper copied alone: SGLang's own method of its module
            return self.original
        original = types.MethodType(self.original.__func__, copy)
        return _Growth(copy, self.client, self.plan, original)

    def __call__(self, needed_max_pos: int) -> None:
        m = self.module
        before = m.cos_sin_cache
        self.original(needed_max_pos)
        after = m.cos_sin_cache
        if after is before and len(after) == len(before):
            return
        grown = self.plan.grown(len(after) - self.plan.rows)
        try:
            rows = _caches.fetch_rows(
                self.client, grown, self.plan.rows, grown.rows - self.plan.rows, after.dtype
            )
        except Exception as error:  # serving goes on with SGLang's own rows
            _log.warning(
                "posenc could not fetch rows %d to %d of %s's cache (%s): SGLang's own "
                "float32 rows are kept there",
                self.plan.rows,
                grown.rows - 1,
                type(m).__name__,
                error,
            )
            return
        with torch.no_grad():
            after[: len(before)] = before  # a rebuilt cache: posenc's rows again
            after[self.plan.rows :] = as_tensor(rows).to(after.device)
        self.plan = grown
        _reset_memo(m)


def _reset_memo(m: Any) -> None:
    """Drops the ``cos_sin_cache_as(dtype)`` copy SGLang keeps (it would keep serving the
    cast of the rows it replaced: the memo keys on the tensor, written in place)."""
    if "_cos_sin_cache_cast" in vars(type(m)) or hasattr(m, "_cos_sin_cache_cast"):
        m._cos_sin_cache_cast = None


def _write(
    rotary_emb: torch.nn.Module,
    caches: Mapping[str, torch.Tensor],
    client: posenc.Client | None,
) -> None:
    m: Any = rotary_emb
    _caches.copy_caches(m, caches)
    _reset_memo(m)
    kind = _kind(m)
    if kind == "FourierRotaryEmbedding":
        m.update_buffer = True  # its first forward would recompute the float32 rows
    ensure = getattr(m, "_ensure_cos_sin_cache_length", None)
    if client is None or ensure is None or kind in _caches.BUILT or "cos_sin_cache" not in caches:
        return
    if isinstance(ensure, _Growth):
        ensure.client = client
        ensure.plan = _fitted(_plans(m)["cos_sin_cache"], m.cos_sin_cache)
        return
    plan = _fitted(_plans(m)["cos_sin_cache"], m.cos_sin_cache)
    # An instance attribute: the class (shared by every module) is left as it is.
    object.__setattr__(m, "_ensure_cos_sin_cache_length", _Growth(m, client, plan, ensure))


def install(
    rotary_emb: torch.nn.Module,
    cache: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    client: posenc.Client | None = None,
    verify: bool = True,
) -> None:
    """Copies ``cache`` into an SGLang rotary module in place, its buffer's dtype and device
    kept, and drops SGLang's cast copy of the old rows.

    Args:
        rotary_emb: The module.
        cache: :func:`cos_sin_cache_of`'s tensor (the module's ``cos_sin_cache``; Phi-3's
            ``long_short_cos_sin_cache``), or a mapping of buffer names to caches
            (:func:`caches_of`: Phi-3's three, dual-chunk attention's five).
        client: The client rows are fetched with when SGLang grows the cache later; None
            leaves the rows SGLang appends its own.
        verify: Compare the leading rows with the module's own first and refuse another
            table; False skips it (inside :data:`TESTED_SGLANG` only: outside, every cache
            is compared).

    Raises:
        posenc.InvalidArgumentError: No such buffer, another shape, or (``verify``) another
            table: one line naming the module, the buffer and the row that differs.
    """
    if isinstance(cache, torch.Tensor) and _kind(rotary_emb) == "Phi3LongRoPEScaledRotaryEmbedding":
        # The stacked cache, and the short and long tables it stacks (buffers of their own).
        short = int(getattr(rotary_emb, "original_max_position_embeddings", 0))
        caches = {
            "long_short_cos_sin_cache": cache,
            "short_cos_sin_cache": cache[:short],
            "long_cos_sin_cache": cache[short:],
        }
    elif isinstance(cache, torch.Tensor):
        caches = {"cos_sin_cache": cache}
    else:
        caches = dict(cache)
    _ENGINE.install(rotary_emb, caches, _write, verify=verify, client=client)


def install_model(
    model: torch.nn.Module, client: posenc.Client, *, verify: bool = True
) -> list[str]:
    """Installs posenc's caches into every rotary module of a loaded SGLang model, as
    :func:`posenc.integrations.vllm.install_model` does into a vLLM model's (the same
    checks, the same all-or-nothing install, the same WARNING line naming the modules
    left), each module's caches over its current rows. Rows SGLang adds later come from
    ``client`` (keep it open).

    Returns:
        The name of each module installed (the first, for a module shared by several).

    Raises:
        posenc.InvalidArgumentError: The model holds no served rotary module, or
            (``verify``) a cache differs from a module's own.
    """
    return _ENGINE.install_model(client, model, caches_of, _write, verify=verify)
