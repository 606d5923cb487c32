"""posenc.integrations.vllm builds the cos_sin_cache of vLLM's rotary classes.

vLLM is a CUDA install and cannot run here, so each class's ``_compute_cos_sin_cache`` (and
the ``_compute_inv_freq`` it calls) is transcribed below line by line, from
github.com/vllm-project/vllm, ``vllm/model_executor/layers/rotary_embedding/``:

- ``base.py`` @ 04458da0: ``RotaryEmbedding``
- ``linear_scaling_rope.py`` @ 0f17ee06: ``LinearScalingRotaryEmbedding``
- ``dynamic_ntk_scaling_rope.py`` @ 3cfbaf33: ``DynamicNTKScalingRotaryEmbedding``
- ``yarn_scaling_rope.py`` @ 0cd57848 and ``common.py`` @ 002d181a (``yarn_*`` helpers):
  ``YaRNScalingRotaryEmbedding``; the class passes ``truncate`` to
  ``yarn_find_correction_range``, which floors/ceils only when it is true (as transformers)
- ``llama3_rope.py`` @ 045d7575: ``Llama3RotaryEmbedding``
- ``phi3_long_rope_scaled_rope.py`` @ 17d618b0: ``Phi3LongRoPEScaledRotaryEmbedding``
- ``__init__.py`` @ 07b12f1b: ``get_rope`` (which class, with which max position)

The transcriptions take a ``dtype``: float32 is vLLM's arithmetic, float64 the same formulas
without its rounding. posenc's cache has vLLM's exact shape, matches the float64 run within
float32 rounding, and the float32 run (vLLM itself) within float32's angle error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")

import posenc  # noqa: E402
from posenc.integrations import vllm as pv  # noqa: E402

EPS32 = 2.0**-24


@pytest.fixture
def client(server: Any) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as client:
        yield client


# -- the transcriptions ---------------------------------------------------------------------------


class Base:
    """RotaryEmbedding (base.py)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, dtype: Any) -> None:  # fmt: skip
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.float = dtype  # vLLM: torch.float

    def _compute_inv_freq(self, base: float) -> Any:
        inv_freq = 1.0 / (
            base ** (torch.arange(0, self.rotary_dim, 2, dtype=self.float) / self.rotary_dim)
        )
        return inv_freq

    def _compute_cos_sin_cache(self) -> Any:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=self.float)

        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cos = freqs.cos()
        sin = freqs.sin()
        cache = torch.cat((cos, sin), dim=-1)
        return cache


class Linear(Base):
    """LinearScalingRotaryEmbedding (linear_scaling_rope.py)."""

    def __init__(self, *args: Any, scaling_factors: list[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scaling_factors = scaling_factors

    def _compute_cos_sin_cache(self) -> Any:
        inv_freq = self._compute_inv_freq(self.base)
        cache_list = []
        for scaling_factor in self.scaling_factors:
            max_len = self.max_position_embeddings * scaling_factor
            t = torch.arange(max_len, dtype=self.float)
            t = t / scaling_factor

            freqs = torch.einsum("i,j -> ij", t, inv_freq)
            cos = freqs.cos()
            sin = freqs.sin()
            cache = torch.cat((cos, sin), dim=-1)
            cache_list.append(cache)
        return torch.cat(cache_list, dim=0)


class DynamicNTK(Base):
    """DynamicNTKScalingRotaryEmbedding (dynamic_ntk_scaling_rope.py)."""

    def __init__(self, *args: Any, scaling_factor: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scaling_factor = scaling_factor

    def _compute_cos_sin_cache(self) -> Any:
        max_len = self.max_position_embeddings * self.scaling_factor
        base = self.base * (
            (max_len / self.max_position_embeddings) - (self.scaling_factor - 1)
        ) ** (self.rotary_dim / (self.rotary_dim - 2))
        inv_freq = self._compute_inv_freq(base)
        t = torch.arange(max_len, dtype=self.float)

        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cos = freqs.cos()
        sin = freqs.sin()
        cache = torch.cat((cos, sin), dim=-1)
        return cache


def yarn_find_correction_dim(num_rotations: float, dim: int, base: float,
                             max_position_embeddings: int) -> float:  # fmt: skip
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base)
    )


def yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                               max_position_embeddings: int,
                               truncate: bool) -> tuple[Any, Any]:  # fmt: skip
    low = yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings)
    high = yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings)
    if truncate:
        low = math.floor(low)
        high = math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp_mask(low: float, high: float, dim: int, dtype: Any) -> Any:
    if low == high:
        high += 0.001  # Prevent singularity

    linear_func = (torch.arange(dim, dtype=dtype) - low) / (high - low)
    ramp_func = torch.clamp(linear_func, 0, 1)
    return ramp_func


def yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class YaRN(Base):
    """YaRNScalingRotaryEmbedding (yarn_scaling_rope.py)."""

    def __init__(self, *args: Any, scaling_factor: float, beta_fast: float = 32,
                 beta_slow: float = 1, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None,
                 truncate: bool = True, **kwargs: Any) -> None:  # fmt: skip
        self.scaling_factor = scaling_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        if attention_factor is not None:
            self.mscale = float(attention_factor)
        elif mscale and mscale_all_dim:
            self.mscale = float(
                yarn_get_mscale(self.scaling_factor, mscale)
                / yarn_get_mscale(self.scaling_factor, mscale_all_dim)
            )
        else:
            self.mscale = float(yarn_get_mscale(self.scaling_factor))
        super().__init__(*args, **kwargs)

    def _compute_inv_freq(self, scaling_factor: float) -> Any:
        pos_freqs = self.base ** (
            torch.arange(0, self.rotary_dim, 2, dtype=self.float) / self.rotary_dim
        )
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (scaling_factor * pos_freqs)

        low, high = yarn_find_correction_range(
            self.beta_fast,
            self.beta_slow,
            self.rotary_dim,
            self.base,
            self.max_position_embeddings,
            self.truncate,
        )
        inv_freq_mask = 1 - yarn_linear_ramp_mask(low, high, self.rotary_dim // 2, dtype=self.float)
        inv_freq = inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * (
            inv_freq_mask
        )
        return inv_freq

    def _compute_cos_sin_cache(self) -> Any:
        inv_freq = self._compute_inv_freq(self.scaling_factor)
        num_positions = math.ceil(self.max_position_embeddings * self.scaling_factor)
        t = torch.arange(num_positions, dtype=self.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cos = freqs.cos() * self.mscale
        sin = freqs.sin() * self.mscale
        cache = torch.cat((cos, sin), dim=-1)
        return cache


class Llama3(Base):
    """Llama3RotaryEmbedding (llama3_rope.py)."""

    def __init__(self, *args: Any, scaling_factor: float, low_freq_factor: float,
                 high_freq_factor: float, orig_max_position: int,
                 **kwargs: Any) -> None:  # fmt: skip
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(*args, **kwargs)

    def _compute_inv_freq(self, base: float) -> Any:
        inv_freqs = super()._compute_inv_freq(base)
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor

        wave_len = 2 * math.pi / inv_freqs
        if self.low_freq_factor != self.high_freq_factor:
            smooth = (self.orig_max_position / wave_len - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
        else:
            smooth = 0
        new_freqs = torch.where(
            wave_len < high_freq_wavelen,
            inv_freqs,
            torch.where(
                wave_len > low_freq_wavelen,
                inv_freqs / self.scaling_factor,
                (1 - smooth) * inv_freqs / self.scaling_factor + smooth * inv_freqs,
            ),
        )
        return new_freqs


class Phi3LongRoPE:
    """Phi3LongRoPEScaledRotaryEmbedding (phi3_long_rope_scaled_rope.py)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 original_max_position_embeddings: int, base: float, short_factor: list[float],
                 long_factor: list[float], dtype: Any) -> None:  # fmt: skip
        self.rotary_dim = rotary_dim
        self.head_size = head_size
        self.max_position_embeddings = max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.base = base
        self.float = dtype
        scale = self.max_position_embeddings / self.original_max_position_embeddings
        if scale <= 1.0:
            scaling_factor = 1.0
        else:
            scaling_factor = math.sqrt(
                1 + math.log(scale) / math.log(self.original_max_position_embeddings)
            )
        short_cache = self._compute_cos_sin_cache(
            original_max_position_embeddings, short_factor, scaling_factor
        )
        long_cache = self._compute_cos_sin_cache(
            max_position_embeddings, long_factor, scaling_factor
        )
        self.long_short_cos_sin_cache = torch.cat([short_cache, long_cache], dim=0)

    def _compute_inv_freq(self, rescale_factors: list[float]) -> Any:
        factors = torch.tensor(rescale_factors, dtype=self.float)
        inv_freq = 1.0 / (
            factors
            * (
                self.base
                ** (torch.arange(0, self.rotary_dim, 2, dtype=self.float) / self.rotary_dim)
            )
        )
        return inv_freq

    def _compute_cos_sin_cache(self, max_position_embeddings: int, rescale_factors: list[float],
                               mscale: float) -> Any:  # fmt: skip
        inv_freq = self._compute_inv_freq(rescale_factors)
        t = torch.arange(max_position_embeddings, dtype=self.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cos = freqs.cos() * mscale
        sin = freqs.sin() * mscale
        cache = torch.cat((cos, sin), dim=-1)
        return cache


def vllm_cache(head_size: int, max_position: int, rope: dict[str, Any], dtype: Any) -> Any:
    """get_rope's dispatch (``__init__.py``): the class and its arguments, its cache."""
    base = rope.get("rope_theta", 10000)
    kind = rope.get("rope_type", "default")
    rotary_dim = int(head_size * rope.get("partial_rotary_factor", 1.0))
    args = (head_size, rotary_dim)
    if kind == "default":
        return Base(*args, max_position, base, dtype)._compute_cos_sin_cache()
    if kind == "linear":
        factors = rope["factor"] if isinstance(rope["factor"], list) else [rope["factor"]]
        module = Linear(*args, max_position, base, dtype, scaling_factors=factors)
        return module._compute_cos_sin_cache()
    if kind == "dynamic":
        module = DynamicNTK(*args, max_position, base, dtype, scaling_factor=rope["factor"])
        return module._compute_cos_sin_cache()
    if kind == "llama3":
        return Llama3(
            *args,
            max_position,
            base,
            dtype,
            scaling_factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            orig_max_position=rope["original_max_position_embeddings"],
        )._compute_cos_sin_cache()
    if kind == "yarn":
        extra = {
            k: v
            for k, v in rope.items()
            if k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
        }
        original = rope["original_max_position_embeddings"]
        module = YaRN(*args, original, base, dtype, scaling_factor=rope["factor"], **extra)
        return module._compute_cos_sin_cache()
    assert kind == "longrope"
    return Phi3LongRoPE(
        *args,
        max_position,
        rope["original_max_position_embeddings"],
        base,
        rope["short_factor"],
        rope["long_factor"],
        dtype,
    ).long_short_cos_sin_cache


CASES: dict[str, tuple[int, int, dict[str, Any]]] = {
    "default": (128, 4096, {"rope_theta": 10000.0}),
    "default-partial": (80, 2048, {"rope_theta": 10000.0, "partial_rotary_factor": 0.4}),
    "linear": (128, 2048, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "linear-lora": (64, 1024, {"rope_type": "linear", "rope_theta": 10000.0, "factor": [1.0, 2.5]}),
    "dynamic": (128, 2048, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "llama3": (
        128,
        8192,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
    "yarn": (
        128,
        32768,
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
        },
    ),
    "yarn-deepseek": (
        64,
        163840,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.5,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    "yarn-untruncated": (
        64,
        8192,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.5,
            "original_max_position_embeddings": 1000,
            "truncate": False,
        },
    ),
    "longrope": (
        96,
        8192,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.03 * i for i in range(48)],
            "long_factor": [1.0 + 1.3 * i for i in range(48)],
        },
    ),
}


def row_positions(name: str, rows: int) -> Any:
    """The position of each cache row (longrope: the short table, then the long one)."""
    if name == "longrope":
        original = CASES[name][2]["original_max_position_embeddings"]
        return np.concatenate([np.arange(original), np.arange(rows - original)])
    if name == "linear-lora":
        return np.concatenate([np.arange(1024), np.arange(rows - 1024) / 2.5])
    if name == "linear":
        return np.arange(rows) / 2.0
    return np.arange(rows, dtype=np.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_cache_is_vllms(name: str, client: posenc.Client) -> None:
    head_size, max_position, rope = CASES[name]
    ours = pv.cos_sin_cache(client, head_size, max_position, rope)
    vllm = vllm_cache(head_size, max_position, rope, torch.float32)
    exact = vllm_cache(head_size, max_position, rope, torch.float64).numpy()
    assert ours.shape == vllm.shape and ours.dtype == vllm.dtype == torch.float32
    scale = float(np.abs(exact).max())
    # The same formulas without float32: posenc is within float32 rounding of them.
    np.testing.assert_allclose(ours.numpy(), exact, rtol=0, atol=4 * EPS32 * scale)
    # vLLM's own float32 cache: off by float32's angle error, |p| * 2^-24 a few times over.
    positions = row_positions(name, len(exact))[:, None]
    allowed = scale * (8 * EPS32 + 4 * EPS32 * positions)
    assert (np.abs(ours.numpy() - vllm.numpy().astype(np.float64)) <= allowed).all()


def test_dtype_device_and_install(client: posenc.Client) -> None:
    head_size, max_position, rope = CASES["llama3"]
    cache = pv.cos_sin_cache(client, head_size, max_position, rope, dtype=torch.bfloat16)
    assert cache.dtype == torch.bfloat16
    exact = vllm_cache(head_size, max_position, rope, torch.float64)
    # Computed in bfloat16 by the server: within one bfloat16 ulp (of values below 1) of the
    # float64 run, as the accuracy contract says; vLLM rounds float32 values a second time.
    assert float((cache.double() - exact).abs().max()) <= 2.0**-8
    module = torch.nn.Module()
    module.register_buffer("cos_sin_cache", torch.zeros(max_position, 128, dtype=torch.bfloat16))
    pv.install(module, cache)
    assert torch.equal(module.cos_sin_cache, cache)
    with pytest.raises(posenc.InvalidArgumentError):
        pv.install(module, cache[:10])


def test_unserved_rope_types_are_refused() -> None:
    with pytest.raises(posenc.InvalidArgumentError, match="mrope"):
        pv.specs(128, 4096, {"rope_type": "default", "mrope_section": [16, 24, 24]})
    with pytest.raises(posenc.InvalidArgumentError, match="deepseek_yarn"):
        pv.specs(128, 4096, {"rope_type": "deepseek_yarn", "factor": 40.0})
