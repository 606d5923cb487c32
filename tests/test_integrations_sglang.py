"""posenc.integrations.sglang against SGLang's own rotary classes, at two releases.

The classes are SGLang's code: its published wheels (the oldest supported release, pinned,
and the newest, resolved when the tests run), downloaded once into pytest's cache and
imported on CPU with small stand-ins for its platform glue (tests/sglang_wheel.py,
tests/sglang_stubs.py). Without the network these tests fail with pip's reason;
``POSENC_SKIP_SGLANG=1`` skips them.

Each case builds its module with SGLang's ``get_rope`` twice: in float32, as SGLang does,
and with the same code's arithmetic in float64 (``torch.float`` and ``torch.float32`` read
as float64 inside SGLang's rotary modules, ``dtype=torch.float64``): the reference.
posenc's float32 cache has the module's shape, installs into the float32 module (checked
against SGLang's own values first) and is within float32 rounding of the reference.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")

import engine_wheel  # noqa: E402
import sglang_stubs  # noqa: E402
import sglang_wheel  # noqa: E402
from engine_wheel import exact_table  # noqa: E402

import posenc  # noqa: E402
from posenc.integrations import sglang as ps  # noqa: E402

ROPE = "sglang.srt.layers.rotary_embedding"
EPS32 = 2.0**-24


@pytest.fixture(scope="module", params=["oldest", "newest"])
def rope(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    """SGLang's ``rotary_embedding`` package of the oldest supported release (pinned) and
    of the newest (resolved now), in ``sys.modules`` for this file's tests only."""
    with engine_wheel.loaded(request, sglang_wheel, sglang_stubs) as package:
        yield package


def has(rope: types.ModuleType, submodule: str) -> bool:
    return (Path(rope.__path__[0]) / f"{submodule}.py").exists()


def build(rope: types.ModuleType, args: dict[str, Any], dtype: Any = None) -> Any:
    """SGLang's module from its ``get_rope``: in float32, or with ``float64`` its arithmetic."""
    factory = sys.modules[f"{ROPE}.factory"]
    factory._ROPE_DICT.clear()
    if dtype is torch.float64:
        with engine_wheel.float64_arithmetic(ROPE):
            return rope.get_rope(**args, dtype=dtype)
    return rope.get_rope(**args, dtype=dtype or torch.float32)


def cache_of(module: Any) -> Any:
    if hasattr(module, "long_short_cos_sin_cache"):
        return module.long_short_cos_sin_cache
    return module.cos_sin_cache


def args(
    head_size: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "head_size": head_size,
        "rotary_dim": extra.pop("rotary_dim", head_size),
        "max_position": max_position,
        "base": base,
        "rope_scaling": rope_scaling,
        **extra,
    }


LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 1024,
    "short_factor": [1.0 + 0.03 * i for i in range(48)],
    "long_factor": [1.0 + 1.3 * i for i in range(48)],
}

