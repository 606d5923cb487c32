"""Conformance: every table kind against the models' own code (transformers 5.24, CPU torch 2.13).

Where the reference's float32 arithmetic is accurate (positions up to 2^16), posenc's rows
match it within a tolerance that grows with the position as float32's does: a few units of
``|p| * 2**-24`` (the reference rounds ``p * inv_freq`` and its ``inv_freq`` to float32).
At large positions the reference is noise (see the README's drift table, which
``scripts/conformance_drift.py`` prints and a test here keeps in sync), so there posenc is
held to the accuracy contract against the mpmath reference, for the same configs.

No weights are downloaded: modules are built from configs. tensor2tensor (TensorFlow) and
Transformer-XL (removed from transformers 5) are checked against transcriptions of their
code, cited below.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import ROOT
from model_configs import DEEPSEEK_V3_YARN
from reference import within_contract
from reference_tables import Rope, Sin, rope_exact, sinusoidal_exact

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
transformers = pytest.importorskip("transformers")

import posenc  # noqa: E402

# Building transformers' modules takes seconds: these run in make test, not make test-fast.
pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("drift", ROOT / "scripts" / "conformance_drift.py")
assert _spec is not None and _spec.loader is not None
drift = importlib.util.module_from_spec(_spec)
sys.modules["drift"] = drift
_spec.loader.exec_module(drift)

EPS32 = 2.0**-24
SMALL = np.arange(0, 4096)
SCATTERED = np.array([4096, 5000, 8191, 8192, 8193, 10_000, 32767, 32768, 40_000, 65535, 65536])
LARGE = [2**30 + 3, 2**40 + 7, 2**42, -(2**41) - 1]


def tolerance(positions: Any, scale: float = 1.0) -> Any:
    """float32's error budget for rows at ``positions``: 4 units of |p| * 2^-24, plus ulps."""
    return scale * (8 * EPS32 + 4 * EPS32 * np.abs(np.asarray(positions, dtype=np.float64)))


def assert_conforms(ours: Any, theirs: Any, positions: Any, scale: float = 1.0) -> None:
    error = np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))
    allowed = tolerance(positions, scale)[:, None]
    worst = np.unravel_index(np.argmax(error - allowed), error.shape)
    assert (error <= allowed).all(), (
        f"row {worst[0]} (position {positions[worst[0]]}), column {worst[1]}: "
        f"error {error[worst]:.3g} over {allowed[worst[0], 0]:.3g}"
    )


def ours(spec: posenc.Spec, positions: Any) -> Any:
    """posenc's float64 rows of ``spec``."""
    return drift.exact_rows(spec, np.asarray(positions))


