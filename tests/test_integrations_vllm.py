"""posenc.integrations.vllm against vLLM's own rotary classes, at two releases.

The classes are vLLM's code: its published wheels (the oldest supported release, pinned, and
the newest, resolved when the tests run), downloaded once into pytest's cache and imported
on CPU with small stand-ins for its platform glue (tests/vllm_wheel.py,
tests/vllm_stubs.py). Without the network these tests fail with pip's reason;
``POSENC_SKIP_VLLM=1`` skips them.

Each case builds its module with vLLM's ``get_rope`` twice: in float32, as vLLM does, and
with the same code's arithmetic in float64 (``torch.float`` and ``torch.float32`` read as
float64 inside vLLM's rotary modules, ``dtype=torch.float64``): the reference. The dtype
alone would not do: the classes compute in ``torch.float`` whatever it is, then cast. posenc's
float32 cache has the module's shape, installs into the float32 module (``install`` checks
it against vLLM's own values first) and is within float32 rounding of the reference.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")

import engine_wheel  # noqa: E402
import vllm_stubs  # noqa: E402
import vllm_wheel  # noqa: E402

import posenc  # noqa: E402
from posenc.integrations import vllm as pv  # noqa: E402

ROPE = "vllm.model_executor.layers.rotary_embedding"
EPS32 = 2.0**-24


@pytest.fixture(scope="module", params=["oldest", "newest"])
def rope(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    """vLLM's ``rotary_embedding`` package (``get_rope`` and the classes) of the oldest
    supported release (pinned) and of the newest (resolved now), in ``sys.modules`` for
    this file's tests only."""
    with engine_wheel.loaded(request, vllm_wheel, vllm_stubs) as package:
        yield package


def build(
    rope: types.ModuleType,
    head_size: int,
    max_position: int,
    parameters: dict[str, Any],
    dtype: Any = None,
) -> Any:
    """vLLM's module from its ``get_rope``: in float32, or with ``float64`` its arithmetic."""
    rope._ROPE_DICT.clear()
    if dtype is torch.float64:
        with engine_wheel.float64_arithmetic(ROPE):
            return rope.get_rope(head_size, max_position, rope_parameters=parameters, dtype=dtype)
    dtype = dtype or torch.float32
    return rope.get_rope(head_size, max_position, rope_parameters=parameters, dtype=dtype)


def cache_of(module: Any) -> Any:
    if hasattr(module, "long_short_cos_sin_cache"):
        return module.long_short_cos_sin_cache
    return module.cos_sin_cache


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 1024,
    "short_factor": [1.0 + 0.03 * i for i in range(48)],
    "long_factor": [1.0 + 1.3 * i for i in range(48)],
}