# name: get_rope's arguments, the class it builds.
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "default": (args(128, 4096, 10000.0), "RotaryEmbedding"),
    "partial": (args(80, 2048, 10000.0, partial_rotary_factor=0.4), "RotaryEmbedding"),
    "linear": (
        args(128, 2048, 10000.0, {"rope_type": "linear", "factor": 2.0}),
        "LinearScalingRotaryEmbedding",
    ),
    "linear-factor-list": (
        args(64, 1024, 10000.0, {"rope_type": "linear", "factor": [1.0, 2.5, 4.0]}),
        "LinearScalingRotaryEmbedding",
    ),
    # SGLang's dynamic NTK: max_position * factor rows, the base of the older formula.
    "dynamic": (
        args(128, 4096, 10000.0, {"rope_type": "dynamic", "factor": 2.0}),
        "DynamicNTKScalingRotaryEmbedding",
    ),
    "dynamic-alpha": (
        args(128, 4096, 10000.0, {"rope_type": "dynamic", "alpha": 1000.0}),
        "DynamicNTKAlphaRotaryEmbedding",
    ),
    "yarn": (
        args(
            128,
            32768,
            1000000.0,
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        ),
        "YaRNScalingRotaryEmbedding",
    ),
    "yarn-mscale-attn_factor": (
        args(
            64,
            131072,
            150000.0,
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "attn_factor": 0.9,
                "truncate": False,
            },
        ),
        "YaRNScalingRotaryEmbedding",
    ),
    # DeepSeek-V3's: 163840 rows.
    "deepseek_yarn": (
        args(
            64,
            163840,
            10000.0,
            engine_wheel.DEEPSEEK_V3_YARN,
        ),
        "DeepseekScalingRotaryEmbedding",
    ),
    "deepseek_yarn-mscale": (
        args(
            128,
            16384,
            500000.0,
            {
                "rope_type": "deepseek_yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 2048,
                "mscale": 0.707,
            },
        ),
        "DeepseekScalingRotaryEmbedding",
    ),
    "llama3": (
        args(
            128,
            8192,
            500000.0,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
        "Llama3RotaryEmbedding",
    ),
    "longrope": (args(96, 8192, 10000.0, LONGROPE), "Phi3LongRoPEScaledRotaryEmbedding"),
    "longrope-mscale": (
        args(96, 8192, 10000.0, {**LONGROPE, "short_mscale": 1.1, "long_mscale": 1.25}),
        "Phi3LongRoPEScaledRotaryEmbedding",
    ),
    # SGLang's M-RoPE: max_position rows (vLLM holds four times as many).
    "mrope": (
        args(128, 4096, 1000000.0, {"rope_type": "default", "mrope_section": [16, 24, 24]}),
        "MRotaryEmbedding",
    ),
    "mrope-yarn": (
        args(
            128,
            32768,
            1000000.0,
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8192,
                "mrope_section": [16, 24, 24],
            },
        ),
        "YaRNScalingMRotaryEmbedding",
    ),
    "proportional": (
        args(512, 8192, 1000000.0, {"rope_type": "proportional"}, partial_rotary_factor=0.25),
        "Gemma4RotaryEmbedding",
    ),
    # Bailing's video rope (0.5.23): rows from position -max_position.
    "bailing-video": (
        args(
            128,
            4096,
            600000.0,
            {"rope_type": "default", "mrope_section": [16, 24, 24], "video_rope": True},
        ),
        "BailingMRotaryEmbedding",
    ),
    "bailing-video-yarn": (
        args(
            128,
            4096,
            600000.0,
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "mrope_section": [16, 24, 24],
                "video_rope": True,
            },
        ),
        "BailingMRotaryEmbedding",
    ),
}


def _needs(rope: types.ModuleType, name: str) -> None:
    if name.startswith("bailing") and not has(rope, "bailing_mrope"):
        pytest.skip("this release has no BailingMRotaryEmbedding")


# Over 100,000 rows each: slow.
SLOW = ["deepseek_yarn", "yarn-mscale-attn_factor"]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_cache_installs_and_is_exact(
    name: str, rope: types.ModuleType, client: posenc.Client
) -> None:
    _needs(rope, name)
    arguments, cls = CASES[name]
    module = build(rope, arguments)
    assert type(module).__name__ == cls
    native = cache_of(module).clone()
    reference = cache_of(build(rope, arguments, torch.float64))
    assert reference.dtype == torch.float64 and reference.shape == native.shape

    ours = ps.cos_sin_cache(client, **arguments)
    assert ours.shape == native.shape and ours.dtype == torch.float32
    of_module = ps.cos_sin_cache_of(client, module)
    ps.install(module, ps.caches_of(client, module))
    assert torch.equal(cache_of(module), ours)

    scale = float(reference.abs().max())
    for cache in (ours, of_module):
        error = float((cache.double() - reference).abs().max())
        assert error <= EPS32 * scale, f"{error / (EPS32 * scale):.3f} x 2^-24 of the scale"
    start = int(getattr(module, "position_start", 0))
    rows = torch.arange(start, start + len(native), dtype=torch.float64).abs()[:, None]
    assert ((native.double() - reference).abs() <= scale * EPS32 * (4 + 8 * rows)).all()


def test_bailing_negative_positions(rope: types.ModuleType, client: posenc.Client) -> None:
    """Bailing's video rope holds positions -max_position .. : row r is position r - 4096,
    its sines odd in the position."""
    _needs(rope, "bailing")
    arguments, _ = CASES["bailing-video"]
    module = build(rope, arguments)
    ps.install_model(torch.nn.Sequential(module), client)
    cache = module.cos_sin_cache.double()
    f = 600000.0 ** (-np.arange(0, 128, 2) / 128)
    for position in (-4096, -5, 0, 7, 4095):
        angles = position * f
        expected = np.concatenate([np.cos(angles), np.sin(angles)])
        assert np.abs(cache[position + 4096].numpy() - expected).max() <= EPS32