def replaced(spec: posenc.Spec, **changes: Any) -> posenc.Spec:
    """``spec`` with some parameters changed."""
    return posenc.Spec(spec.kind, **{**spec.parameters, **changes})


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers warns about configs it accepts (e.g. YaRN's implicit factor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# -- rotary: transformers' modules, built from configs --------------------------------------


def _rotary_cases() -> list[tuple[str, Any, posenc.Spec]]:
    from transformers import LlamaConfig, Phi3Config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cases: list[tuple[str, Any, posenc.Spec]] = []
    for name in drift.ROTARY_MODELS:
        module, spec = drift.rotary_model(name)
        cases.append((name, module, spec))
    configs = {
        "linear": LlamaConfig(
            hidden_size=2048,
            num_attention_heads=32,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        "yarn-deepseek": LlamaConfig(
            hidden_size=2048,
            num_attention_heads=32,
            head_dim=64,
            max_position_embeddings=163840,
            rope_parameters={
                **DEEPSEEK_V3_YARN,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
        "yarn-untruncated": LlamaConfig(
            hidden_size=2048,
            num_attention_heads=32,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
                "attention_factor": 1.25,
            },
        ),
    }
    for name, config in configs.items():
        cases.append(
            (name, LlamaRotaryEmbedding(config), posenc.Spec.from_config(config.to_dict()))
        )
    partial = Phi3Config(
        hidden_size=2560,
        num_attention_heads=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        partial_rotary_factor=0.5,
    )
    cases.append(
        ("phi3-partial", Phi3RotaryEmbedding(partial), posenc.Spec.from_config(partial.to_dict()))
    )
    return cases


@pytest.fixture(scope="module")
def rotary_cases() -> list[tuple[str, Any, posenc.Spec]]:
    with quiet():
        return _rotary_cases()


def test_rotary_tables_match_transformers_modules(
    rotary_cases: list[tuple[str, Any, posenc.Spec]],
) -> None:
    for name, module, spec in rotary_cases:
        for positions in (SMALL, SCATTERED):
            theirs = drift.rotary_module(module, positions)
            mine = ours(spec, positions)
            assert mine.shape == theirs.shape, name
            scale = max(1.0, float(module.attention_scaling))
            assert_conforms(mine, theirs, positions, scale)
            # vLLM's cos_sin_cache row: the first half of each of transformers' cos and sin.
            half = mine.shape[1] // 4
            vllm = replaced(spec, layout="vllm")
            expected = np.concatenate([theirs[:, :half], theirs[:, 2 * half : 3 * half]], axis=1)
            assert_conforms(ours(vllm, positions), expected, positions, scale)


def test_specs_from_configs_carry_the_config_parameters(
    rotary_cases: list[tuple[str, Any, posenc.Spec]],
) -> None:
    specs = {name: spec.parameters for name, _, spec in rotary_cases}
    assert specs["llama3"]["scaling"] == "llama3" and specs["llama3"]["factor"] == 8.0
    assert specs["yarn-deepseek"]["mscale"] == 0.707
    assert specs["yarn-untruncated"]["truncate"] is False
    assert specs["phi3-partial"]["partial_rotary_factor"] == 0.5


def test_dynamic_ntk_follows_the_module_state() -> None:
    # transformers recomputes the frequencies when a forward reaches past the cached length
    # (seq_len = max(position_ids) + 1) and keeps them: seq_len is the table's parameter.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    with quiet():
        module = LlamaRotaryEmbedding(config)
    spec = posenc.Spec.from_config(config.to_dict())
    assert_conforms(ours(spec, SMALL), drift.rotary_module(module, SMALL), SMALL)
    for positions in (np.arange(0, 9000), np.arange(20_000, 20_100)):
        theirs = drift.rotary_module(module, positions)
        grown = replaced(spec, seq_len=int(positions.max()) + 1)
        assert_conforms(ours(grown, positions), theirs, positions)


def test_longrope_switches_factors_like_phi3() -> None:
    module, at = drift.phi3_longrope_module()
    short = np.arange(0, 4096)
    assert_conforms(ours(at(4096), short), drift.rotary_module(module, short), short, 1.2)
    long = np.arange(0, 5000)
    assert_conforms(ours(at(5000), long), drift.rotary_module(module, long), long, 1.2)


def test_gptj_layout_matches_gptj() -> None:
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

    table = create_sinusoidal_positions(4096, 64)
    sin, cos = torch.split(table, 32, dim=-1)
    theirs = torch.cat([torch.repeat_interleave(t, 2, dim=-1) for t in (cos, sin)], dim=-1)
    gptj = posenc.Spec("rotary", head_dim=64, layout="gptj")
    assert_conforms(ours(gptj, SMALL), theirs.numpy(), SMALL)


# -- sinusoidal: transformers' functions and modules ----------------------------------------


def test_whisper_matches_sinusoids() -> None:
    from transformers.models.whisper.modeling_whisper import sinusoids

    for channels, length in ((384, 1500), (1280, 1500), (64, 2**16)):
        positions = np.arange(length)
        theirs = sinusoids(length, channels).numpy()
        spec = posenc.Spec("whisper", d_model=channels)
        assert_conforms(ours(spec, positions), theirs, positions)


def sinusoidal_embedding(module: str, model: str) -> Any:
    """transformers' ``{model}SinusoidalPositionalEmbedding`` class, from ``models.{module}``."""
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(modeling, f"{model}SinusoidalPositionalEmbedding")


@pytest.mark.parametrize(
    ("module", "model"), [("m2m_100", "M2M100"), ("speech_to_text", "Speech2Text")]
)
def test_fairseq_matches_the_transformers_ports(module: str, model: str) -> None:
    Embedding = sinusoidal_embedding(module, model)
    for dim, padding in ((1024, 1), (7, 0), (256, 3)):
        theirs = Embedding.get_embedding(4098, dim, padding).numpy()
        positions = np.arange(4098)
        spec = posenc.Spec("fairseq", d_model=dim, padding_idx=padding)
        assert_conforms(ours(spec, positions), theirs, positions)
    # The module's forward: padded batches, the padding_idx offset, a decode step.
    embedding = Embedding(1024, 64, padding_idx=1)
    forward_parameters = inspect.signature(embedding.forward).parameters
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 1, 1], [1, 1, 5, 6, 7, 8, 9]])
    position_ids = embedding.create_position_ids_from_input_ids(input_ids, 1, 0)
    spec = posenc.Spec("fairseq", d_model=64, padding_idx=1)
    for past in (0, 100):
        positions = embedding.create_position_ids_from_input_ids(input_ids, 1, past)
        # transformers 5.24 and later name the offset cache_length, older releases
        # past_key_values_length.
        offset = (
            "cache_length" if "cache_length" in forward_parameters else "past_key_values_length"
        )
        theirs = embedding(input_ids, **{offset: past}).numpy().reshape(-1, 64)
        flat = positions.numpy().reshape(-1)
        assert_conforms(ours(spec, flat), theirs, flat)
    assert position_ids[0, 0] == 2  # token 0 is row padding_idx + 1


