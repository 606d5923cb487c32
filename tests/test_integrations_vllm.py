"""posenc.integrations.vllm against vLLM 0.33's own rotary classes.

The classes are vLLM's code: its published wheel, downloaded once into pytest's cache and
imported on CPU with small stand-ins for its platform glue (tests/vllm_wheel.py,
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

import os
import sys
import tomllib
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")

import vllm_stubs  # noqa: E402
import vllm_wheel  # noqa: E402

import posenc  # noqa: E402
from posenc.integrations import vllm as pv  # noqa: E402

ROPE = "vllm.model_executor.layers.rotary_embedding"
EPS32 = 2.0**-24


@pytest.fixture(scope="module")
def rope(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    """vLLM 0.33's ``rotary_embedding`` package (``get_rope`` and the classes), in
    ``sys.modules`` for this file's tests only."""
    if os.environ.get(vllm_wheel.SKIP_ENV) == "1":
        pytest.skip(f"{vllm_wheel.SKIP_ENV}=1: vLLM's own classes not tested")
    root = vllm_wheel.unpacked(Path(request.config.cache.mkdir(f"vllm-{vllm_wheel.VERSION}")))
    try:
        yield vllm_stubs.load(root)
    finally:
        vllm_stubs.unload()


@pytest.fixture
def client(server: Any) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as client:
        yield client


class _Float64Torch(types.ModuleType):
    """torch, with the float32 dtypes vLLM's rotary code names meaning float64."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextmanager
def float64_arithmetic() -> Iterator[None]:
    modules = [m for n, m in sys.modules.items() if n.startswith(ROPE) and m is not None]
    patched = [m for m in modules if getattr(m, "torch", None) is torch]
    proxy = _Float64Torch("torch")
    for module in patched:
        module.torch = proxy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.torch = torch  # type: ignore[attr-defined]


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
        with float64_arithmetic():
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
}


@pytest.mark.parametrize("name", list(CASES))
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


@pytest.mark.parametrize("name", ["llama3", "longrope", "mrope"])
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


def test_install_model(rope: types.ModuleType, client: posenc.Client) -> None:
    """install_model on a model as vLLM builds it: layers sharing get_rope's modules, two
    rope settings (sliding and global layers), and a rotary class posenc does not serve
    (left alone)."""
    local = {"rope_theta": 10000.0}
    scaled = {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}
    deepseek = {
        "rope_type": "deepseek_yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    layers = torch.nn.ModuleList()
    for parameters in (local, local, scaled, local, scaled):
        attention = torch.nn.Module()
        attention.rotary_emb = rope.get_rope(128, 2048, rope_parameters=parameters)
        layer = torch.nn.Module()
        layer.self_attn = attention
        layers.append(layer)
    model = torch.nn.Module()
    model.layers = layers
    model.other = rope.get_rope(64, 2048, rope_parameters=deepseek)
    assert type(model.other).__name__ == "DeepseekScalingRotaryEmbedding"
    other = model.other.cos_sin_cache.clone()
    installed = pv.install_model(client, model)
    assert torch.equal(model.other.cos_sin_cache, other)
    assert installed == ["layers.0.self_attn.rotary_emb", "layers.2.self_attn.rotary_emb"]
    for name, parameters in (("layers.0", local), ("layers.2", scaled)):
        rotary = model.get_submodule(f"{name}.self_attn.rotary_emb")
        expected = pv.cos_sin_cache(client, 128, 2048, parameters)
        assert torch.equal(rotary.cos_sin_cache, expected)
    with pytest.raises(posenc.InvalidArgumentError, match="holds no rotary module"):
        pv.install_model(client, torch.nn.Sequential(model.other))
    with pytest.raises(posenc.InvalidArgumentError, match="DeepseekScalingRotaryEmbedding"):
        pv.cos_sin_cache_of(client, model.other)


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
        "deepseek_yarn": {"rope_type": "deepseek_yarn", "factor": 40.0},
        "ntk": {"rope_type": "ntk", "factor": 2.0},
        "use_fope": {"rope_type": "default", "use_fope": True},
        "rope_type": {"type": "linear", "factor": 2.0},
    }
    for match, parameters in cases.items():
        with pytest.raises(posenc.InvalidArgumentError, match=match):
            pv.specs(128, 4096, {"rope_theta": 10000.0, **parameters})


@pytest.mark.parametrize("version", ["0.32.1", "0.34.0", "1.0.0", "unknown"])
def test_other_vllm_releases_are_refused(
    version: str, rope: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    head_size, max_position, parameters, _ = CASES["default"]
    module = build(rope, head_size, max_position, parameters)
    monkeypatch.setattr(sys.modules["vllm"], "__version__", version)
    with pytest.raises(pv.UnsupportedVLLMError, match=f"runs vLLM {version}"):
        pv.install(module, module.cos_sin_cache.clone())
    with pytest.raises(pv.UnsupportedVLLMError, match=r">=0\.33,<0\.34"):
        pv.cos_sin_cache(None, head_size, max_position, parameters)  # type: ignore[arg-type]


def test_supported_range_is_the_extras() -> None:
    """pyproject.toml's vllm extra declares the range the SDK checks, which includes the
    release these tests run."""
    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as file:
        extras = tomllib.load(file)["project"]["optional-dependencies"]
    (low_major, low_minor), (high_major, high_minor) = pv.SUPPORTED_VLLM
    assert f"vllm>={low_major}.{low_minor},<{high_major}.{high_minor}" in extras["vllm"]
    tested = tuple(int(part) for part in vllm_wheel.VERSION.split(".")[:2])
    assert pv.SUPPORTED_VLLM[0] <= tested < pv.SUPPORTED_VLLM[1]