def _reference_rows(module64: Any, rows: int) -> Any:
    """The float64 rows 0 .. rows - 1 of a float64 module's table, from its own frequencies
    and scale (the table SGLang's growth continues)."""
    with engine_wheel.float64_arithmetic(ROPE):
        if hasattr(module64, "mscale"):  # the YaRN classes take their factor
            inv_freq = module64._compute_inv_freq(module64.scaling_factor)
        else:
            inv_freq = module64._compute_inv_freq(module64.base)
    angles = torch.outer(torch.arange(rows, dtype=torch.float64), inv_freq.double())
    scale = float(getattr(module64, "mscale", 1.0))
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * scale


@pytest.mark.parametrize(
    "name",
    [
        "default",
        "llama3",
        pytest.param("yarn", marks=pytest.mark.slow),
        "mrope-yarn",
        "deepseek_yarn-mscale",
    ],
)
def test_grown_cache_stays_exact(name: str, rope: types.ModuleType, client: posenc.Client) -> None:
    """SGLang grows caches before CUDA-graph capture (reserve_rope_cache_for_long_sequences
    calls _ensure_cos_sin_cache_length): an installed module's new rows are posenc's, the
    same table continued, where SGLang's own are float32 rows (or, in 0.5.20's YaRN and
    DeepSeek classes, rows of another table: 2.1 off)."""
    arguments, _ = CASES[name]
    module = build(rope, arguments)
    exact = build(rope, arguments, torch.float64)
    native = build(rope, arguments)
    ps.install_model(torch.nn.Sequential(module), client)
    before = len(module.cos_sin_cache)
    memo = module.cos_sin_cache_as(torch.bfloat16) if hasattr(module, "cos_sin_cache_as") else None
    needed = before + 40000
    module._ensure_cos_sin_cache_length(needed)
    native._ensure_cos_sin_cache_length(needed)
    grown = module.cos_sin_cache
    assert len(grown) > needed and len(native.cos_sin_cache) == len(grown)
    reference = _reference_rows(exact, len(grown))
    scale = float(reference.abs().max())
    ours = float((grown.double() - reference).abs().max())
    theirs = float((native.cos_sin_cache[before:].double() - reference[before:]).abs().max())
    assert ours <= EPS32 * scale < theirs, (ours, theirs)
    # The same rows as a fresh build from the grown module, and no stale cast copy.
    assert torch.equal(ps.cos_sin_cache_of(client, module), grown)
    if memo is not None:
        assert torch.equal(module.cos_sin_cache_as(torch.bfloat16), grown.to(torch.bfloat16))


def test_copied_module_keeps_growing_exactly(rope: types.ModuleType, client: posenc.Client) -> None:
    """A deep copy of an installed module (a draft model built from the target's) grows its
    own cache with posenc's rows; the original is left as it was."""
    import copy

    module = build(rope, CASES["default"][0])
    ps.install_model(torch.nn.Sequential(module), client)
    twin = copy.deepcopy(module)
    twin._ensure_cos_sin_cache_length(len(module.cos_sin_cache) + 10)
    assert len(twin.cos_sin_cache) > len(module.cos_sin_cache) == 4096
    assert torch.equal(twin.cos_sin_cache, ps.cos_sin_cache_of(client, twin))
    error = float(
        (twin.cos_sin_cache.double() - exact_table(len(twin.cos_sin_cache), 128, 1e4)).abs().max()
    )
    assert error <= EPS32


