"""Table kinds: the accuracy contract against mpmath, the engine's generic paths, the server's
catalogue and the parameter checks, and that every parameter reaches the rows.

Conformance with the models' own code (transformers, in float32) is in test_conformance.py;
here every kind is held to the accuracy contract against the independent mpmath reference of
reference_tables.py, at every scale up to the position limit.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor
from reference import engine_positions, engine_range, within_contract
from reference_tables import LLAMA3, Rope, Sin, columns_of, rope_exact, sinusoidal_exact

import posenc
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server.app import RunningServer
from posenc_server.tables import KINDS, Documented

POSITIONS = [0, 1, 2, 1000, 2**31 - 1, 2**40 + 7, 2**42, -(2**42), -5]


def proto(table: Sin | Rope | posenc.Spec, dtype: str = "float32") -> pb.EncodingSpec:
    """The EncodingSpec of a table in ``dtype``."""
    spec = table if isinstance(table, posenc.Spec) else table.spec()
    message = spec.to_proto()
    message.dtype = pb.Dtype.Value(f"DTYPE_{dtype.upper()}")
    return message


def seeded(name: str) -> np.random.Generator:
    """Random numbers of their own for each test and dtype."""
    return np.random.default_rng(zlib.crc32(name.encode()))


SINUSOIDAL_CASES = [
    Sin("sinusoidal", 64),
    Sin("sinusoidal", 7, base=500000.0),
    Sin("sinusoidal", 512, layout="split"),
    Sin("sinusoidal", 9, layout="split"),
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

DYNAMIC = Rope(128, "dynamic", 10000.0, factor=2.0, max_position_embeddings=4096)
# Phi-3's shape of longrope: a short and a long factor per frequency.
LONGROPE = Rope(
    96,
    "longrope",
    10000.0,
    original_max_position_embeddings=4096,
    max_position_embeddings=131072,
    short_factor=tuple(1.0 + i / 48 for i in range(48)),
    long_factor=tuple(1.0 + i for i in range(48)),
)
ROTARY_CASES = [
    Rope(128, "default", 500000.0),
    Rope(64, "default", 10000.0, layout="vllm", partial_rotary_factor=0.5),
    Rope(80, "default", 10000.0, layout="gptj", partial_rotary_factor=0.4),
    Rope(128, "linear", 10000.0, factor=4.0, layout="gptj"),
    DYNAMIC,
    dataclasses.replace(DYNAMIC, seq_len=20000, layout="vllm"),  # grown past its length
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
    LONGROPE,
    # The same factors, scaled by ``factor`` instead, at a sequence length past the original.
    dataclasses.replace(
        LONGROPE, max_position_embeddings=None, factor=32.0, seq_len=5000, layout="vllm"
    ),
    LLAMA3,
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
    # Gemma 4's full-attention layers, and a proportional table with a factor.
    Rope(512, "proportional", 1e6, partial_rotary_factor=0.25),
    Rope(80, "proportional", 1e4, partial_rotary_factor=0.4, factor=8.0, layout="gptj"),
    Rope(64, "proportional", 5e5, factor=0.5, layout="vllm"),
    # A model's own float32 inv_freq (Llama's 64 frequencies), a zero and a negative one.
    Rope(
        128,
        "frequencies",
        inv_freq=(
            *(float(np.float32(500000.0 ** (-2 * i / 128))) for i in range(61)),
            0.0,
            -0.25,
            1024.0,
        ),
        attention_factor=1.25,
    ),
    Rope(
        64,
        "frequencies",
        inv_freq=tuple(float(np.float32(1e4 ** (-2 * i / 32))) for i in range(16)),
        partial_rotary_factor=0.5,
        layout="vllm",
    ),
]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_sinusoidal_kinds_meet_the_contract(dtype: str) -> None:
    rng = seeded(f"sinusoidal {dtype}")
    failures, checked = [], 0
    for table in SINUSOIDAL_CASES:
        positions = [*POSITIONS, table.padding_idx, table.padding_idx + 1]
        positions += [int(p) for p in rng.integers(-(2**42), 2**42, size=4)]
        rows = engine_positions(proto(table, dtype), positions)
        columns = columns_of(table.d_model, rng.integers(0, table.d_model, size=4).tolist())
        for row, position in enumerate(positions):
            for column in columns:
                checked += 1
                if not within_contract(
                    rows[row, column], sinusoidal_exact(table, position, column)
                ):
                    failures.append((table, position, column, rows[row, column]))
    assert checked > 1000
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_rotary_kinds_meet_the_contract(dtype: str) -> None:
    rng = seeded(f"rotary {dtype}")
    failures, checked = [], 0
    cache: dict[Rope, Any] = {}
    for rope in ROTARY_CASES:
        positions = POSITIONS + [int(p) for p in rng.integers(-(2**42), 2**42, size=3)]
        rows = engine_positions(proto(rope, dtype), positions)
        assert rows.shape[1] == rope.width
        columns = columns_of(rope.width, [rope.dim // 2 - 1, rope.dim // 2, rope.dim - 1, rope.dim])
        columns += rng.integers(0, rope.width, size=3).tolist()
        for row, position in enumerate(positions):
            for column in columns:
                checked += 1
                if not within_contract(
                    rows[row, column], rope_exact(rope, position, column, cache)
                ):
                    failures.append((rope.rope_type, rope.layout, position, column))
    assert checked > 1000
    assert not failures, failures[:5]


@pytest.mark.parametrize("case", [*SINUSOIDAL_CASES[::3], *ROTARY_CASES[::2]], ids=repr)
def test_ranges_and_lists_give_the_same_rows(case: Sin | Rope) -> None:
    # Descending and clamped position maps take the list path for ranges, shifted ones the
    # range path for lists: every way gives the same bytes.
    spec = proto(case)
    for start in (-70, 2**42 - 200, 0):
        by_range = engine_range(spec, start, start + 200)
        by_list = engine_positions(spec, np.arange(start, start + 200)[::-1])[::-1]
        scattered = np.arange(start, start + 200)[::37]
        np.testing.assert_array_equal(by_range, by_list)
        np.testing.assert_array_equal(engine_positions(spec, scattered), by_range[::37])


def test_the_classic_layouts_are_whisper_and_tensor2tensor_conventions() -> None:
    # whisper is the tensor2tensor schedule in the split layout; tensor2tensor with its
    # defaults is the same table, and start_index shifts its rows.
    classic = posenc.Spec("sinusoidal", d_model=384, layout="split", schedule="tensor2tensor")
    whisper = engine_range(proto(posenc.Spec("whisper", d_model=384)), 0, 300)
    np.testing.assert_array_equal(engine_range(proto(classic), 0, 300), whisper)
    t2t = posenc.Spec("tensor2tensor", d_model=384, start_index=7)
    np.testing.assert_array_equal(engine_range(proto(t2t), 0, 293), whisper[7:])


def test_fairseq_rows_are_the_module_weights() -> None:
    # Row padding_idx is zero; token t of an unpadded sentence is row padding_idx + 1 + t.
    spec = proto(Sin("fairseq", 8, padding_idx=1), "float64")
    table = engine_range(spec, 0, 5)
    assert not table[1].any()
    np.testing.assert_allclose(table[2, :4], np.sin(2 * 10000.0 ** (-np.arange(4) / 3)))
    assert table[0, 4] == 1.0  # cos(0) in the first cos column
    np.testing.assert_array_equal(engine_positions(spec, [1, 2, 1]), table[[1, 2, 1]])


def test_transformer_xl_rows_descend_from_key_length() -> None:
    spec = proto(Sin("transformer_xl", 16, key_length=6, clamp_len=3), "float64")
    plain = proto(Sin("transformer_xl", 16), "float64")
    rows = engine_range(spec, 0, 6)
    np.testing.assert_array_equal(rows, engine_positions(plain, [3, 3, 3, 2, 1, 0]))


# -- every parameter reaches the rows, and the server keeps such tables apart ---------------


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
    }
    return [dataclasses.replace(rope, **{name: value}) for name, value in changes.items()]


def _rows(stub: posenc_pb2_grpc.PositionalEncodingServiceStub, spec: pb.EncodingSpec) -> bytes:
    # Past 4096: longrope's and dynamic's seq_len switch there.
    request = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=0, stop=3000))
    positions = pb.PositionList(positions=[5000, 9000, 2**40])
    listed = pb.GetEncodingRequest(spec=spec, positions=positions)
    return stub.GetEncoding(request).tensor.data + stub.GetEncoding(listed).tensor.data


def test_every_parameter_changes_the_rows_the_server_sends(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    # Each variant differs from its base in one parameter. The server keeps one table per
    # distinct table (its cache is keyed by value): a parameter it dropped would give the
    # base's rows. yarn with max_position_embeddings only uses it without a factor.
    # mscale counts only beside mscale_all_dim (and their ratio 1 is no scale).
    yarn = Rope(
        64,
        "yarn",
        10000.0,
        factor=4.0,
        original_max_position_embeddings=2048,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    derived = Rope(64, "yarn", original_max_position_embeddings=2048, max_position_embeddings=8000)
    longrope = Rope(
        64,
        "longrope",
        original_max_position_embeddings=2048,
        max_position_embeddings=8000,
        short_factor=(1.0,) * 32,
        long_factor=(2.0,) * 32,
    )
    dynamic = Rope(64, "dynamic", factor=2.0, max_position_embeddings=1024)
    pairs: list[tuple[Any, Any]] = [
        (yarn, variant) for variant in _variants(yarn) if variant.max_position_embeddings is None
    ]
    pairs += [
        (derived, dataclasses.replace(derived, max_position_embeddings=9000)),
        (longrope, dataclasses.replace(longrope, seq_len=9000)),
        (longrope, dataclasses.replace(longrope, attention_factor=1.5)),
        (dynamic, dataclasses.replace(dynamic, seq_len=4000)),
        (Sin("fairseq", 64), Sin("fairseq", 64, padding_idx=2)),
        (Sin("fairseq", 64), Sin("fairseq", 64, base=5000.0)),
        (Sin("tensor2tensor", 64), Sin("tensor2tensor", 64, min_timescale=2.0)),
        (Sin("tensor2tensor", 64), Sin("tensor2tensor", 64, start_index=1)),
        (Sin("transformer_xl", 64), Sin("transformer_xl", 64, clamp_len=5)),
        (Sin("transformer_xl", 64), Sin("transformer_xl", 64, key_length=6)),
        (Sin("sinusoidal", 64), Sin("sinusoidal", 64, layout="split")),
        (Sin("whisper", 64), Sin("whisper", 64, base=500.0)),
    ]
    for base, variant in pairs:
        first = _rows(stub, proto(base))
        assert _rows(stub, proto(variant)) != first, variant
        assert _rows(stub, proto(base)) == first, base
    assert _rows(stub, proto(yarn, "float64")) != _rows(stub, proto(yarn))


def test_a_default_spelled_out_is_the_same_table(server: RunningServer) -> None:
    spelled = posenc.Spec("rotary", head_dim=64, rope_theta=10000.0, layout="transformers")
    with posenc.Client(server.target) as client:
        plain = client.get_range(0, 100, posenc.Spec("rotary", head_dim=64))
        hits = client.server_info().cache.hits
        np.testing.assert_array_equal(client.get_range(0, 100, spelled), plain)
        # The same table by value: its rows come from the cache.
        assert client.server_info().cache.hits > hits


# -- the catalogue and the parameters, from the proto descriptors ---------------------------


KIND_MESSAGES = {
    field.name: field.message_type
    for field in pb.EncodingSpec.DESCRIPTOR.fields
    if field.message_type
}


def _cases(message: Descriptor) -> dict[str, Descriptor]:
    """The message-typed cases of the message's oneofs (rotary's scalings)."""
    return {
        field.name: field.message_type
        for oneof in message.oneofs
        for field in oneof.fields
        if field.message_type is not None
    }


def test_a_kind_documents_the_width_rule_it_checks() -> None:
    # A kind with a width rule of its own must document d_model by that rule: a kind that
    # sets WIDTH and keeps the base's d_model would check one rule and document another.
    ruled = [kind for kind in KINDS.values() if hasattr(kind, "WIDTH")]
    assert len(ruled) >= 4
    for kind in ruled:
        assert kind.PARAMETERS["d_model"].description == kind.WIDTH.doc, kind  # type: ignore[attr-defined]


def test_every_kind_and_variant_has_the_fields_of_its_message() -> None:
    # Adding a parameter to the proto without its kind (or its documentation) fails here.
    def check(kind: type[Documented], message: Descriptor) -> None:
        scalars = [field.name for field in message.fields if field.message_type is None]
        assert list(kind.PARAMETERS) == scalars, kind
        fields = {field.name for field in dataclasses.fields(kind)}  # type: ignore[arg-type]
        assert fields == {*scalars, *kind.VARIANTS}, kind
        for oneof, variants in kind.VARIANTS.items():
            cases = {
                field.name: field.message_type for field in message.oneofs_by_name[oneof].fields
            }
            assert set(variants) == set(cases), kind
            for name, variant in variants.items():
                check(variant, cases[name])  # type: ignore[arg-type]

    table = pb.EncodingSpec.DESCRIPTOR.oneofs_by_name["table"]
    assert list(KINDS) == [field.name for field in table.fields]
    for field in table.fields:
        check(KINDS[field.name], field.message_type)  # type: ignore[arg-type]


def test_server_info_lists_every_kind_and_scaling_with_its_parameters(
    server: RunningServer,
) -> None:
    with posenc.Client(server.target) as client:
        info = client.server_info()
    by_name = {kind.name: kind for kind in info.table_kinds}
    table = pb.EncodingSpec.DESCRIPTOR.oneofs_by_name["table"]
    scalings = _cases(pb.RotaryTable.DESCRIPTOR)
    # In proto order, each kind followed by its variants.
    expected: list[str] = []
    for field in table.fields:
        expected.append(field.name)
        if field.name == "rotary":
            expected += [f"rotary.{name}" for name in scalings]
    assert list(by_name) == expected
    for name, kind in by_name.items():
        assert kind.description, name
        message = scalings[name.split(".")[1]] if "." in name else KIND_MESSAGES[name]
        assert [p.field for p in kind.parameters] == [
            f"spec.{name}.{field.name}" for field in message.fields if field.message_type is None
        ]
    defaults = {p.field: p.default for kind in info.table_kinds for p in kind.parameters}
    assert defaults["spec.fairseq.padding_idx"] == "1"
    assert defaults["spec.rotary.yarn.beta_fast"] == "32"
    assert defaults["spec.sinusoidal.d_model"] == ""  # required
    assert defaults["spec.rotary.layout"] == "transformers"
    assert set(info.dtypes) == {"float32", "float16", "bfloat16", "float64"}


LLAMA3: dict[str, Any] = {
    "scaling": "llama3",
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
DYNAMIC: dict[str, Any] = {"scaling": "dynamic", "factor": 2.0, "max_position_embeddings": 10}
YARN: dict[str, Any] = {"scaling": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
LONGROPE: dict[str, Any] = {
    "scaling": "longrope",
    "original_max_position_embeddings": 4096,
    "factor": 4.0,
    "short_factor": [1.0] * 32,
    "long_factor": [1.0] * 32,
}

BAD_PARAMETERS: list[tuple[str, dict[str, Any], str]] = [
    ("whisper", {"d_model": 7}, "spec.whisper.d_model"),
    ("whisper", {"d_model": 8, "max_timescale": 1.0}, "spec.whisper.max_timescale"),
    ("fairseq", {"d_model": 2}, "spec.fairseq.d_model"),
    ("fairseq", {"d_model": 8, "padding_idx": -1}, "spec.fairseq.padding_idx"),
    ("transformer_xl", {"d_model": 9}, "spec.transformer_xl.d_model"),
    ("transformer_xl", {"d_model": 8, "key_length": -1}, "spec.transformer_xl.key_length"),
    ("tensor2tensor", {"d_model": 8, "min_timescale": 0.0}, "spec.tensor2tensor.min_timescale"),
    ("tensor2tensor", {"d_model": 8, "min_timescale": 1e9}, "spec.tensor2tensor.min_timescale"),
    ("tensor2tensor", {"d_model": 8, "start_index": 2**50}, "spec.tensor2tensor.start_index"),
    ("tensor2tensor", {"d_model": 0}, "spec.tensor2tensor.d_model"),
    ("sinusoidal", {"d_model": 8, "base": float("nan")}, "spec.sinusoidal.base"),
    ("rotary", {"head_dim": 0}, "spec.rotary.head_dim"),
    ("rotary", {"head_dim": 7}, "spec.rotary.head_dim"),
    ("rotary", {"head_dim": 2**20}, "spec.rotary.head_dim"),
    ("rotary", {"head_dim": 64, "rope_theta": 1.0}, "spec.rotary.rope_theta"),
    ("rotary", {"head_dim": 64, "rope_theta": float("nan")}, "spec.rotary.rope_theta"),
    ("rotary", {"head_dim": 64, "partial_rotary_factor": 1.5}, "spec.rotary.partial_rotary_factor"),
    ("rotary", {"head_dim": 64, "scaling": "linear"}, "spec.rotary.linear.factor"),
    ("rotary", {"head_dim": 64, "scaling": "linear", "factor": -1.0}, "spec.rotary.linear.factor"),
    (
        "rotary",
        {"head_dim": 64, "scaling": "dynamic", "factor": 2.0},
        "spec.rotary.dynamic.max_position_embeddings",
    ),
    ("rotary", {"head_dim": 6, "partial_rotary_factor": 0.5, **DYNAMIC}, "spec.rotary.head_dim"),
    (
        "rotary",
        {"head_dim": 64, "scaling": "yarn", "factor": 2.0},
        "spec.rotary.yarn.original_max_position_embeddings",
    ),
    (
        "rotary",
        {"head_dim": 64, "scaling": "yarn", "original_max_position_embeddings": 4096},
        "spec.rotary.yarn.factor",
    ),
    ("rotary", {"head_dim": 64, **YARN, "beta_fast": -1.0}, "spec.rotary.yarn.beta_fast"),
    (
        "rotary",
        {"head_dim": 64, **LLAMA3, "high_freq_factor": 0.5},
        "spec.rotary.llama3.high_freq_factor",
    ),
    (
        "rotary",
        {"head_dim": 64, **LONGROPE, "short_factor": [1.0] * 31},
        "spec.rotary.longrope.short_factor",
    ),
    (
        "rotary",
        {"head_dim": 64, **{**LONGROPE, "long_factor": []}},
        "spec.rotary.longrope.long_factor",
    ),
    (
        "rotary",
        {"head_dim": 64, **LONGROPE, "long_factor": [1.0] * 31 + [float("inf")]},
        "spec.rotary.longrope.long_factor",
    ),
    ("rotary", {"head_dim": 64, **LONGROPE, "seq_len": 0}, "spec.rotary.longrope.seq_len"),
    (
        "rotary",
        {"head_dim": 8, "scaling": "proportional", "factor": 0.0},
        "spec.rotary.proportional.factor",
    ),
    ("rotary", {"head_dim": 7, "scaling": "proportional"}, "spec.rotary.head_dim"),
    (
        "rotary",
        {"head_dim": 8, "scaling": "frequencies", "inv_freq": [1.0] * 3},
        "spec.rotary.frequencies.inv_freq",
    ),
    (
        "rotary",
        {"head_dim": 4, "scaling": "frequencies", "inv_freq": [1.0, float("nan")]},
        "spec.rotary.frequencies.inv_freq",
    ),
    (
        "rotary",
        {"head_dim": 4, "scaling": "frequencies", "inv_freq": [1.0, -1025.0]},
        "spec.rotary.frequencies.inv_freq",
    ),
    (
        "rotary",
        {"head_dim": 4, "scaling": "frequencies", "inv_freq": [1.0, 0.5], "attention_factor": 3.0},
        "spec.rotary.frequencies.attention_factor",
    ),
]


def _proto_of(kind: str, parameters: dict[str, Any], field: str) -> pb.EncodingSpec:
    """The spec of ``parameters`` as sent. The SDK refuses a NaN or infinite ``field`` itself
    (checked here): the server's own refusal is tested with the value set on the message."""
    name = field.rpartition(".")[2]
    value = parameters.get(name)
    values = value if isinstance(value, list) else [value]
    if not any(isinstance(v, float) and not math.isfinite(v) for v in values):
        return posenc.Spec(kind, **parameters).to_proto()
    with pytest.raises(posenc.InvalidArgumentError, match=re.escape(field)):
        posenc.Spec(kind, **parameters)
    finite = [1.0 if isinstance(v, float) and not math.isfinite(v) else v for v in values]
    spec = posenc.Spec(kind, **{**parameters, name: finite if isinstance(value, list) else 1.0})
    proto = spec.to_proto()
    message: Any = proto
    for part in field.split(".")[1:-1]:
        message = getattr(message, part)
    if isinstance(value, list):
        del getattr(message, name)[:]
        getattr(message, name).extend(value)
    else:
        setattr(message, name, value)
    return proto