# name: head_size, max_position, rope_parameters, the class get_rope builds.
CASES: dict[str, tuple[int, int, dict[str, Any], str]] = {
    "default": (128, 4096, {"rope_theta": 10000.0}, "RotaryEmbedding"),
    "partial": (
        80,
        2048,
        {"rope_theta": 10000.0, "partial_rotary_factor": 0.4},
        "RotaryEmbedding",
    ),
    "rope_dim": (128, 4096, {"rope_theta": 10000.0, "rope_dim": 64}, "RotaryEmbedding"),
    "linear": (
        128,
        2048,
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        "LinearScalingRotaryEmbedding",
    ),
    "linear-factor-list": (
        64,
        1024,
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": [1.0, 2.5, 4.0]},
        "LinearScalingRotaryEmbedding",
    ),
    "dynamic": (
        128,
        4096,
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        "DynamicNTKScalingRotaryEmbedding",
    ),
    "dynamic-max_trained_positions": (
        128,
        8192,
        {
            "rope_type": "dynamic",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "max_trained_positions": 2048,
        },
        "DynamicNTKScalingRotaryEmbedding",
    ),
    "dynamic-alpha": (
        128,
        4096,
        {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0},
        "DynamicNTKAlphaRotaryEmbedding",
    ),
    "yarn": (
        128,
        32768,
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
        },
        "YaRNScalingRotaryEmbedding",
    ),
    "yarn-mscale": (
        64,
        163840,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        "YaRNScalingRotaryEmbedding",
    ),
    "yarn-attention_factor": (
        64,
        131072,
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "attention_factor": 1.2,
            "truncate": False,
        },
        "YaRNScalingRotaryEmbedding",
    ),
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
        "Llama3RotaryEmbedding",
    ),
    "longrope": (96, 8192, LONGROPE, "Phi3LongRoPEScaledRotaryEmbedding"),
    "longrope-mscale": (
        96,
        8192,
        {**LONGROPE, "short_mscale": 1.1, "long_mscale": 1.25},
        "Phi3LongRoPEScaledRotaryEmbedding",
    ),
    "mrope": (
        128,
        4096,
        {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "MRotaryEmbedding",
    ),
    "mrope-interleaved": (
        128,
        2048,
        {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "MRotaryEmbedding",
    ),
    "mrope-yarn": (
        128,
        32768,
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 1024,
            "mrope_section": [16, 24, 24],
        },
        "MRotaryEmbedding",
    ),
    # DeepSeek-V3's: 163840 rows, mscale = mscale_all_dim (the scale is 1).
    "deepseek_yarn": (
        64,
        163840,
        {**engine_wheel.DEEPSEEK_V3_YARN, "rope_theta": 10000.0},
        "DeepseekScalingRotaryEmbedding",
    ),
    # mscale alone: the scale is 0.1 * mscale * ln(factor) + 1 (no ratio).
    "deepseek_llama_scaling": (
        128,
        16384,
        {
            "rope_type": "deepseek_llama_scaling",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
        },
        "DeepseekScalingRotaryEmbedding",
    ),
    "deepseek-v4": (
        64,
        65536,
        {
            "rope_type": "deepseek_yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "is_deepseek_v4": True,
        },
        "DeepseekV4ScalingRotaryEmbedding",
    ),
    # Gemma 4's global layers: head 512, a quarter rotated, the rest zero frequencies.
    "proportional": (
        512,
        8192,
        {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        "Gemma4RotaryEmbedding",
    ),
    "proportional-full": (
        256,
        4096,
        {"rope_type": "proportional", "rope_theta": 10000.0},
        "Gemma4RotaryEmbedding",
    ),
    "ntk": (
        128,
        8192,
        {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 4.0},
        "NTKScalingRotaryEmbedding",
    ),
    "bailing_mrope": (
        128,
        4096,
        {"rope_type": "bailing_mrope", "rope_theta": 600000.0, "mrope_section": [16, 24, 24]},
        "BailingMRotaryEmbedding",
    ),
    "openpangu": (
        128,
        4096,
        {
            "rope_type": "openpangu",
            "rope_theta": 1000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "MRotaryEmbeddingInterleaved",
    ),
}


# Over 100,000 rows each: slow.
SLOW = ["deepseek_yarn", "yarn-mscale", "yarn-attention_factor"]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_cache_installs_and_is_exact(
    name: str, rope: types.ModuleType, client: posenc.Client
) -> None:
    head_size, max_position, parameters, cls = CASES[name]
    module = build(rope, head_size, max_position, parameters)
    assert type(module).__name__ == cls
    vllm = cache_of(module).clone()
    reference = cache_of(build(rope, head_size, max_position, parameters, torch.float64))
    assert reference.dtype == torch.float64 and reference.shape == vllm.shape

    ours = pv.cos_sin_cache(client, head_size, max_position, parameters)
    assert ours.shape == vllm.shape and ours.dtype == torch.float32
    # The same from the built module's attributes, as install_model does in a worker.
    of_module = pv.cos_sin_cache_of(client, module)
    pv.install(module, ours)
    assert torch.equal(cache_of(module), ours)

    # Within float32 rounding of the float64 run: half an ulp of the largest value.
    scale = float(reference.abs().max())
    for cache in (ours, of_module):
        error = float((cache.double() - reference).abs().max())
        assert error <= EPS32 * scale, f"{error / (EPS32 * scale):.3f} x 2^-24 of the scale"
    # The reference is vLLM's arithmetic: its float32 run is off by float32's angle error,
    # which grows with the row's position (at most its row index).
    rows = torch.arange(len(vllm), dtype=torch.float64)[:, None]
    assert ((vllm.double() - reference).abs() <= scale * EPS32 * (4 + 8 * rows)).all()


def test_bfloat16_module(rope: types.ModuleType, client: posenc.Client) -> None:
    """A bfloat16 model's module (vLLM's dtype is the model's) takes a bfloat16 cache."""
    head_size, max_position, parameters, _ = CASES["llama3"]
    module = build(rope, head_size, max_position, parameters, torch.bfloat16)
    reference = cache_of(build(rope, head_size, max_position, parameters, torch.float64))
    ours = pv.cos_sin_cache(client, head_size, max_position, parameters, dtype=torch.bfloat16)
    assert ours.dtype == module.cos_sin_cache.dtype == torch.bfloat16
    pv.install(module, ours)
    assert torch.equal(module.cos_sin_cache, ours)
    # Correctly rounded: half a bfloat16 ulp of values below 1.
    assert float((ours.double() - reference).abs().max()) <= 2.0**-9


def test_second_bfloat16_buffer_is_refreshed(rope: types.ModuleType, client: posenc.Client) -> None:
    """ROCm's AITER path keeps cos_sin_cache_bf16 beside the cache: install rewrites both."""
    head_size, max_position, parameters, _ = CASES["default"]
    vllm_stubs.aiter.enabled = True
    try:
        module = build(rope, head_size, max_position, parameters)
    finally:
        vllm_stubs.aiter.enabled = False
    assert module.cos_sin_cache_bf16 is not None
    module.cos_sin_cache_bf16.zero_()
    ours = pv.cos_sin_cache(client, head_size, max_position, parameters)
    pv.install(module, ours)
    assert torch.equal(module.cos_sin_cache, ours)
    assert torch.equal(module.cos_sin_cache_bf16, ours.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["llama3", "longrope", "mrope", "proportional", "ntk"])
def test_installed_module_rotates_as_float64(
    name: str, rope: types.ModuleType, client: posenc.Client
) -> None:
    """The module's own forward with posenc's cache: float32 rounding of the float64 run's
    rotation, where vLLM's float32 cache is off by its angle error at far positions."""
    head_size, max_position, parameters, _ = CASES[name]
    module = build(rope, head_size, max_position, parameters)
    exact = build(rope, head_size, max_position, parameters, torch.float64)
    positions = torch.tensor([0, 1, 77, 1023, 1024, max_position - 1])
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(len(positions), 4 * head_size, generator=generator)
    key = torch.randn(len(positions), 2 * head_size, generator=generator)

    def rotate(rotary: Any, dtype: Any) -> Any:
        q, k = rotary(positions, query.to(dtype), key.to(dtype))
        return torch.cat([q, k], dim=-1).double()

    expected = rotate(exact, torch.float64)
    native = float((rotate(module, torch.float32) - expected).abs().max())
    pv.install(module, pv.cos_sin_cache(client, head_size, max_position, parameters))
    ours = float((rotate(module, torch.float32) - expected).abs().max())
    assert ours <= 1e-5 < native, (ours, native)


class MysteryRotaryEmbedding(torch.nn.Module):
    """A rotary class posenc does not know: left alone by install_model, and named."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(16, 8), persistent=False)


def test_install_model(
    rope: types.ModuleType, client: posenc.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """install_model on a model as vLLM builds it: layers sharing get_rope's modules, two
    rope settings (sliding and global layers), DeepSeek's class, mixed NTK (its own float32
    frequencies, exact angles), and a class posenc does not serve: left alone and named
    with the reason."""
    local = {"rope_theta": 10000.0}
    scaled = {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}
    deepseek = {
        "rope_type": "deepseek_yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    mixed = {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 4.0, "mixed_b": 0.5}
    layers = torch.nn.ModuleList()
    for parameters in (local, local, scaled, local, scaled):
        attention = torch.nn.Module()
        attention.rotary_emb = rope.get_rope(128, 2048, rope_parameters=parameters)
        layer = torch.nn.Module()
        layer.self_attn = attention
        layers.append(layer)
    model = torch.nn.Module()
    model.layers = layers
    model.deepseek = rope.get_rope(64, 2048, rope_parameters=deepseek)
    model.mixed = rope.get_rope(64, 2048, rope_parameters=mixed)
    model.mystery = MysteryRotaryEmbedding()
    # A fused kernel's module holding the rotary module's buffer (Hunyuan's HpcRopeNorm):
    # it reads the installed rows, and is neither installed nor named as left.
    model.fused = MysteryRotaryEmbedding()
    model.fused.cos_sin_cache = model.deepseek.cos_sin_cache
    with caplog.at_level("WARNING", logger="posenc.integrations.vllm"):
        installed = pv.install_model(client, model)
    assert installed == [
        "layers.0.self_attn.rotary_emb",
        "layers.2.self_attn.rotary_emb",
        "deepseek",
        "mixed",
    ]
    (line,) = [r.getMessage() for r in caplog.records if "left with" in r.getMessage()]
    assert "mystery (MysteryRotaryEmbedding: " in line and "mixed (" not in line
    assert "fused (" not in line
    assert torch.equal(model.fused.cos_sin_cache, model.deepseek.cos_sin_cache)
    assert torch.equal(model.mystery.cos_sin_cache, torch.ones(16, 8))
    for name, parameters in (("layers.0", local), ("layers.2", scaled)):
        rotary = model.get_submodule(f"{name}.self_attn.rotary_emb")
        expected = pv.cos_sin_cache(client, 128, 2048, parameters)
        assert torch.equal(rotary.cos_sin_cache, expected)
    assert torch.equal(model.deepseek.cos_sin_cache, pv.cos_sin_cache(client, 64, 2048, deepseek))
    # Mixed NTK: the angles of the module's own float32 frequencies, to float32 rounding.
    frequencies = model.mixed._compute_inv_freq(10000.0).double()
    angles = torch.outer(torch.arange(2048, dtype=torch.float64), frequencies)
    exact = torch.cat((angles.cos(), angles.sin()), dim=-1)
    assert float((model.mixed.cos_sin_cache.double() - exact).abs().max()) <= EPS32
    with pytest.raises(posenc.InvalidArgumentError, match=r"holds no rotary module.*Mystery"):
        pv.install_model(client, torch.nn.Sequential(model.mystery))
    with pytest.raises(posenc.InvalidArgumentError, match="MysteryRotaryEmbedding"):
        pv.cos_sin_cache_of(client, model.mystery)


def test_install_model_refuses_before_writing(
    rope: types.ModuleType, client: posenc.Client
) -> None:
    """A cache that differs from its module's own is refused before any module is written:
    the model is left as it was, the error names the module and the row."""
    model = torch.nn.Module()
    model.first = build(rope, *CASES["default"][:3])
    model.second = build(rope, *CASES["llama3"][:3])
    first = model.first.cos_sin_cache.clone()
    model.second.cos_sin_cache[100:] *= 1.001  # as if this release computed it otherwise
    with pytest.raises(posenc.InvalidArgumentError, match=r"second\.cos_sin_cache row 100 "):
        pv.install_model(client, model)
    assert torch.equal(model.first.cos_sin_cache, first)


def test_llama4_vision(rope: types.ModuleType, client: posenc.Client) -> None:
    """mllama4: the complex cache of 24 x 24 patches and the class token, each patch's
    angles (x + 1) f and (y + 1) f, against float64 angles."""
    parameters = {"rope_type": "mllama4", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    rope._ROPE_DICT.clear()
    module = rope.get_rope(
        88, 576, is_neox_style=False, rope_parameters=parameters, dtype=torch.complex64
    )
    assert type(module).__name__ == "Llama4VisionRotaryEmbedding"
    ours = pv.cos_sin_cache(client, 88, 576, parameters, dtype=torch.complex64)
    assert ours.shape == module.cos_sin_cache.shape and ours.dtype == torch.complex64
    assert torch.equal(pv.cos_sin_cache_of(client, module), ours)
    pv.install(module, ours)
    assert torch.equal(module.cos_sin_cache, ours)
    f = 10000.0 ** (-np.arange(0, 44, 2) / 44)
    k = np.arange(576)
    angles = np.concatenate([np.outer(k % 24 + 1, f), np.outer(k // 24 + 1, f)], axis=1)
    angles = np.concatenate([angles, np.zeros((1, 44))])
    reference = torch.from_numpy(np.exp(1j * angles))[:, None, :]
    assert float((ours.to(torch.complex128) - reference).abs().max()) <= 2 * EPS32


@contextmanager
def cpu_for_cuda(module: types.ModuleType) -> Iterator[None]:
    """The dual-chunk class puts its caches on the current CUDA device: here, the CPU."""
    original = module.torch  # type: ignore[attr-defined]
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(original, name)  # type: ignore[method-assign]
    proxy.device = lambda *args: torch.device("cpu")  # type: ignore[attr-defined]
    proxy.accelerator = types.SimpleNamespace(current_device_index=lambda: 0)  # type: ignore[attr-defined]
    proxy.cuda = types.SimpleNamespace(current_device=lambda: 0)  # type: ignore[attr-defined]
    module.torch = proxy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.torch = original  # type: ignore[attr-defined]


def test_dual_chunk(rope: types.ModuleType, client: posenc.Client) -> None:
    """Dual-chunk attention (Qwen 2.5-1M): its five caches, each within float32 rounding
    of the class's float64 run, installed together."""
    chunk = {"chunk_size": 8192, "local_size": 1024}
    parameters = {"rope_theta": 10000000.0}
    dual = sys.modules[f"{ROPE}.dual_chunk_rope"]

    def make(dtype: Any) -> Any:
        rope._ROPE_DICT.clear()
        return rope.get_rope(
            128, 32768, rope_parameters=parameters, dtype=dtype, dual_chunk_attention_config=chunk
        )

    with cpu_for_cuda(dual):
        module = make(torch.float32)
    with engine_wheel.float64_arithmetic(ROPE), cpu_for_cuda(dual):
        exact = make(torch.float64)
    caches = pv.caches_of(client, module)
    assert sorted(caches) == sorted(n for n, _ in module.named_buffers())
    with pytest.raises(posenc.InvalidArgumentError, match="caches_of"):
        pv.cos_sin_cache_of(client, module)
    pv.install(module, caches)
    for name, cache in caches.items():
        assert torch.equal(getattr(module, name), cache)
        reference = getattr(exact, name)
        assert float((cache.double() - reference).abs().max()) <= EPS32, name


def test_fope(rope: types.ModuleType, client: posenc.Client) -> None:
    """FoPE (InternS1-Pro): exact angles mixed by the loaded coefficients in float64, one
    rounding; its first forward keeps posenc's rows instead of recomputing them."""
    parameters = {
        "rope_theta": 1000000.0,
        "use_fope": True,
        "num_key_value_heads": 2,
        "num_inv_freq": None,
        "fope_sep_head": True,
        "fope_init_factor": 0.1,
    }
    module = build(rope, 128, 8192, parameters)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for coef in (module.cos_coef, module.sin_coef):
            noise = 0.1 * torch.randn(coef.shape, generator=generator)
            coef.copy_(torch.eye(coef.shape[-1]) + noise)
    # The class's formula in float64 (its float32 coefficients, exact in float64).
    n = module.inv_freq.shape[-1]
    frequencies = 1000000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float64)[:n] / 128)
    angles = torch.outer(torch.arange(8192, dtype=torch.float64), frequencies)
    cos = torch.einsum("tD,hDd->thd", angles.cos(), module.cos_coef.double())
    sin = torch.einsum("tD,hDd->thd", angles.sin(), module.sin_coef.double())
    cos = torch.nn.functional.pad(cos, (0, 64 - n), value=1.0)
    sin = torch.nn.functional.pad(sin, (0, 64 - n), value=1.0)
    reference = torch.cat((cos, cos, sin, sin), dim=-1)
    with pytest.raises(posenc.InvalidArgumentError, match="learned coefficients"):
        pv.cos_sin_cache(client, 128, 8192, parameters)
    ours = pv.cos_sin_cache_of(client, module)
    pv.install(module, ours)
    assert module.update_cache is False and torch.equal(module.cos_sin_cache, ours)
    scale = float(reference.abs().max())
    assert float((ours.double() - reference).abs().max()) <= EPS32 * scale