def test_growth_with_a_closed_client_keeps_sglang_rows(
    rope: types.ModuleType, server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client closed before SGLang grows the cache: the new rows are SGLang's own, the
    installed ones stay posenc's, and a warning says so."""
    arguments, _ = CASES["default"]
    module = build(rope, arguments)
    with posenc.Client(server.target) as client:
        ps.install_model(torch.nn.Sequential(module), client)
    installed = module.cos_sin_cache.clone()
    with caplog.at_level(logging.WARNING, logger="posenc.integrations.sglang"):
        module._ensure_cos_sin_cache_length(len(installed) + 10)
    assert torch.equal(module.cos_sin_cache[: len(installed)], installed)
    assert len(module.cos_sin_cache) > len(installed)
    assert any("SGLang's own" in r.getMessage() for r in caplog.records)


def test_memo_is_reset(rope: types.ModuleType, client: posenc.Client) -> None:
    """cos_sin_cache_as(dtype) (0.5.23) memoises a cast keyed on the tensor, which install
    writes in place: the memo is dropped, so the cast is of posenc's rows."""
    module = build(rope, CASES["llama3"][0])
    if not hasattr(module, "cos_sin_cache_as"):
        pytest.skip("this release keeps no cast copy")
    stale = module.cos_sin_cache_as(torch.bfloat16)
    ps.install(module, ps.cos_sin_cache_of(client, module))
    assert torch.equal(module.cos_sin_cache_as(torch.bfloat16), module.cos_sin_cache.bfloat16())
    assert not torch.equal(stale, module.cos_sin_cache_as(torch.bfloat16))


class MysteryRotaryEmbedding(torch.nn.Module):
    """A rotary class posenc does not know: left alone by install_model, and named."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(16, 8), persistent=False)


def test_install_model(
    rope: types.ModuleType,
    client: posenc.Client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """install_model on a small model holding SGLang's own rotary instances: layers sharing
    a module, Phi-3's three buffers, YaRN with an extrapolation factor (its own float32
    frequencies, exact angles) and an unknown class (left alone, named); SGLang's imports of
    vLLM (its fallback kernels) change nothing."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.9.2"))
    local = args(128, 2048, 10000.0)
    phi3 = CASES["longrope"][0]
    extrapolated = args(
        64,
        2048,
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "extrapolation_factor": 0.5,
        },
    )
    shared = build(rope, local)
    layers = torch.nn.ModuleList()
    for _ in range(3):
        attention = torch.nn.Module()
        attention.rotary_emb = shared
        layer = torch.nn.Module()
        layer.self_attn = attention
        layers.append(layer)
    model = torch.nn.Module()
    model.layers = layers
    model.phi3 = build(rope, phi3)
    model.extrapolated = build(rope, extrapolated)
    model.mystery = MysteryRotaryEmbedding()
    with caplog.at_level(logging.WARNING, logger="posenc.integrations.sglang"):
        installed = ps.install_model(model, client)
    assert installed == ["layers.0.self_attn.rotary_emb", "phi3", "extrapolated"]
    (line,) = [r.getMessage() for r in caplog.records if "left with" in r.getMessage()]
    assert "mystery (MysteryRotaryEmbedding: " in line and "extrapolated (" not in line
    module = model.extrapolated
    frequencies = module._compute_inv_freq(module.scaling_factor).double()
    angles = torch.outer(torch.arange(len(module.cos_sin_cache), dtype=torch.float64), frequencies)
    exact = torch.cat((angles.cos(), angles.sin()), dim=-1) * module.mscale
    error = float((module.cos_sin_cache.double() - exact).abs().max())
    assert error <= EPS32 * float(exact.abs().max())
    with pytest.raises(posenc.InvalidArgumentError, match="cos_sin_cache_of"):
        ps.cos_sin_cache(client, **extrapolated)
    assert torch.equal(shared.cos_sin_cache, ps.cos_sin_cache(client, **local))
    expected = ps.cos_sin_cache(client, **phi3)
    alone = build(rope, phi3)
    ps.install(alone, ps.cos_sin_cache_of(client, alone))  # the three buffers from one
    for name in ("short_cos_sin_cache", "long_cos_sin_cache", "long_short_cos_sin_cache"):
        assert torch.equal(getattr(alone, name), getattr(model.phi3, name))
    assert torch.equal(model.phi3.long_short_cos_sin_cache, expected)
    assert torch.equal(model.phi3.short_cos_sin_cache, expected[:1024])
    assert torch.equal(model.phi3.long_cos_sin_cache, expected[1024:])
    with pytest.raises(posenc.InvalidArgumentError, match=r"no rotary module.*MysteryRotary"):
        ps.install_model(torch.nn.Sequential(model.mystery), client)