@pytest.mark.parametrize(("module", "model"), [("marian", "Marian"), ("pegasus", "Pegasus")])
def test_split_layout_matches_marian_and_pegasus(module: str, model: str) -> None:
    Embedding = sinusoidal_embedding(module, model)
    for dim in (512, 9):
        theirs = Embedding(1024, dim).create_weight().numpy()
        positions = np.arange(1024)
        split = posenc.Spec("sinusoidal", d_model=dim, layout="split")
        mine = ours(split, positions).astype(np.float32)
        # Computed in float64 and stored as float32: the same float32 numbers, to one ulp.
        np.testing.assert_array_max_ulp(mine, theirs, maxulp=1)


def test_interleaved_layout_matches_xlm() -> None:
    from transformers.models.xlm.modeling_xlm import create_sinusoidal_embeddings

    for dim in (512, 7):
        theirs = create_sinusoidal_embeddings(1024, dim, torch.empty(1024, dim)).numpy()
        mine = ours(posenc.Spec("sinusoidal", d_model=dim), np.arange(1024)).astype(np.float32)
        np.testing.assert_array_max_ulp(mine, theirs, maxulp=1)


def _t2t_timing_signal(
    positions: Any, channels: int, min_timescale: float, max_timescale: float, start: int
) -> Any:
    """tensor2tensor's common_attention.get_timing_signal_1d, op for op in float32.

    position = to_float(range(length) + start_index); num_timescales = channels // 2;
    log_timescale_increment = log(max / min) / maximum(to_float(num_timescales) - 1, 1);
    inv_timescales = min * exp(to_float(range(num_timescales)) * -increment);
    signal = concat([sin(scaled), cos(scaled)], 1), padded by channels % 2 zero columns.
    """
    position = (np.asarray(positions) + start).astype(np.float32)
    num_timescales = channels // 2
    increment = math.log(float(max_timescale) / float(min_timescale)) / max(
        np.float32(num_timescales) - 1, 1
    )
    inv = np.float32(min_timescale) * np.exp(
        np.arange(num_timescales, dtype=np.float32) * np.float32(-increment)
    )
    scaled = position[:, None] * inv[None, :]
    signal = np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)
    return np.pad(signal, [[0, 0], [0, channels % 2]])


def test_tensor2tensor_matches_get_timing_signal_1d() -> None:
    positions = np.arange(4096)
    for channels, low, high, start in ((512, 1.0, 1e4, 0), (33, 2.0, 1e5, 7), (64, 0.5, 1e4, -3)):
        theirs = _t2t_timing_signal(positions, channels, low, high, start)
        spec = posenc.Spec(
            "tensor2tensor",
            d_model=channels,
            min_timescale=low,
            max_timescale=high,
            start_index=start,
        )
        assert_conforms(ours(spec, positions), theirs, positions + start)


def _transfo_xl_pos_emb(klen: int, demb: int, clamp_len: int) -> Any:
    """Transformer-XL (kimiyoung/transformer-xl, transformers <= 4.35 TransfoXLModel).

    inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb));
    pos_seq = torch.arange(klen - 1, -1, -1.0); if clamp_len > 0: pos_seq.clamp_(max=clamp_len);
    pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1) with
    sinusoid_inp = torch.outer(pos_seq, inv_freq).
    """
    inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
    pos_seq = torch.arange(klen - 1, -1, -1.0)
    if clamp_len > 0:
        pos_seq.clamp_(max=clamp_len)
    sinusoid_inp = torch.outer(pos_seq, inv_freq)
    return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1).numpy()