@pytest.mark.parametrize(("kind", "parameters", "field"), BAD_PARAMETERS, ids=lambda v: str(v)[:60])
def test_bad_parameters_get_invalid_argument_naming_the_field(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
    kind: str,
    parameters: dict[str, Any],
    field: str,
) -> None:
    spec = _proto_of(kind, parameters, field)
    request = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=0, stop=4))
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetEncoding(request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}:" in raised.value.details()


def test_a_required_number_left_out_is_said_to_be_perhaps_unset(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    # proto3 cannot tell a factor left out from 0.0: "got 0.0" alone blamed a value the
    # caller never gave.
    spec = posenc.Spec("rotary", head_dim=64, scaling="linear").to_proto()
    request = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=0, stop=4))
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetEncoding(request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.rotary.linear.factor:" in raised.value.details()
    assert "got 0.0 (or not set)" in raised.value.details()


def test_defaults_are_not_judged_against_other_limits(server_factory: Any) -> None:
    # At the largest position limit no offset fits, yet kinds left at their defaults work.
    server = server_factory(max_abs_position=1 << 52)
    with posenc.Client(server.target) as client:
        for kind in ("sinusoidal", "tensor2tensor", "transformer_xl"):
            assert client.get_range(0, 2, posenc.Spec(kind, d_model=64)).shape == (2, 64)
        with pytest.raises(posenc.InvalidArgumentError) as raised:
            client.get_range(0, 2, posenc.Spec("tensor2tensor", d_model=64, max_timescale=0.5))
    # Only the field the request got wrong: min_timescale (default 1) is not blamed.
    assert [field for field, _ in raised.value.field_violations] == [
        "spec.tensor2tensor.max_timescale"
    ]


def test_unknown_enum_values_and_an_unset_table_are_refused(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    rotary, sinusoidal = pb.EncodingSpec(), pb.EncodingSpec()
    rotary.rotary.layout = 42  # type: ignore[assignment]
    sinusoidal.sinusoidal.schedule = 9  # type: ignore[assignment]
    sinusoidal.sinusoidal.d_model = 8
    cases = [
        (pb.EncodingSpec(), "spec.table"),
        (rotary, "spec.rotary.layout"),
        (sinusoidal, "spec.sinusoidal.schedule"),
    ]
    for spec, field in cases:
        request = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=0, stop=2))
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetEncoding(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in raised.value.details()


# -- through the SDK ------------------------------------------------------------------------


def test_the_sdk_serves_the_engine_tables(server: RunningServer) -> None:
    rope = Rope(64, "yarn", 1e6, factor=4.0, original_max_position_embeddings=32768, layout="vllm")
    whisper = Sin("whisper", 384)
    with posenc.Client(server.target) as client:
        table = client.get_range(100, 5000, rope.spec(), dtype="float64")
        rows = client.get_positions([7, 2**42], rope.spec())
        streamed = np.concatenate(
            [chunk for _, chunk in client.iter_range(0, 3000, whisper.spec())]
        )
    np.testing.assert_array_equal(table, engine_range(proto(rope, "float64"), 100, 5000))
    np.testing.assert_array_equal(rows, engine_positions(proto(rope), [7, 2**42]))
    np.testing.assert_array_equal(streamed, engine_range(proto(whisper), 0, 3000))
