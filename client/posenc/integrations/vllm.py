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

Tested against vLLM 0.33 and 0.34 (:data:`TESTED_VLLM`). Another release is served: every
cache installed is first compared with the module's own rows, and refused, in one line
naming the module and the row, if it differs; building a cache there warns
(:class:`UntestedReleaseWarning`). Covered, as ``get_rope`` builds them: ``default``
(``RotaryEmbedding``; with ``mrope_section``, ``MRotaryEmbedding``'s plain cache of
``max_position * mrope_positions_factor`` rows, and its subclasses' for Ernie 4.5-VL,
Bailing and openPangu), ``partial_rotary_factor`` and ``rope_dim``, ``linear``,
``dynamic`` (``max_trained_positions`` or ``alpha``), ``yarn`` (with ``mrope_section``
too), ``deepseek_yarn`` / ``deepseek_llama_scaling`` (DeepSeek's mscale ratio; the V4
class's float32 cache), ``ntk`` (with ``mixed_b``, from the module: its own float32
frequencies at exact angles), ``proportional`` (Gemma 4: the head's frequencies, zero past
``rotary_dim / 2``), ``llama3``, ``longrope`` (the short table's
``original_max_position_embeddings`` rows then the long table's ``max_position`` rows),
``mllama4`` (Llama 4's vision patches, complex), dual-chunk attention's five caches and
FoPE's (its learned mixing applied in float64 to exact angles). A model's subclass that
inherits a served class's cache methods is served as that class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc
import torch

import posenc
from posenc.integrations import _caches
from posenc.integrations._caches import (
    Plan,
    Run,
    UntestedReleaseWarning,
    llama4_vision_cache,
    rotary,
    violation,
)

__all__ = [
    "TESTED_VLLM",
    "UnsupportedVLLMError",
    "UntestedReleaseWarning",
    "caches_of",
    "cos_sin_cache",
    "cos_sin_cache_of",
    "get_rope_arguments",
    "install",
    "install_model",
    "rows_of",
    "specs",
]

_log = logging.getLogger(__name__)

#: The vLLM releases the tests run this module against, both included, as (major, minor):
#: every 0.33.x and 0.34.x. Others are served after each cache is checked at install.
TESTED_VLLM: Final[tuple[tuple[int, int], tuple[int, int]]] = ((0, 33), (0, 34))

_RELEASES: Final = _caches.Releases("vLLM", "vllm", *TESTED_VLLM)

rows_of = _caches.rows_of


class UnsupportedVLLMError(posenc.PosencError, RuntimeError):
    """A vLLM rotary module posenc has no table for (FAILED_PRECONDITION). Not raised: it
    stays for callers whose ``except`` names it, as no release is refused by its version
    (an untested one is served once each cache matches the module's own rows)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


def _rotary_dim(head_size: int, rope: Mapping[str, Any]) -> int:
    """get_rope's rotary_dim: ``rope_dim`` when set, else head_size * partial factor."""
    if rope.get("rope_dim"):
        return int(rope["rope_dim"])
    factor = float(rope.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        raise violation("partial_rotary_factor", f"must be in (0, 1], got {factor}")
    return int(head_size * factor)


def _yarn_fields(rope: Mapping[str, Any], factor: float, original: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"factor": factor, "original_max_position_embeddings": original}
    for name in ("beta_fast", "beta_slow", "truncate", "attention_factor"):
        if rope.get(name) is not None:
            fields[name] = rope[name]
    return fields


def _deepseek_attention(factor: float, mscale: float, mscale_all_dim: float) -> dict[str, Any]:
    """DeepseekScalingRotaryEmbedding's cos/sin scale, ``yarn_get_mscale(factor, mscale) /
    yarn_get_mscale(factor, mscale_all_dim)`` (defaults 1 and 0): the server's mscale ratio
    when both are non-zero (the same real number), else vLLM's value in double."""
    if mscale and mscale_all_dim:
        return {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
    ratio = _caches.yarn_mscale(factor, mscale) / _caches.yarn_mscale(factor, mscale_all_dim)
    return {"attention_factor": ratio}


def _ntk_spec(dim: int, theta: float, factor: float, mixed_b: Any) -> posenc.Spec:
    """NTKScalingRotaryEmbedding: fixed NTK is the default table of ``theta * factor``
    divided by ``factor ** (2 / dim)`` (both in double, as the class computes them)."""
    if mixed_b is not None:
        raise violation(
            "rope_parameters.mixed_b",
            "NTKScalingRotaryEmbedding with mixed_b scales each frequency by exp(a * i ** "
            "mixed_b) in float32: build it from the module, whose own frequencies are "
            "served (cos_sin_cache_of(client, module))",
        )
    return rotary(dim, theta * factor, scaling="linear", factor=factor ** (2 / dim))


@dataclass(frozen=True)
class _Call:
    """The ``get_rope`` arguments one rope type's plan reads."""

    rope: Mapping[str, Any]
    head_size: int
    max_position: int
    dim: int
    theta: float
    mrope: bool
    # get_rope's mrope_positions_factor with mrope_section (M-RoPE), else 1.
    positions_factor: int

    def one(self, rows: int, spec: posenc.Spec | None = None, kept: int | None = None) -> Plan:
        """A cache of one table (the default one unless ``spec``), ``rows`` long."""
        return Plan((Run(spec or rotary(self.dim, self.theta), rows),), kept)


def _default(c: _Call) -> Plan:
    if c.rope.get("use_fope") and not c.mrope:
        raise _caches.fope_refused("rope_parameters.use_fope")
    # MRotaryEmbedding's cache is the plain one, over max_position * positions_factor.
    return c.one(c.max_position * c.positions_factor)


def _bailing_mrope(c: _Call) -> Plan:
    # Its MRotaryEmbedding subclass keeps its default positions factor, 4.
    return c.one(c.max_position * 4)


def _openpangu(c: _Call) -> Plan:
    if not (c.mrope and c.rope.get("mrope_interleaved")):
        raise violation("rope_parameters", "openpangu needs mrope_section, interleaved")
    return _bailing_mrope(c)


def _proportional(c: _Call) -> Plan:
    # Gemma 4: the frequencies of the whole head, zero past rotary_dim / 2.
    return c.one(c.max_position, rotary(c.head_size, c.theta), c.dim // 2)


def _linear(c: _Call) -> Plan:
    factors = c.rope["factor"]
    listed: Sequence[float] = factors if isinstance(factors, Sequence) else [factors]
    return Plan(
        tuple(
            Run(
                rotary(c.dim, c.theta, scaling="linear", factor=float(f)),
                rows_of(c.max_position * f),
            )
            for f in listed
        )
    )


def _ntk(c: _Call) -> Plan:
    spec = _ntk_spec(c.dim, c.theta, float(c.rope["factor"]), c.rope.get("mixed_b"))
    return c.one(c.max_position, spec)


def _dynamic(c: _Call) -> Plan:
    # The base once at start-up, as the class computes it (in double), then a plain table of
    # max_position rows.
    rope = c.rope
    if "alpha" in rope:
        return c.one(
            c.max_position,
            rotary(c.dim, _caches.ntk_alpha_base(c.dim, c.theta, float(rope["alpha"]))),
        )
    if "factor" in rope:
        f = float(rope["factor"])
        trained = int(rope.get("max_trained_positions", c.max_position))
        base = _caches.ntk_base(c.dim, c.theta, f, c.max_position, trained)
        return c.one(c.max_position, rotary(c.dim, base))
    raise violation("rope_parameters", "dynamic scaling needs 'alpha' or 'factor'")


def _llama3(c: _Call) -> Plan:
    rope = c.rope
    spec = _caches.llama3(
        c.dim,
        c.theta,
        factor=float(rope["factor"]),
        original=int(rope["original_max_position_embeddings"]),
        low=float(rope["low_freq_factor"]),
        high=float(rope["high_freq_factor"]),
    )
    return c.one(c.max_position, spec)


def _yarn(c: _Call) -> Plan:
    # With mrope_section, MRotaryEmbedding: YaRN over original * positions_factor.
    rope = c.rope
    original = int(rope["original_max_position_embeddings"]) * c.positions_factor
    f = float(rope["factor"])
    fields = _yarn_fields(rope, f, original)
    if rope.get("attention_factor") is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        # vLLM takes the mscale ratio only when both are set and non-zero.
        fields["mscale"] = float(rope["mscale"])
        fields["mscale_all_dim"] = float(rope["mscale_all_dim"])
    return c.one(rows_of(original * f), rotary(c.dim, c.theta, scaling="yarn", **fields))


def _deepseek(c: _Call) -> Plan:
    # DeepseekScalingRotaryEmbedding (and the V4 class): YaRN's frequencies over the original
    # length, truncated range, the mscale ratio as the scale.
    rope = c.rope
    original = int(rope["original_max_position_embeddings"])
    f = float(rope["factor"])
    fields = {k: v for k, v in _yarn_fields(rope, f, original).items() if k != "truncate"}
    if "attention_factor" not in fields:
        fields.update(
            _deepseek_attention(
                f, float(rope.get("mscale", 1)), float(rope.get("mscale_all_dim", 0))
            )
        )
    return c.one(rows_of(original * f), rotary(c.dim, c.theta, scaling="yarn", **fields))


def _longrope(c: _Call) -> Plan:
    rope = c.rope
    original = int(rope["original_max_position_embeddings"])
    # vLLM derives the scale from max_position / original, whatever rope["factor"] says.
    factors = list(rope["short_factor"]), list(rope["long_factor"])
    short, long = rope.get("short_mscale"), rope.get("long_mscale")
    mscales = None if short is None else float(short), None if long is None else float(long)
    return Plan(_caches.longrope_runs(c.dim, c.theta, original, c.max_position, factors, mscales))


# One plan per rope type get_rope builds a cache of a concatenation of tables for.
_PLANS: Final[Mapping[str, Callable[[_Call], Plan]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "deepseek_yarn": _deepseek,
    "deepseek_llama_scaling": _deepseek,
    "ntk": _ntk,
    "proportional": _proportional,
    "llama3": _llama3,
    "longrope": _longrope,
    "bailing_mrope": _bailing_mrope,
    "openpangu": _openpangu,
}


def _plan(
    head_size: int,
    max_position: int,
    rope_parameters: Mapping[str, Any] | None,
    mrope_positions_factor: int,
) -> Plan:
    """The posenc tables of the cache ``get_rope`` builds for these arguments."""
    rope = dict(rope_parameters or {})
    if "rope_theta" not in rope:
        raise violation(
            "rope_parameters.rope_theta",
            "is not set: vLLM's get_rope then takes 10000, which is not most models' base; "
            "pass the model's (vLLM puts the config's rope_theta into "
            "hf_config.rope_parameters), 10000.0 if that is really its base",
        )
    if "type" in rope and "rope_type" not in rope:
        raise violation(
            "rope_parameters.type",
            "get_rope reads rope_type only (vLLM's config loading renames 'type'): pass "
            "hf_config.rope_parameters as vLLM loaded it",
        )
    kind = str(rope.get("rope_type", "default"))
    theta = float(rope["rope_theta"])
    dim = _rotary_dim(head_size, rope)
    plan = _PLANS.get(kind)
    if plan is None:
        served = ", ".join([*_PLANS, "mllama4"])
        raise violation("rope_parameters.rope_type", f"{kind!r} is not served (served: {served})")
    mrope = "mrope_section" in rope
    factor = mrope_positions_factor if mrope else 1
    return plan(_Call(rope, head_size, max_position, dim, theta, mrope, factor))


def specs(
    head_size: int,
    max_position: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    mrope_positions_factor: int = 4,
) -> list[tuple[posenc.Spec, int]]:
    """The posenc tables (vLLM layout) that make up vLLM's cache, each with its row count,
    in the order vLLM concatenates them. Arguments as :func:`cos_sin_cache`'s.

    Raises:
        posenc.InvalidArgumentError: Parameters ``get_rope`` builds no served cache from, or
            a cache that is no concatenation of tables (``proportional``'s zero frequencies,
            ``mllama4``'s patches: :func:`cos_sin_cache` builds those).
    """
    _RELEASES.warn("vLLM integration")
    if dict(rope_parameters or {}).get("rope_type") == "mllama4":
        raise violation(
            "rope_parameters.rope_type", "mllama4's cache is complex: use cos_sin_cache"
        )
    plan = _plan(head_size, max_position, rope_parameters, mrope_positions_factor)
    if plan.kept is not None:
        raise violation(
            "rope_parameters.rope_type",
            "proportional's cache sets the frequencies past rotary_dim / 2 to zero: use "
            "cos_sin_cache",
        )
    return [(run.spec, run.rows) for run in plan.runs]


# The classes whose cache is the plain default table over their max_position_embeddings.
_PLAIN: Final = frozenset(
    {
        "RotaryEmbedding",
        "MRotaryEmbedding",
        "MRotaryEmbeddingInterleaved",
        "BailingMRotaryEmbedding",
        "Ernie4_5_VLRotaryEmbedding",
    }
)
_SERVED_CLASSES: Final = (
    _PLAIN
    | _caches.BUILT
    | {
        "LinearScalingRotaryEmbedding",
        "DynamicNTKScalingRotaryEmbedding",
        "DynamicNTKAlphaRotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
        "DeepseekScalingRotaryEmbedding",
        "DeepseekV4ScalingRotaryEmbedding",
        "NTKScalingRotaryEmbedding",
        "Gemma4RotaryEmbedding",
        "Llama3RotaryEmbedding",
        "Phi3LongRoPEScaledRotaryEmbedding",
    }
)


_BUFFERS: Final = ("cos_sin_cache", "long_short_cos_sin_cache", "cos_sin_q_cache")
_ENGINE: Final = _caches.Engine(_RELEASES, _SERVED_CLASSES, _BUFFERS, _log)
_kind, _served = _ENGINE.kind, _ENGINE.reason


def _yarn_arguments(m: Any, yarn: bool) -> dict[str, Any]:
    # DeepSeek's ramp is YaRN's; only plain YaRN holds a truncate flag.
    rope = {
        "rope_type": "yarn" if yarn else "deepseek_yarn",
        "factor": float(m.scaling_factor),
        "original_max_position_embeddings": int(m.max_position_embeddings),
        "beta_fast": m.beta_fast,
        "beta_slow": m.beta_slow,
        "attention_factor": float(m.mscale),
    }
    if yarn:
        rope["truncate"] = bool(m.truncate)
    return rope


def _mrope_arguments(m: Any) -> dict[str, Any]:
    # MRotaryEmbedding with a scaling factor is YaRN's.
    return {} if m.scaling_factor is None else _yarn_arguments(m, True)


def _llama3_arguments(m: Any) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": float(m.scaling_factor),
        "low_freq_factor": float(m.low_freq_factor),
        "high_freq_factor": float(m.high_freq_factor),
        "original_max_position_embeddings": int(m.orig_max_position),
    }


def _longrope_arguments(m: Any) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "original_max_position_embeddings": int(m.original_max_position_embeddings),
        "short_factor": [float(f) for f in m.short_factor],
        "long_factor": [float(f) for f in m.long_factor],
        "short_mscale": float(m.short_mscale),
        "long_mscale": float(m.long_mscale),
    }


# The rope_parameters beyond rope_theta of each served class whose cache get_rope arguments
# describe (the plain classes need none).
_ARGUMENTS: Final[Mapping[str, Callable[[Any], dict[str, Any]]]] = {
    "MRotaryEmbedding": _mrope_arguments,
    "YaRNScalingRotaryEmbedding": lambda m: _yarn_arguments(m, True),
    "DeepseekScalingRotaryEmbedding": lambda m: _yarn_arguments(m, False),
    "DeepseekV4ScalingRotaryEmbedding": lambda m: _yarn_arguments(m, False),
    "LinearScalingRotaryEmbedding": lambda m: {
        "rope_type": "linear",
        "factor": [float(f) for f in m.scaling_factors],
    },
    "NTKScalingRotaryEmbedding": lambda m: {
        "rope_type": "ntk",
        "factor": float(m.scaling_factor),
        "mixed_b": m.mixed_b,
    },
    # Its rotary_dim is the head's; get_rope's was twice its rope_angles.
    "Gemma4RotaryEmbedding": lambda m: {
        "rope_type": "proportional",
        "rope_dim": 2 * int(m.rope_angles),
    },
    "Llama4VisionRotaryEmbedding": lambda m: {"rope_type": "mllama4"},
    "DynamicNTKScalingRotaryEmbedding": lambda m: {
        "rope_type": "dynamic",
        "factor": float(m.scaling_factor),
        "max_trained_positions": int(m.max_trained_positions),
    },
    "DynamicNTKAlphaRotaryEmbedding": lambda m: {
        "rope_type": "dynamic",
        "alpha": float(m.scaling_alpha),
    },
    "Llama3RotaryEmbedding": _llama3_arguments,
    "Phi3LongRoPEScaledRotaryEmbedding": _longrope_arguments,
}


@_caches.reads_attributes
def get_rope_arguments(rotary_emb: torch.nn.Module) -> tuple[int, int, dict[str, Any]]:
    """``(head_size, max_position, rope_parameters)`` that rebuild the cache of a vLLM rotary
    module from the module's own attributes (its ``base``, ``rotary_dim``, factors and
    row count), for :func:`specs` and :func:`cos_sin_cache` (``mrope_positions_factor=1``:
    an M-RoPE module's row count is already multiplied).

    Raises:
        posenc.InvalidArgumentError: A class posenc does not serve, or one whose cache no
            ``get_rope`` arguments describe (dual-chunk, FoPE: :func:`caches_of`).
    """
    m: Any = rotary_emb
    kind = _kind(m)
    reason = _served(m)
    if reason is not None or kind in ("DualChunkRotaryEmbedding", "FourierRotaryEmbedding"):
        raise violation(
            "rotary_emb", reason or f"{kind}'s caches are built by caches_of(client, module)"
        )
    rows = int(m.max_position_embeddings)
    arguments = _ARGUMENTS.get(kind)
    rope: dict[str, Any] = {"rope_theta": float(m.base), **(arguments(m) if arguments else {})}
    head_size = m.head_size if kind == "Gemma4RotaryEmbedding" else m.rotary_dim
    return int(head_size), rows, rope


def _buffer(rotary_emb: torch.nn.Module) -> tuple[str, torch.Tensor]:
    """The module's cache: ``cos_sin_cache``, or Phi-3's ``long_short_cos_sin_cache``."""
    for name in ("long_short_cos_sin_cache", "cos_sin_cache"):
        buffer = getattr(rotary_emb, name, None)
        if isinstance(buffer, torch.Tensor):
            return name, buffer
    raise violation(
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
        dtype: The cache's dtype (vLLM: the model's; ``torch.complex64`` for ``mllama4``;
            DeepSeek-V4's class keeps float32), computed by the server in it.
        device: Where the tensor goes (default CPU).

    Returns:
        ``[rows, rotary_dim]``: ``[cos | sin]`` halves, the rows of the class's cache
        (``mllama4``: ``[patches + 1, 1, rotary_dim]`` complex).

    Raises:
        posenc.InvalidArgumentError: Parameters ``get_rope`` builds no served cache from.
    """
    _RELEASES.warn("vLLM integration")
    rope = dict(rope_parameters or {})
    if rope.get("rope_type") == "mllama4" and "rope_theta" in rope:
        dim = _rotary_dim(head_size, rope)
        double = dtype in (torch.complex128, torch.float64, "float64", "complex128")
        return llama4_vision_cache(
            client, dim, max_position, float(rope["rope_theta"]), double, device
        )
    plan = _plan(head_size, max_position, rope, mrope_positions_factor)
    return _caches.fetch(client, plan, dtype, device)


@_caches.reads_attributes
def caches_of(client: posenc.Client, rotary_emb: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every cache buffer of a vLLM rotary module, by name, built from its own attributes
    in its buffers' dtype (on CPU): one for most classes, dual-chunk attention's five.

    Raises:
        posenc.InvalidArgumentError: A class posenc does not serve.
    """
    m: Any = rotary_emb
    kind, built = _ENGINE.built(client, m)
    if built is not None:
        return built
    name, buffer = _buffer(m)
    if kind == "NTKScalingRotaryEmbedding" and m.mixed_b is not None:
        # Mixed NTK has no closed form: the module's own float32 frequencies, exact angles.
        dim = int(m.rotary_dim)
        with torch.no_grad():
            spec = _caches.own_frequencies(dim, m._compute_inv_freq(m.base))
        plan = Plan((Run(spec, int(m.max_position_embeddings)),))
        return {name: _caches.fetch(client, plan, buffer.dtype)}
    head_size, max_position, rope = get_rope_arguments(m)
    plan = _plan(head_size, max_position, rope, 1)
    return {name: _caches.fetch(client, plan, buffer.dtype)}


@_caches.reads_attributes
def cos_sin_cache_of(
    client: posenc.Client,
    rotary_emb: torch.nn.Module,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """:func:`cos_sin_cache` for a vLLM rotary module, from its own attributes
    (:func:`get_rope_arguments`): its buffer's shape, dtype and device unless told.

    Raises:
        posenc.InvalidArgumentError: A class posenc does not serve, or one with several
            caches (dual-chunk attention: :func:`caches_of`).
    """
    kind = _ENGINE.single(rotary_emb)
    _, buffer = _buffer(rotary_emb)
    mixed = kind == "NTKScalingRotaryEmbedding" and getattr(rotary_emb, "mixed_b", None) is not None
    if kind in ("Llama4VisionRotaryEmbedding", "FourierRotaryEmbedding") or mixed:
        (cache,) = caches_of(client, rotary_emb).values()
        if dtype is not None:
            cache = cache.to(dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype))
        return cache.to(device or buffer.device)
    head_size, max_position, rope = get_rope_arguments(rotary_emb)
    return cos_sin_cache(
        client,
        head_size,
        max_position,
        rope,
        mrope_positions_factor=1,
        dtype=dtype or buffer.dtype,
        device=device or buffer.device,
    )


def _write(
    rotary_emb: torch.nn.Module,
    caches: Mapping[str, torch.Tensor],
    client: posenc.Client | None = None,
) -> None:
    # The client is not kept: vLLM does not grow a cache past its start-up rows.
    m: Any = rotary_emb
    _caches.copy_caches(m, caches)
    cache = caches.get("cos_sin_cache")
    second = getattr(m, "cos_sin_cache_bf16", None)
    if cache is not None and isinstance(second, torch.Tensor) and second.shape == cache.shape:
        with torch.no_grad():
            second.copy_(cache)
    if _kind(m) == "FourierRotaryEmbedding":
        m.update_cache = False  # its first forward would recompute the float32 rows


def install(
    rotary_emb: torch.nn.Module,
    cache: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    verify: bool = True,
) -> None:
    """Copies ``cache`` into a vLLM rotary module in place, its buffers' dtype and device kept.

    The buffer is ``cos_sin_cache`` (``long_short_cos_sin_cache`` on Phi-3's class), which
    must have the cache's shape; a mapping of buffer names to caches (:func:`caches_of`)
    installs several (dual-chunk attention's five). A platform's second copy is refreshed
    too: ROCm's AITER path keeps ``cos_sin_cache_bf16`` beside a float32 or float16 cache
    (bfloat16, rounded from ``cache``). FoPE's module is told its cache is current (its
    first forward would recompute it). Layers that share one module (``get_rope`` caches
    them) need one call.

    Args:
        rotary_emb: The module, e.g. ``model.model.layers[0].self_attn.rotary_emb``.
        cache: :func:`cos_sin_cache`'s tensor for the ``get_rope`` arguments of the module.
        verify: Compare the leading rows with the module's own cache first and refuse a
            different table (wrong ``rope_theta``, scaling or row convention; on a vLLM
            outside :data:`TESTED_VLLM`, a class that changed). False skips it, for a module
            whose buffer no longer holds vLLM's own values (inside the tested releases
            only: outside, every cache is compared).

    Raises:
        posenc.InvalidArgumentError: No such buffer, another shape, or (``verify``) another
            table: one line naming the module, the buffer and the row that differs.
    """
    caches = {_buffer(rotary_emb)[0]: cache} if isinstance(cache, torch.Tensor) else dict(cache)
    _ENGINE.install(rotary_emb, caches, _write, verify=verify)


def install_model(
    client: posenc.Client, model: torch.nn.Module, *, verify: bool = True
) -> list[str]:
    """Installs posenc's caches into every rotary module of a vLLM model it serves.

    In a vLLM worker, e.g. through ``LLM.apply_model``. Each distinct module (``get_rope``
    shares one between layers with the same arguments) gets :func:`caches_of` its own
    attributes, compared with its own rows (``verify``); every cache is built and checked
    before any is written, so a refusal leaves the model as it was. Modules posenc does not
    serve keep their caches and are named, with the reason, in one WARNING line of this
    module's logger.

    Returns:
        The name of each module installed (the first, for a module shared by several).

    Raises:
        posenc.InvalidArgumentError: The model holds no served rotary module, or
            (``verify``) a cache differs from a module's own.
    """
    return _ENGINE.install_model(client, model, caches_of, _write, verify=verify)