def test_transformer_xl_matches_its_positional_embedding() -> None:
    for klen, demb, clamp in ((4096, 410, 1000), (640, 1024, 0)):
        theirs = _transfo_xl_pos_emb(klen, demb, clamp)
        spec = posenc.Spec("transformer_xl", d_model=demb, key_length=klen, clamp_len=clamp)
        rows = np.arange(klen)
        relative = np.minimum(klen - 1 - rows, clamp if clamp > 0 else klen)
        assert_conforms(ours(spec, rows), theirs, relative)


# -- replays used for the drift table are the real functions, bit for bit -------------------


def test_drift_replays_are_bit_identical_to_the_real_functions() -> None:
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    from transformers.models.whisper.modeling_whisper import sinusoids

    rows = np.arange(2**16)
    np.testing.assert_array_equal(drift.whisper_replay(rows, 384), sinusoids(2**16, 384).numpy())
    np.testing.assert_array_equal(
        drift.fairseq_replay(rows, 1024, 1),
        M2M100SinusoidalPositionalEmbedding.get_embedding(2**16, 1024, 1).numpy(),
    )
    table = create_sinusoidal_positions(2**16, 64)
    sin, cos = torch.split(table, 32, dim=-1)
    gptj = torch.cat([torch.repeat_interleave(t, 2, dim=-1) for t in (cos, sin)], dim=-1)
    np.testing.assert_array_equal(drift.gptj_replay(rows, 64), gptj.numpy())
    few = np.arange(2048)
    np.testing.assert_array_equal(
        drift.marian_replay(few, 512),
        MarianSinusoidalPositionalEmbedding(2048, 512).create_weight().numpy(),
    )


def test_readme_records_the_measured_drift() -> None:
    readme = (ROOT / "README.md").read_text()
    measured = drift.table()
    header = measured.splitlines()[0]
    assert header in readme, "README lacks the drift table of scripts/conformance_drift.py"
    start = readme.index(header)
    recorded = readme[start:].split("\n\n", 1)[0].strip().splitlines()
    rows = measured.strip().splitlines()
    stale = "README's drift table is stale: run python scripts/conformance_drift.py\n" + measured
    assert len(recorded) == len(rows), stale
    assert recorded[:2] == rows[:2], stale  # the header and its rule
    for line, measured_line in zip(recorded[2:], rows[2:], strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        expected = [cell.strip() for cell in measured_line.strip("|").split("|")]
        assert cells[:2] == expected[:2], stale
        # The float32 tables' errors move by a few percent between CPUs (numpy and torch
        # take other vector paths for sin and cos): the figures must agree, not their digits.
        for cell, value in zip(cells[2:], expected[2:], strict=True):
            assert float(cell) == pytest.approx(float(value), rel=0.1), stale


# -- at large positions: the accuracy contract, for the same configs ------------------------


def test_model_configs_meet_the_contract_at_large_positions(
    rotary_cases: list[tuple[str, Any, posenc.Spec]],
) -> None:
    failures, checked = [], 0
    cache: dict[Rope, Any] = {}
    for name, _, spec in rotary_cases:
        rope = Rope.of(spec)
        table = ours(spec, LARGE)
        width = table.shape[1]
        for row, position in enumerate(LARGE):
            for column in sorted({0, 1, width // 4, width // 2 - 1, width // 2, width - 1}):
                checked += 1
                # The float64 table, held to the float64 contract.
                value = table[row, column]
                if not within_contract(value, rope_exact(rope, position, column, cache)):
                    failures.append((name, position, column))
    for sin in (Sin("whisper", 384), Sin("fairseq", 1024), Sin("sinusoidal", 512, layout="split")):
        table = ours(sin.spec(), LARGE)
        d = sin.d_model
        for row, position in enumerate(LARGE):
            for column in (0, 1, d // 2 - 1, d // 2, d - 1):
                checked += 1
                if not within_contract(table[row, column], sinusoidal_exact(sin, position, column)):
                    failures.append((sin, position, column))
    assert checked > 200
    assert not failures, failures[:5]


def test_readme_drift_table_shows_the_reference_is_noise_at_2_24() -> None:
    rows = [line for line in drift.table().splitlines()[2:] if "create_weight" not in line]
    for line in rows:
        last = float(re.split(r"\s*\|\s*", line.strip("| "))[-1])
        assert last > 0.5, line