def test_ernie45_vl(rope: types.ModuleType, client: posenc.Client) -> None:
    """Ernie 4.5-VL builds its MRotaryEmbedding subclass itself: its plain cache, 4x rows."""
    ernie = importlib.import_module(f"{ROPE}.ernie45_vl_rope").Ernie4_5_VLRotaryEmbedding
    module = ernie(128, 128, 4096, 500000.0, False, torch.float32, mrope_section=[22, 22, 20])
    ours = pv.cos_sin_cache_of(client, module)
    assert ours.shape == (4096 * 4, 128)
    pv.install(module, ours)
    expected = pv.cos_sin_cache(
        client, 128, 4096, {"rope_theta": 500000.0, "mrope_section": [22, 22, 20]}
    )
    assert torch.equal(module.cos_sin_cache, expected)


def test_wrong_table_is_refused(rope: types.ModuleType, client: posenc.Client) -> None:
    head_size, max_position, parameters, _ = CASES["dynamic-max_trained_positions"]
    module = build(rope, head_size, max_position, parameters)
    before = module.cos_sin_cache.clone()
    # Without max_trained_positions the base is not rescaled: the same shape, other values.
    untrained = {k: v for k, v in parameters.items() if k != "max_trained_positions"}
    wrong = pv.cos_sin_cache(client, head_size, max_position, untrained)
    with pytest.raises(posenc.InvalidArgumentError, match="not the table this module"):
        pv.install(module, wrong)
    # Another rope_theta.
    wrong = pv.cos_sin_cache(client, head_size, max_position, {**parameters, "rope_theta": 5e5})
    with pytest.raises(posenc.InvalidArgumentError, match="not the table this module"):
        pv.install(module, wrong)
    assert torch.equal(module.cos_sin_cache, before)
    # Older vLLM's convention, max_position * factor rows: refused by its shape.
    older = torch.zeros(max_position * 2, head_size)
    with pytest.raises(posenc.InvalidArgumentError, match="has shape"):
        pv.install(module, older)
    pv.install(module, wrong, verify=False)
    assert torch.equal(module.cos_sin_cache, wrong)


