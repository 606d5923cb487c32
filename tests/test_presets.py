"""Presets (issue 5): the accuracy contract against mpmath, the protocol, the SDK and the cache key.

Conformance with the models' own code (transformers, in float32) is in test_conformance.py;
here every preset is held to PRODUCT section 3 against the independent mpmath reference of
test_presets_reference.py, at every scale up to the position limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
from reference import within_contract
from test_presets_reference import Rope, Sin, columns_of, rope_exact, sinusoidal_exact

import posenc
from posenc import _protocol as proto
from posenc.presets import RotaryPreset, SinusoidalPreset
from posenc.v1 import posenc_pb2 as pb
from posenc_server import engine, servicer
from posenc_server.app import RunningServer
from posenc_server.config import ServerConfig
from posenc_server.engine import EncodingSpec
from posenc_server.errors import FieldViolation

POSITIONS = [0, 1, 2, 1000, 2**31 - 1, 2**40 + 7, 2**42, -(2**42), -5]
CONFIG = ServerConfig()


def sinusoidal_spec(preset: Sin, dtype: str = "float32") -> EncodingSpec:
    parameters: dict[str, Any] = {}
    if preset.name == "tensor2tensor":
        parameters = {"min_timescale": preset.min_timescale, "start_index": preset.start_index}
    elif preset.name == "fairseq":
        parameters = {"padding_idx": preset.padding_idx}
    elif preset.name == "transformer_xl":
        parameters = {"clamp_len": preset.clamp_len, "key_length": preset.key_length}
    message = SinusoidalPreset(preset.name, **parameters).to_proto()
    proto_spec = pb.EncodingSpec(d_model=preset.d_model, base=preset.base, sinusoidal=message)
    return parsed(proto_spec, dtype)


def rotary_spec(rope: Rope, dtype: str = "float32") -> EncodingSpec:
    message = RotaryPreset(**rope.kwargs()).to_proto()
    return parsed(pb.EncodingSpec(rotary=message), dtype)


def parsed(proto_spec: pb.EncodingSpec, dtype: str) -> EncodingSpec:
    violations: list[FieldViolation] = []
    spec = servicer.preset_spec_from_proto(proto_spec, dtype, CONFIG, violations)
    assert spec is not None, violations
    return spec


SINUSOIDAL_CASES = [
    Sin("vaswani", 64),
    Sin("vaswani", 7, base=500000.0),
    Sin("vaswani_split", 512),
    Sin("vaswani_split", 9),
    Sin("tensor2tensor", 64),
    Sin("tensor2tensor", 5, base=1e4),
    Sin("tensor2tensor", 128, base=1e4, min_timescale=2.0),
    Sin("tensor2tensor", 33, base=1e5, min_timescale=0.5, start_index=2**42),
    Sin("tensor2tensor", 16, start_index=-17),
    Sin("whisper", 384),
    Sin("whisper", 4, base=1e3),
    Sin("fairseq", 1024),
    Sin("fairseq", 7, padding_idx=0),
    Sin("fairseq", 256, padding_idx=2**40 + 7),
    Sin("transformer_xl", 64),
    Sin("transformer_xl", 64, clamp_len=1000),
    Sin("transformer_xl", 410, key_length=2**42, clamp_len=2**41),
    Sin("transformer_xl", 16, key_length=150),
]

ROTARY_CASES = [
    Rope(128, "default", 500000.0),
    Rope(64, "default", 10000.0, layout="vllm", partial_rotary_factor=0.5),
    Rope(80, "default", 10000.0, layout="gptj", partial_rotary_factor=0.4),
    Rope(128, "linear", 10000.0, factor=4.0, layout="gptj"),
    Rope(128, "dynamic", 10000.0, factor=2.0, max_position_embeddings=4096),
    Rope(
        128,
        "dynamic",
        10000.0,
        factor=2.0,
        max_position_embeddings=4096,
        seq_len=20000,
        layout="vllm",
    ),
    Rope(128, "yarn", 1000000.0, factor=4.0, original_max_position_embeddings=32768),
    Rope(
        64,
        "yarn",
        10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=0.707,
        layout="vllm",
    ),
    Rope(
        64,
        "yarn",
        10000.0,
        factor=8.0,
        original_max_position_embeddings=2048,
        truncate=False,
        attention_factor=1.25,
        layout="gptj",
    ),
    Rope(
        96,
        "longrope",
        10000.0,
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
        short_factor=tuple(1.0 + i / 48 for i in range(48)),
        long_factor=tuple(1.0 + i for i in range(48)),
    ),
    Rope(
        96,
        "longrope",
        10000.0,
        original_max_position_embeddings=4096,
        factor=32.0,
        short_factor=tuple(1.0 + i / 48 for i in range(48)),
        long_factor=tuple(1.0 + i for i in range(48)),
        seq_len=5000,
        layout="vllm",
    ),
    Rope(
        128,
        "llama3",
        500000.0,
        factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    ),
    Rope(
        64,
        "llama3",
        500000.0,
        factor=32.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        layout="gptj",
    ),
]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_sinusoidal_presets_meet_the_contract(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    failures, checked = [], 0
    for preset in SINUSOIDAL_CASES:
        spec = sinusoidal_spec(preset, dtype)
        positions = [*POSITIONS, preset.padding_idx, preset.padding_idx + 1]
        positions += [int(p) for p in rng.integers(-(2**42), 2**42, size=4)]
        table = engine.encode_positions(spec, positions)
        columns = columns_of(preset.d_model, rng.integers(0, preset.d_model, size=4).tolist())
        for row, position in enumerate(positions):
            for column in columns:
                checked += 1
                if not within_contract(
                    table[row, column], sinusoidal_exact(preset, position, column)
                ):
                    failures.append((preset, position, column, table[row, column]))
    assert checked > 1000
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_rotary_presets_meet_the_contract(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype) + 1)
    failures, checked = [], 0
    cache: dict[Rope, Any] = {}
    for rope in ROTARY_CASES:
        spec = rotary_spec(rope, dtype)
        assert spec.d_model == rope.width
        positions = POSITIONS + [int(p) for p in rng.integers(-(2**42), 2**42, size=3)]
        table = engine.encode_positions(spec, positions)
        columns = columns_of(rope.width, [rope.dim // 2 - 1, rope.dim // 2, rope.dim - 1, rope.dim])
        columns += rng.integers(0, rope.width, size=3).tolist()
        for row, position in enumerate(positions):
            for column in columns:
                checked += 1
                if not within_contract(
                    table[row, column], rope_exact(rope, position, column, cache)
                ):
                    failures.append((rope.rope_type, rope.layout, position, column))
    assert checked > 1000
    assert not failures, failures[:5]


@pytest.mark.parametrize("case", [*SINUSOIDAL_CASES[::3], *ROTARY_CASES[::2]], ids=repr)
def test_ranges_and_lists_give_the_same_rows(case: Sin | Rope) -> None:
    spec = sinusoidal_spec(case) if isinstance(case, Sin) else rotary_spec(case)
    for start in (-70, 2**42 - 200, 0):
        by_range = engine.encode_range(spec, start, start + 200)
        by_list = engine.encode_positions(spec, np.arange(start, start + 200)[::-1])[::-1]
        np.testing.assert_array_equal(by_range, by_list)


def test_plain_presets_are_the_engine_tables_and_share_their_cache_keys() -> None:
    assert sinusoidal_spec(Sin("vaswani", 64)) == EncodingSpec(64)
    assert sinusoidal_spec(Sin("whisper", 384)) == EncodingSpec(
        384, layout=engine.Layout.SPLIT, schedule=engine.Schedule.TENSOR2TENSOR
    )
    assert sinusoidal_spec(Sin("vaswani_split", 10)).preset is None


def test_fairseq_rows_are_the_module_weights() -> None:
    # Row padding_idx is zero; token t of an unpadded sentence is row padding_idx + 1 + t.
    spec = sinusoidal_spec(Sin("fairseq", 8, padding_idx=1), "float64")
    table = engine.encode_range(spec, 0, 5)
    assert not table[1].any()
    np.testing.assert_allclose(table[2, :4], np.sin(2 * 10000.0 ** (-np.arange(4) / 3)))
    assert table[0, 4] == 1.0  # cos(0) in the first cos column


def test_transformer_xl_rows_descend_from_key_length() -> None:
    spec = sinusoidal_spec(Sin("transformer_xl", 16, key_length=6, clamp_len=3), "float64")
    plain = sinusoidal_spec(Sin("transformer_xl", 16), "float64")
    rows = engine.encode_range(spec, 0, 6)
    expected = engine.encode_positions(plain, [3, 3, 3, 2, 1, 0])
    np.testing.assert_array_equal(rows, expected)


# -- every parameter is in the cache key ----------------------------------------------------


def _variants(rope: Rope) -> list[Rope]:
    changes: dict[str, Any] = {
        "rope_theta": 20000.0,
        "layout": "gptj",
        "partial_rotary_factor": 0.5,
        "factor": 3.0,
        "original_max_position_embeddings": 4000,
        "max_position_embeddings": 8000,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 0.5,
        "mscale_all_dim": 0.25,
        "truncate": False,
        "attention_factor": 1.5,
        "seq_len": 9000,
    }
    return [dataclasses.replace(rope, **{name: value}) for name, value in changes.items()]


def test_every_rotary_parameter_changes_the_cache_key() -> None:
    # Each variant differs from its base in one parameter only. yarn takes every parameter
    # but seq_len, which longrope takes.
    yarn = Rope(64, "yarn", 10000.0, factor=4.0, original_max_position_embeddings=2048)
    longrope = Rope(
        64,
        "longrope",
        original_max_position_embeddings=2048,
        max_position_embeddings=8000,
        short_factor=(1.0,) * 32,
        long_factor=(2.0,) * 32,
    )
    variants = [(yarn, variant) for variant in _variants(yarn) if variant.seq_len is None] + [
        (longrope, dataclasses.replace(longrope, seq_len=9000))
    ]
    keys = set()
    for base, variant in variants:
        spec, base_spec = rotary_spec(variant), rotary_spec(base)
        assert spec != base_spec and hash(spec) != hash(base_spec), variant
        keys.add(spec)
    assert len(keys) == len(variants)
    assert rotary_spec(yarn, "float64") != rotary_spec(yarn)


def test_every_sinusoidal_parameter_changes_the_cache_key() -> None:
    specs = [
        sinusoidal_spec(Sin("fairseq", 64, padding_idx=1)),
        sinusoidal_spec(Sin("fairseq", 64, padding_idx=2)),
        sinusoidal_spec(Sin("fairseq", 64, base=5000.0)),
        sinusoidal_spec(Sin("tensor2tensor", 64, min_timescale=2.0)),
        sinusoidal_spec(Sin("tensor2tensor", 64, start_index=1)),
        sinusoidal_spec(Sin("tensor2tensor", 64, start_index=2)),
        sinusoidal_spec(Sin("transformer_xl", 64, clamp_len=5)),
        sinusoidal_spec(Sin("transformer_xl", 64, clamp_len=6)),
        sinusoidal_spec(Sin("transformer_xl", 64, key_length=6)),
        sinusoidal_spec(Sin("transformer_xl", 64, key_length=6, clamp_len=5)),
    ]
    assert len(set(specs)) == len(specs)


def test_the_server_keeps_tables_apart_that_differ_in_one_parameter(server: RunningServer) -> None:
    with posenc.Client(server.target) as client:
        one = client.get_range(0, 4, 8, preset=SinusoidalPreset("fairseq", padding_idx=1))
        two = client.get_range(0, 4, 8, preset=SinusoidalPreset("fairseq", padding_idx=2))
        again = client.get_range(0, 4, 8, preset=SinusoidalPreset("fairseq", padding_idx=1))
        assert not one[1].any() and one[2].any()
        assert not two[2].any() and two[1].any()
        np.testing.assert_array_equal(one, again)
        assert client.server_info().cache.hits >= 1


# -- protocol: GetServerInfo and field violations -------------------------------------------


def test_server_info_lists_every_preset_with_its_parameters(server: RunningServer) -> None:
    with posenc.Client(server.target) as client:
        info = client.server_info()
    by_name = {preset.name: preset for preset in info.presets}
    assert set(by_name) == {
        *posenc.presets.SINUSOIDAL_PRESETS,
        *(f"rotary:{kind}" for kind in posenc.presets.ROPE_TYPES),
    }
    fields = {p.field for p in by_name["rotary:yarn"].parameters}
    assert {"spec.rotary.factor", "spec.rotary.beta_fast", "spec.rotary.mscale"} <= fields
    assert {p.field: p.default for p in by_name["fairseq"].parameters}[
        "spec.sinusoidal.padding_idx"
    ] == "1"
    assert info.to_dict()["presets"][0]["name"] == "vaswani"


LLAMA3: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}

BAD_PRESETS: list[tuple[int | None, Any, str]] = [
    (8, SinusoidalPreset("whisper", padding_idx=3), "spec.sinusoidal.padding_idx"),
    (7, "whisper", "spec.d_model"),
    (2, "fairseq", "spec.d_model"),
    (9, "transformer_xl", "spec.d_model"),
    (8, SinusoidalPreset("fairseq", padding_idx=-1), "spec.sinusoidal.padding_idx"),
    (8, SinusoidalPreset("tensor2tensor", min_timescale=0.0), "spec.sinusoidal.min_timescale"),
    (8, SinusoidalPreset("tensor2tensor", min_timescale=1e9), "spec.sinusoidal.min_timescale"),
    (8, SinusoidalPreset("tensor2tensor", start_index=2**50), "spec.sinusoidal.start_index"),
    (8, SinusoidalPreset("transformer_xl", key_length=-1), "spec.sinusoidal.key_length"),
    (None, RotaryPreset(head_dim=0), "spec.rotary.head_dim"),
    (None, RotaryPreset(head_dim=7), "spec.rotary.head_dim"),
    (None, RotaryPreset(head_dim=64, rope_theta=1.0), "spec.rotary.rope_theta"),
    (None, RotaryPreset(head_dim=64, rope_theta=float("nan")), "spec.rotary.rope_theta"),
    (
        None,
        RotaryPreset(head_dim=64, partial_rotary_factor=1.5),
        "spec.rotary.partial_rotary_factor",
    ),
    (None, RotaryPreset(head_dim=64, factor=2.0), "spec.rotary.factor"),
    (None, RotaryPreset(head_dim=64, rope_type="linear"), "spec.rotary.factor"),
    (None, RotaryPreset(head_dim=64, rope_type="linear", factor=-1.0), "spec.rotary.factor"),
    (
        None,
        RotaryPreset(head_dim=64, rope_type="dynamic", factor=2.0),
        "spec.rotary.max_position_embeddings",
    ),
    (
        None,
        RotaryPreset(head_dim=64, rope_type="yarn", factor=2.0),
        "spec.rotary.original_max_position_embeddings",
    ),
    (
        None,
        RotaryPreset(head_dim=64, rope_type="yarn", original_max_position_embeddings=4096),
        "spec.rotary.factor",
    ),
    (
        None,
        RotaryPreset(
            head_dim=64,
            rope_type="yarn",
            factor=2.0,
            original_max_position_embeddings=4096,
            beta_fast=-1.0,
        ),
        "spec.rotary.beta_fast",
    ),
    (
        None,
        RotaryPreset(head_dim=64, **{**LLAMA3, "high_freq_factor": 0.5}),
        "spec.rotary.high_freq_factor",
    ),
    (None, RotaryPreset(head_dim=64, **{**LLAMA3, "seq_len": 10}), "spec.rotary.seq_len"),
    (
        None,
        RotaryPreset(
            head_dim=64,
            rope_type="longrope",
            original_max_position_embeddings=4096,
            factor=4.0,
            short_factor=[1.0] * 31,
            long_factor=[1.0] * 32,
        ),
        "spec.rotary.short_factor",
    ),
    (
        None,
        RotaryPreset(
            head_dim=64,
            rope_type="longrope",
            original_max_position_embeddings=4096,
            factor=4.0,
            short_factor=[1.0] * 32,
        ),
        "spec.rotary.long_factor",
    ),
    (100, RotaryPreset(head_dim=64), "spec.d_model"),
    (None, RotaryPreset(head_dim=2**20), "spec.d_model"),
]


def test_only_the_parameters_a_request_sets_are_checked() -> None:
    # At the largest position limit no offset fits, yet presets without offsets still work.
    widest = ServerConfig(max_abs_position=1 << 52)
    for name in ("vaswani", "fairseq", "tensor2tensor"):
        violations: list[FieldViolation] = []
        proto_spec = pb.EncodingSpec(d_model=64, sinusoidal=SinusoidalPreset(name).to_proto())
        assert servicer.preset_spec_from_proto(proto_spec, "float32", widest, violations)
        assert not violations
    violations = []
    proto_spec = pb.EncodingSpec(
        d_model=64, base=0.5, sinusoidal=SinusoidalPreset("vaswani").to_proto()
    )
    assert servicer.preset_spec_from_proto(proto_spec, "float32", CONFIG, violations) is None
    assert [v.field for v in violations] == ["spec.base"]  # not min_timescale, never set


@pytest.mark.parametrize(("d_model", "preset", "field"), BAD_PRESETS, ids=lambda v: str(v)[:60])
def test_bad_preset_parameters_get_invalid_argument_naming_the_field(
    server: RunningServer, d_model: int | None, preset: Any, field: str
) -> None:
    with (
        posenc.Client(server.target, max_retries=0) as client,
        pytest.raises(posenc.InvalidArgumentError) as raised,
    ):
        client.get_range(0, 4, d_model, preset=preset)
    assert field in [f for f, _ in raised.value.field_violations], raised.value


def test_raw_requests_with_preset_conflicts_are_refused(
    stub: Any,
) -> None:
    import grpc

    cases = [
        (
            pb.EncodingSpec(
                d_model=8,
                layout=pb.LAYOUT_SPLIT,
                sinusoidal=pb.SinusoidalPreset(name=pb.SINUSOIDAL_PRESET_NAME_WHISPER),
            ),
            "spec.layout",
        ),
        (pb.EncodingSpec(d_model=8, sinusoidal=pb.SinusoidalPreset()), "spec.sinusoidal.name"),
        (pb.EncodingSpec(base=5.0, rotary=pb.RotaryPreset(head_dim=8)), "spec.base"),
        (
            pb.EncodingSpec(rotary=pb.RotaryPreset(head_dim=8, rope_type=99)),
            "spec.rotary.rope_type",
        ),
        (pb.EncodingSpec(rotary=pb.RotaryPreset(head_dim=8, layout=42)), "spec.rotary.layout"),
    ]
    for spec, field in cases:
        request = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=0, stop=2))
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetEncoding(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in raised.value.details()


def test_the_sdk_refuses_a_preset_with_layout_or_a_rotary_preset_with_base() -> None:
    with posenc.Client("127.0.0.1:1", max_retries=0) as client:
        with pytest.raises(posenc.InvalidArgumentError, match=r"spec\.layout"):
            client.get_range(0, 4, 8, preset="whisper", layout="split")
        with pytest.raises(posenc.InvalidArgumentError, match=r"spec\.base"):
            client.get_range(0, 4, preset=RotaryPreset(head_dim=8), base=5.0)
        with pytest.raises(posenc.InvalidArgumentError, match=r"spec\.sinusoidal\.name"):
            client.get_range(0, 4, 8, preset="nope")
        with pytest.raises(posenc.InvalidArgumentError, match=r"spec\.preset"):
            client.get_range(0, 4, 8, preset=42)  # type: ignore[arg-type]
    # The defaults may be spelled as everywhere else (names are case-insensitive).
    plain = proto.range_query(
        0,
        4,
        8,
        base=10000.0,
        dtype="float32",
        layout="interleaved",
        schedule="paper",
        preset="whisper",
    )
    spelled = proto.range_query(
        0,
        4,
        8,
        base=10000.0,
        dtype="float32",
        layout="Interleaved",
        schedule="PAPER",
        preset="whisper",
    )
    assert spelled.spec == plain.spec


# -- SDK ------------------------------------------------------------------------------------


def test_sync_and_async_clients_serve_the_same_preset_tables(server: RunningServer) -> None:
    rope = RotaryPreset(
        head_dim=64,
        rope_theta=1e6,
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=32768,
        layout="vllm",
    )
    with posenc.Client(server.target) as client:
        table = client.get_range(100, 5000, preset=rope, dtype="float64")
        rows = client.get_positions([7, 2**42], preset=rope)
        streamed = np.concatenate(
            [chunk for _, chunk in client.iter_range(0, 3000, 384, preset="whisper")]
        )
        listed = np.concatenate(
            [chunk for _, chunk in client.iter_positions([5, 1, 9], 384, preset="whisper")]
        )

    async def fetch() -> tuple[Any, Any, Any]:
        async with posenc.AsyncClient(server.target) as client:
            return (
                await client.get_range(100, 5000, preset=rope, dtype="float64"),
                await client.get_positions([7, 2**42], preset=rope),
                await client.get_range(0, 3000, 384, preset="whisper"),
            )

    async_table, async_rows, async_whisper = asyncio.run(fetch())
    assert table.shape == (4900, 64) and rows.shape == (2, 64)
    np.testing.assert_array_equal(table, async_table)
    np.testing.assert_array_equal(rows, async_rows)
    np.testing.assert_array_equal(streamed, async_whisper)
    np.testing.assert_array_equal(listed, async_whisper[[5, 1, 9]])
    spec = rotary_spec(
        Rope(64, "yarn", 1e6, factor=4.0, original_max_position_embeddings=32768, layout="vllm"),
        "float64",
    )
    np.testing.assert_array_equal(table, engine.encode_range(spec, 100, 5000))


def test_rotary_preset_from_a_model_config() -> None:
    llama = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3, "rope_type": "llama3"},
    }
    preset = RotaryPreset.from_config(llama)
    assert preset == RotaryPreset(head_dim=128, rope_theta=500000.0, **LLAMA3)
    phi3 = {
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 48,
            "long_factor": [2.0] * 48,
            "original_max_position_embeddings": 4096,
        },
    }
    preset = RotaryPreset.from_config(phi3, layout="vllm", seq_len=5000)
    assert preset.rope_type == "longrope" and preset.max_position_embeddings == 131072
    assert preset.width == 96 and preset.seq_len == 5000
    qwen_yarn = {
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    preset = RotaryPreset.from_config(qwen_yarn)
    assert (preset.head_dim, preset.rope_theta, preset.factor) == (128, 1e6, 4.0)
    assert preset.max_position_embeddings is None  # factor given: not a yarn parameter


# -- CLI ------------------------------------------------------------------------------------


def test_cli_fetches_presets(
    server: RunningServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from posenc.cli import main

    target = ["--target", server.target, "--no-progress"]
    out = tmp_path / "fairseq.npy"
    argv = ["fetch", "0", "10", "--d-model", "16", "--preset", "fairseq", "-o", str(out)]
    assert main([*argv, "--preset-param", "padding_idx=3", *target]) == 0
    table = np.load(out)
    assert not table[3].any() and table[4].any()

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "max_position_embeddings": 131072,
                "rope_theta": 500000.0,
                "rope_scaling": LLAMA3,
            }
        )
    )
    out = tmp_path / "llama3.npy"
    argv = ["fetch", "0", "64", "--rope-config", str(config), "--preset-param", "layout=vllm"]
    assert main([*argv, "-o", str(out), *target]) == 0
    expected = engine.encode_range(
        rotary_spec(Rope(128, **LLAMA3, rope_theta=500000.0, layout="vllm")), 0, 64
    )
    np.testing.assert_array_equal(np.load(out), expected)

    out = tmp_path / "yarn.npy"
    params = ["head_dim=64", "rope_type=yarn", "factor=4", "original_max_position_embeddings=2048"]
    argv = ["fetch", "0", "8", "--preset", "rotary", "-o", str(out)]
    for param in params:
        argv += ["--preset-param", param]
    assert main([*argv, *target]) == 0
    assert np.load(out).shape == (8, 128)

    bad = ["fetch", "0", "8", "--d-model", "8", "--preset", "whisper", "-o", str(out)]
    assert main([*bad, "--preset-param", "padding_idx=1", *target]) == 1
    assert "spec.sinusoidal.padding_idx" in capsys.readouterr().err
    assert main([*bad, "--preset-param", "nope=1", *target]) == 1
    assert "KEY one of" in capsys.readouterr().err
    assert main(["info", "--target", server.target]) == 0
    assert "rotary:llama3" in capsys.readouterr().out


@pytest.mark.parametrize("config", [{"num_attention_heads": 8}, ["hidden_size"], {}])
def test_a_model_config_without_a_head_width_is_an_invalid_argument(config: Any) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as raised:
        RotaryPreset.from_config(config)
    assert raised.value.field_violations[0][0] == "config"