def test_install_model_refuses_before_writing(
    rope: types.ModuleType, client: posenc.Client
) -> None:
    model = torch.nn.Module()
    model.first = build(rope, CASES["default"][0])
    model.second = build(rope, CASES["yarn"][0])
    first = model.first.cos_sin_cache.clone()
    model.second.cos_sin_cache[100:] *= 1.001  # as if this release computed it otherwise
    with pytest.raises(posenc.InvalidArgumentError, match=r"second\.cos_sin_cache row 100 "):
        ps.install_model(model, client)
    assert torch.equal(model.first.cos_sin_cache, first)


@pytest.mark.parametrize("version", ["0.5.19", "0.5.24", "0.6.0", "unknown"])
def test_other_releases_are_served_after_checking(
    version: str, rope: types.ModuleType, client: posenc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    arguments, _ = CASES["default"]
    module = build(rope, arguments)
    monkeypatch.setattr(sys.modules["sglang"], "__version__", version)
    window = r"SGLang 0\.5\.20 to 0\.5\.23"
    with pytest.warns(ps.UntestedReleaseWarning, match=window):
        installed = ps.install_model(torch.nn.Sequential(module), client)
    assert installed == ["0"]
    with pytest.warns(ps.UntestedReleaseWarning) as caught:
        ps.cos_sin_cache_of(client, module, dtype=torch.float32)
    # The first warning names the caller's line.
    first = next(w for w in caught if issubclass(w.category, ps.UntestedReleaseWarning))
    assert first.filename == __file__
    module.cos_sin_cache[7, 3] += 0.01
    with (
        pytest.warns(ps.UntestedReleaseWarning),
        pytest.raises(
            posenc.InvalidArgumentError,
            match=rf"0\.cos_sin_cache row 7 \(position 7\), column 3 .*SGLang {version}, outside",
        ),
    ):
        ps.install_model(torch.nn.Sequential(module), client)
    # Outside the tested releases the check runs even when verify=False is asked.
    with (
        pytest.warns(ps.UntestedReleaseWarning),
        pytest.raises(posenc.InvalidArgumentError, match="row 7"),
    ):
        ps.install(module, ps.cos_sin_cache(client, **arguments), verify=False)


def test_fope_llama4_vision_and_dual_chunk(rope: types.ModuleType, client: posenc.Client) -> None:
    """The classes SGLang's models build themselves (FoPE on CPU, Llama 4's vision patches)
    and dual-chunk attention (its caches on the current CUDA device: here, the CPU)."""
    variant = sys.modules[f"{ROPE}.rope_variant"]
    fope = variant.FourierRotaryEmbedding(
        128, 128, 4096, 1000000.0, True, torch.float32, 2, device="cpu"
    )
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for coef in (fope.cos_coef, fope.sin_coef):
            coef.copy_(
                torch.eye(coef.shape[-1]) + 0.1 * torch.randn(coef.shape, generator=generator)
            )
    vision = variant.Llama4VisionRotaryEmbedding(88, 44, 576, 10000.0, False, torch.complex64)
    original = variant.torch
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(original, name)  # type: ignore[method-assign]
    proxy.device = lambda *args: torch.device("cpu")  # type: ignore[attr-defined]
    proxy.cuda = types.SimpleNamespace(current_device=lambda: 0)  # type: ignore[attr-defined]
    variant.torch = proxy
    try:
        dual = variant.DualChunkRotaryEmbedding(
            128, 128, 32768, 10000000.0, True, torch.float32, chunk_size=8192, local_size=1024
        )
    finally:
        variant.torch = original
    # A dtype by name, as for the classes of plans.
    assert ps.cos_sin_cache_of(client, fope, dtype="float64").dtype == torch.float64
    model = torch.nn.ModuleDict({"fope": fope, "vision": vision, "dual": dual})
    assert ps.install_model(model, client) == ["fope", "vision", "dual"]
    assert fope.update_buffer is True
    f = 10000.0 ** (-np.arange(0, 44, 2) / 44)
    k = np.arange(576)
    angles = np.concatenate([np.outer(k % 24 + 1, f), np.outer(k // 24 + 1, f)], axis=1)
    reference = np.exp(1j * np.concatenate([angles, np.zeros((1, 44))]))[:, None, :]
    assert np.abs(vision.cos_sin_cache.numpy().astype(np.complex128) - reference).max() <= 2 * EPS32
    p = np.arange(7168)
    inv = 10000000.0 ** (-np.arange(0, 128, 2) / 128)
    qc = np.outer(np.minimum(p + 7168, 8192), inv)
    expected = np.concatenate([np.cos(qc), np.sin(qc)], axis=1)
    assert np.abs(dual.cos_sin_qc_cache.numpy() - expected).max() <= EPS32


@pytest.mark.parametrize("name", ["llama3", "deepseek_yarn-mscale", "proportional"])
def test_installed_module_rotates_as_float64(
    name: str, rope: types.ModuleType, client: posenc.Client
) -> None:
    """The module's own native forward with posenc's cache: float32 rounding of the float64
    run's rotation, where SGLang's float32 cache is off by its angle error at far positions."""
    arguments, _ = CASES[name]
    module = build(rope, arguments)
    exact = build(rope, arguments, torch.float64)
    rows = len(module.cos_sin_cache)
    positions = torch.tensor([0, 1, 77, 1023, 1024, rows // 2, rows - 1])
    head_size = arguments["head_size"]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(len(positions), 4 * head_size, generator=generator)
    key = torch.randn(len(positions), 2 * head_size, generator=generator)

    def rotate(rotary: Any, dtype: Any) -> Any:
        q, k = rotary.forward_native(positions, query.to(dtype), key.to(dtype))
        return torch.cat([q.reshape(len(positions), -1), k.reshape(len(positions), -1)], -1)

    expected = rotate(exact, torch.float64)
    native = float((rotate(module, torch.float32).double() - expected).abs().max())
    ps.install(module, ps.cos_sin_cache_of(client, module))
    ours = float((rotate(module, torch.float32).double() - expected).abs().max())
    assert ours <= 1e-5 < native, (ours, native)


def test_model_subclasses(rope: types.ModuleType, client: posenc.Client) -> None:
    engine_wheel.assert_fixed_subclass_served_alone(
        rope.RotaryEmbedding, lambda model: ps.install_model(model, client), EPS32
    )


def test_tested_window_is_the_extras_and_the_releases_run() -> None:
    """pyproject.toml's sglang extra is a lower bound, the oldest tested release, which this
    file's pinned wheel is."""
    import tomllib

    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as file:
        extras = tomllib.load(file)["project"]["optional-dependencies"]
    oldest = ".".join(map(str, ps.TESTED_SGLANG[0]))
    assert f"sglang>={oldest}" in extras["sglang"]
    assert sglang_wheel.OLDEST.version == oldest


def test_refusals_name_the_class(rope: types.ModuleType, client: posenc.Client) -> None:
    """vLLM's integration on SGLang's classes (the same names, other attributes and row
    counts), and a class lacking an attribute posenc reads: one line each, no traceback
    from inside posenc; install_model leaves such a module, named."""
    from posenc.integrations import vllm as pv

    module = build(rope, CASES["mrope"][0])
    with pytest.raises(posenc.InvalidArgumentError, match="SGLang's class: install it with"):
        pv.cos_sin_cache_of(client, module)
    yarn = build(rope, CASES["yarn"][0])
    del yarn.beta_fast
    with pytest.raises(posenc.InvalidArgumentError, match="no attribute 'beta_fast'"):
        ps.cos_sin_cache_of(client, yarn)
    model = torch.nn.ModuleDict({"plain": build(rope, CASES["default"][0]), "yarn": yarn})
    assert ps.install_model(model, client) == ["plain"]


def test_ernie45_vl(rope: types.ModuleType, client: posenc.Client) -> None:
    """Ernie 4.5-VL builds its MRotaryEmbedding subclass itself: the plain cache of
    max_position rows."""
    ernie = sys.modules[f"{ROPE}.mrope"].Ernie4_5_VLRotaryEmbedding
    module = ernie(128, 128, 4096, 500000.0, False, torch.float32, mrope_section=[22, 22, 20])
    assert ps.install_model(torch.nn.Sequential(module), client) == ["0"]
    assert (
        float((module.cos_sin_cache.double() - exact_table(4096, 128, 500000.0)).abs().max())
        <= EPS32
    )