def test_missing_rope_theta_is_refused(rope: types.ModuleType) -> None:
    """vLLM's get_rope takes 10000 for a missing rope_theta; posenc asks for it."""
    for parameters in (None, {}, {"rope_type": "llama3", "factor": 8.0}):
        with pytest.raises(posenc.InvalidArgumentError, match="rope_theta"):
            pv.specs(128, 4096, parameters)
    assert pv.specs(128, 4096, {"rope_theta": 10000.0})


def test_unserved_rope_types_are_refused() -> None:
    cases = {
        "cos_sin_cache_of": {"rope_type": "ntk", "factor": 2.0, "mixed_b": 0.5},
        "use_fope": {"rope_type": "default", "use_fope": True},
        "rope_type": {"type": "linear", "factor": 2.0},
        "'su' is not served": {"rope_type": "su"},
        "use cos_sin_cache": {"rope_type": "proportional"},
    }
    for match, parameters in cases.items():
        with pytest.raises(posenc.InvalidArgumentError, match=match):
            pv.specs(128, 4096, {"rope_theta": 10000.0, **parameters})


@pytest.mark.parametrize("version", ["0.32.1", "0.35.0", "1.0.0", "unknown"])
def test_other_releases_are_served_after_checking(
    version: str, rope: types.ModuleType, client: posenc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release outside the tested window is served with a warning naming the window, each
    cache compared with the module's own; one that differs is refused in one line naming
    the module, the row and the release."""
    head_size, max_position, parameters, _ = CASES["default"]
    module = build(rope, head_size, max_position, parameters)
    monkeypatch.setattr(sys.modules["vllm"], "__version__", version)
    window = r"vLLM 0\.33 to 0\.34"
    with pytest.warns(pv.UntestedReleaseWarning, match=window):
        cache = pv.cos_sin_cache(client, head_size, max_position, parameters)
    with pytest.warns(pv.UntestedReleaseWarning, match=window):
        installed = pv.install_model(client, torch.nn.Sequential(module))
    assert installed == ["0"] and torch.equal(module.cos_sin_cache, cache)
    with pytest.warns(pv.UntestedReleaseWarning) as caught:
        pv.cos_sin_cache_of(client, module, dtype=torch.float32)
    # The first warning names the caller's line.
    first = next(w for w in caught if issubclass(w.category, pv.UntestedReleaseWarning))
    assert first.filename == __file__
    module.cos_sin_cache[7, 3] += 0.01  # as if this release built another table
    with (
        pytest.warns(pv.UntestedReleaseWarning),
        pytest.raises(
            posenc.InvalidArgumentError,
            match=rf"0\.cos_sin_cache row 7 \(position 7\), column 3 .*vLLM {version}, outside",
        ),
    ):
        pv.install_model(client, torch.nn.Sequential(module))
    # Outside the tested releases the check runs even when verify=False is asked.
    with (
        pytest.warns(pv.UntestedReleaseWarning),
        pytest.raises(posenc.InvalidArgumentError, match="row 7"),
    ):
        pv.install(module, cache, verify=False)


def test_tested_window_is_the_extras_and_the_releases_run() -> None:
    """pyproject.toml's vllm extra is a lower bound, the oldest tested release, which this
    file's pinned wheel is."""
    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as file:
        extras = tomllib.load(file)["project"]["optional-dependencies"]
    (low_major, low_minor), _ = pv.TESTED_VLLM
    assert f"vllm>={low_major}.{low_minor}" in extras["vllm"]
    tested = tuple(int(part) for part in vllm_wheel.VERSION.split(".")[:2])
    assert tested == pv.TESTED_VLLM[0]


def test_model_subclasses(rope: types.ModuleType, client: posenc.Client) -> None:
    engine_wheel.assert_fixed_subclass_served_alone(
        rope.RotaryEmbedding, lambda model: pv.install_model(client, model), EPS32
    )
