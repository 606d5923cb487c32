"""Every spec a client can send is either served within the accuracy contract or refused.

A hypothesis property over the rotary kind (every scaling), the sinusoidal kinds and the
several-axis kinds (M-RoPE, the sin-cos grids), with extreme parameters (zero of both signs,
subnormals, tiny, huge, infinite and NaN values, lists of such factors, lengths at their
limits) sent through the SDK to a real server: the answer is INVALID_ARGUMENT naming fields of
the spec, or a table whose every element is finite and (one-axis kinds) whose sampled elements
are within the accuracy contract against the mpmath reference (reference_tables.py; the
several-axis kinds' contract is tests/test_multiaxis.py's), never INTERNAL, UNKNOWN or any
other error. Some hundreds of examples in `make test`, 3,000 per kind family in `make soak`
(POSENC_SOAK=1).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from reference import within_contract
from reference_tables import Rope, Sin, rope_exact, sinusoidal_exact

import posenc
from posenc_server.app import start_server
from posenc_server.config import ServerConfig

SOAK = os.environ.get("POSENC_SOAK") == "1"
EXAMPLES = 3000 if SOAK else 250
LIMIT = 2**42

EXTREME_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    1e-310,
    2.2250738585072014e-308,
    1e-300,
    1e-30,
    2.0**-11,
    2.0**-10,
    0.5,
    1.0,
    1.0000000000000002,
    1.5,
    2.0,
    2.0000000000000004,
    32.0,
    1e6,
    2.0**64,
    1.8446744073709556e19,  # the float after 2**64
    1e60,
    1e300,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
    -1.0,
    -5e-324,
]
# The extreme values above two times in three, any float (NaN and infinities included) else.
reals = st.integers(0, 2).flatmap(
    lambda pick: (
        st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
        if pick == 0
        else st.sampled_from(EXTREME_FLOATS)
    )
)
maybe_reals = st.none() | reals
lengths = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4096, 2**31, 2**62, 2**62 + 1, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
    st.integers(1, 10**6),
)
maybe_lengths = st.none() | lengths
int64s = st.one_of(
    st.sampled_from([0, 1, -1, 17, -17, LIMIT, -LIMIT, 2 * LIMIT, 2**52, -(2**63), 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
POSITIONS = [0, 1, 2, 1000, 2**20 + 3, 2**31 - 1, LIMIT, -LIMIT, -5]


@pytest.fixture(scope="module")
def client() -> Iterator[posenc.Client]:
    running = start_server(ServerConfig(port=0, metrics_port=-1, grace_seconds=1.0))
    try:
        with posenc.Client(running.target, max_retries=0, timeout=60) as sdk:
            yield sdk
    finally:
        running.stop(0)


def _served_or_refused(client: posenc.Client, spec_of: Any, dtype: str) -> np.ndarray | None:
    """The rows of POSITIONS, or None when INVALID_ARGUMENT named only fields of the spec."""
    try:
        spec = spec_of.spec()
    except posenc.InvalidArgumentError:
        assume(False)  # the SDK refused it before sending (a value out of its field's type)
        raise
    try:
        table = client.get_positions(POSITIONS, spec, dtype=dtype)
    except posenc.InvalidArgumentError as error:
        fields = [name for name, _ in error.field_violations]
        assert fields and all(name.startswith("spec.") for name in fields), error
        event("refused")
        return None
    event("served")
    assert np.isfinite(table.astype(np.float64)).all(), f"{spec_of}: non-finite rows"
    return table


def _check_sampled(table: np.ndarray, exact: Any, seed: int) -> None:
    """Sampled elements (the extreme positions always) within the accuracy contract."""
    rng = np.random.default_rng(seed)
    rows = sorted({0, 4, 5, 6, int(rng.integers(len(POSITIONS)))})
    columns = sorted({0, table.shape[1] - 1, int(rng.integers(table.shape[1]))})
    for row in rows:
        for column in columns:
            value = table[row, column]
            expected = exact(POSITIONS[row], column)
            assert within_contract(value, expected), (
                f"position {POSITIONS[row]} column {column}: {float(value)!r}, "
                f"exact {mpmath.nstr(expected, 20)}"
            )


def _check_if_served(client: posenc.Client, spec_of: Sin | Rope, dtype: str, exact: Any) -> None:
    """Sampled elements of ``spec_of``'s rows within the contract, unless it was refused."""
    table = _served_or_refused(client, spec_of, dtype)
    if table is not None:
        _check_sampled(table, exact, hash(spec_of) & 0xFFFF)


def usually(
    ordinary: st.SearchStrategy[Any], extreme: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """``ordinary`` two times in three, else ``extreme``: each spec has a few extreme fields,
    and enough specs are served to check their values."""
    return st.integers(0, 2).flatmap(lambda pick: extreme if pick == 0 else ordinary)


# How hard each search looks; the client fixture is shared between examples, by design.
SEARCH = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@st.composite
def ropes(draw: st.DrawFn) -> Rope:
    head_dim = draw(
        usually(st.sampled_from([2, 4, 8, 64, 96, 128]), st.integers(0, 80) | st.just(3))
    )
    partial = draw(usually(st.sampled_from([1.0, 0.5, 0.25]), reals))
    rope_type = draw(
        st.sampled_from(
            [
                "default",
                "linear",
                "dynamic",
                "yarn",
                "longrope",
                "llama3",
                "frequencies",
                "proportional",
            ]
        )
    )
    factor = usually(st.floats(1.0, 64.0), reals)
    length = usually(st.integers(1, 10**6), lengths)
    optional_length = usually(st.none() | st.integers(1, 10**6), maybe_lengths)
    parameters: dict[str, Any] = {
        "rope_theta": draw(usually(st.floats(1.5, 1e7), reals)),
        "partial_rotary_factor": partial,
        "layout": draw(st.sampled_from(["transformers", "vllm", "gptj"])),
    }
    if rope_type in ("linear", "dynamic", "llama3"):
        parameters["factor"] = draw(factor)
    if rope_type == "proportional":
        parameters["factor"] = draw(usually(st.none() | st.floats(0.5, 64.0), maybe_reals))
    if rope_type == "dynamic":
        parameters["max_position_embeddings"] = draw(length)
        parameters["seq_len"] = draw(optional_length)
    if rope_type == "llama3":
        parameters["original_max_position_embeddings"] = draw(length)
        low = draw(usually(st.floats(0.5, 2.0), reals))
        parameters["low_freq_factor"] = low
        above = st.floats(1.5, 8.0).map(lambda ratio: ratio * low)
        parameters["high_freq_factor"] = draw(usually(above, reals))
    if rope_type in ("yarn", "longrope"):
        parameters["factor"] = draw(usually(st.none() | st.floats(1.0, 64.0), maybe_reals))
        parameters["original_max_position_embeddings"] = draw(length)
        parameters["max_position_embeddings"] = draw(optional_length)
        parameters["attention_factor"] = draw(usually(st.none(), maybe_reals))
    if rope_type == "yarn":
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            parameters[name] = draw(usually(st.none() | st.floats(0.1, 64.0), maybe_reals))
        parameters["truncate"] = draw(st.booleans())
    if rope_type == "longrope":
        dim = int(head_dim * partial) if math.isfinite(head_dim * partial) else 0
        count = max(0, min(dim // 2, 64) + draw(usually(st.just(0), st.sampled_from([1, -1]))))
        factors = usually(st.floats(1.0, 64.0), reals)
        for name in ("short_factor", "long_factor"):
            parameters[name] = tuple(draw(st.lists(factors, min_size=count, max_size=count)))
        parameters["seq_len"] = draw(optional_length)
    if rope_type == "frequencies":
        dim = int(head_dim * partial) if math.isfinite(head_dim * partial) else 0
        count = max(0, min(dim // 2, 64) + draw(usually(st.just(0), st.sampled_from([1, -1]))))
        frequencies = usually(st.floats(-1024.0, 1024.0) | st.just(0.0), reals)
        parameters["inv_freq"] = tuple(draw(st.lists(frequencies, min_size=count, max_size=count)))
        parameters["attention_factor"] = draw(usually(st.none() | st.floats(0.1, 2.0), maybe_reals))
    return Rope(head_dim, rope_type, **parameters)


@pytest.mark.slow
@SEARCH
@given(rope=ropes(), dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]))
# A ramp whose far end (beta_slow at the largest float) lies below column 0: the reference
# once turned beta_slow * 2 into infinity and disagreed with the (correct) server.
@example(
    rope=Rope(
        2,
        "yarn",
        rope_theta=2.0,
        factor=2.0,
        original_max_position_embeddings=202,
        beta_slow=1.7976931348623157e308,
        truncate=False,
    ),
    dtype="float32",
)
def test_every_rotary_spec_is_served_within_contract_or_refused(
    client: posenc.Client, rope: Rope, dtype: str
) -> None:
    cache: dict[Rope, Any] = {}
    _check_if_served(client, rope, dtype, lambda p, c: rope_exact(rope, p, c, cache))


@st.composite
def sinusoids(draw: st.DrawFn) -> Sin:
    kind = draw(
        st.sampled_from(["sinusoidal", "tensor2tensor", "whisper", "fairseq", "transformer_xl"])
    )
    d_model = draw(
        st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 64, 513]), st.integers(0, 600))
    )
    parameters: dict[str, Any] = {"base": draw(usually(st.floats(1.5, 1e7), reals))}
    if kind == "sinusoidal":
        parameters["layout"] = draw(st.sampled_from(["interleaved", "split"]))
    if kind == "tensor2tensor":
        parameters["min_timescale"] = draw(usually(st.floats(0.01, 1000.0), reals))
        parameters["start_index"] = draw(int64s)
    if kind == "fairseq":
        parameters["padding_idx"] = draw(st.one_of(st.just(1), int64s))
    if kind == "transformer_xl":
        parameters["clamp_len"] = draw(st.one_of(st.just(0), int64s))
        parameters["key_length"] = draw(st.none() | int64s)
    return Sin(kind, d_model, **parameters)


@pytest.mark.slow
@SEARCH
@given(table=sinusoids(), dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]))
def test_every_sinusoidal_spec_is_served_within_contract_or_refused(
    client: posenc.Client, table: Sin, dtype: str
) -> None:
    _check_if_served(client, table, dtype, lambda p, c: sinusoidal_exact(table, p, c))


@pytest.mark.parametrize(
    ("rope", "field"),
    [
        # The trial's INTERNAL answers (issue 10, item 5).
        (
            Rope(
                8,
                "longrope",
                factor=4.0,
                original_max_position_embeddings=1,
                short_factor=(1.0,) * 4,
                long_factor=(1.0,) * 4,
            ),
            "spec.rotary.longrope.original_max_position_embeddings",
        ),
        (
            Rope(8, "dynamic", factor=1e60, max_position_embeddings=4096),
            "spec.rotary.dynamic.factor",
        ),
        # Its NaN, inf and huge values with status OK (item 6).
        (Rope(8, "linear", factor=5e-324), "spec.rotary.linear.factor"),
        (Rope(8, "linear", factor=1e-300), "spec.rotary.linear.factor"),
        (
            Rope(
                8,
                "longrope",
                original_max_position_embeddings=4096,
                factor=1.0,
                short_factor=(1e-310, 1.0, 1.0, 1.0),
                long_factor=(1.0,) * 4,
            ),
            "spec.rotary.longrope.short_factor",
        ),
        (
            Rope(
                8,
                "yarn",
                factor=4.0,
                original_max_position_embeddings=4096,
                mscale=1e308,
                mscale_all_dim=5e-324,
            ),
            "spec.rotary.yarn.mscale",
        ),
        (
            Rope(8, "yarn", original_max_position_embeddings=1, max_position_embeddings=2**62),
            "spec.rotary.yarn.max_position_embeddings",
        ),
    ],
)
def test_the_trials_specs_are_refused_naming_the_field(
    client: posenc.Client, rope: Rope, field: str
) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as refused:
        client.get_positions([0, 1], rope.spec(), dtype="float64")
    assert field in [name for name, _ in refused.value.field_violations], refused.value


def test_specs_at_the_edges_of_the_ranges_are_served_within_contract(
    client: posenc.Client,
) -> None:
    edges = [
        Rope(8, "linear", factor=2.0**-10),
        Rope(8, "linear", factor=2.0**64),
        Rope(8, "dynamic", factor=2.0**64, max_position_embeddings=1, seq_len=2**62),
        Rope(8, "yarn", factor=4.0, original_max_position_embeddings=4096, attention_factor=2.0),
        Rope(
            8,
            "longrope",
            original_max_position_embeddings=2,
            factor=4.0,
            short_factor=(2.0**-10, 1.0, 2.0**64, 3.0),
            long_factor=(1.0,) * 4,
        ),
    ]
    for rope in edges:
        table = client.get_positions(POSITIONS, rope.spec(), dtype="float64")
        cache: dict[Rope, Any] = {}
        for row, position in enumerate(POSITIONS):
            for column in range(table.shape[1]):
                expected = rope_exact(rope, position, column, cache)
                assert within_contract(table[row, column], expected), (rope, position, column)


@pytest.mark.slow
def test_the_largest_attention_factor_keeps_float64_within_2_to_the_minus_50(
    client: posenc.Client,
) -> None:
    # Values scaled by the attention factor carry its multiple of the rows' error: at the
    # largest accepted factor, 2, every float64 element stays within the contract.
    rope = Rope(
        64,
        "yarn",
        rope_theta=500000.0,
        factor=4.0,
        original_max_position_embeddings=4096,
        attention_factor=2.0,
        layout="vllm",
    )
    positions = np.random.default_rng(21).integers(-LIMIT, LIMIT, 200).tolist()
    table = client.get_positions(positions, rope.spec(), dtype="float64")
    cache: dict[Rope, Any] = {}
    worst = max(
        abs(mpmath.mpf(float(table[row, column])) - rope_exact(rope, position, column, cache))
        for row, position in enumerate(positions)
        for column in range(64)
    )
    print(f"attention factor 2: worst float64 error {float(worst * 2**50):.2f} x 2**-50")
    assert worst <= mpmath.mpf(2) ** -50


# -- the several-axis kinds ------------------------------------------------------------------------

COORDINATES = [[0, 0, 0], [1, 2, 3], [LIMIT, -LIMIT, 7], [-5, LIMIT, LIMIT], [2**31 - 1, 0, -1]]


@st.composite
def several_axis_specs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["mrope", "sincos_grid_2d", "sincos_grid_3d"]))
    width = usually(st.sampled_from([4, 8, 12, 16, 24, 64, 96, 128]), st.integers(0, 200))
    size = usually(st.integers(1, 64), lengths)
    parameters: dict[str, Any] = {}
    if kind == "mrope":
        parameters["head_dim"] = draw(width)
        parameters["rope_theta"] = draw(usually(st.floats(1.5, 1e7), maybe_reals))
        parameters["mrope_section"] = tuple(
            draw(st.lists(usually(st.integers(0, 24), lengths), min_size=0, max_size=4))
        )
        parameters["interleaved"] = draw(st.booleans())
        parameters["layout"] = draw(st.sampled_from(["transformers", "vllm", "gptj"]))
    else:
        parameters["embed_dim"] = draw(width)
        parameters["base"] = draw(usually(st.floats(1.5, 1e7), maybe_reals))
        parameters["grid_height"] = draw(size)
        parameters["grid_width"] = draw(size)
    if kind == "sincos_grid_2d":
        parameters["base_size"] = draw(usually(st.none() | st.floats(0.5, 64.0), maybe_reals))
        parameters["interpolation_scale"] = draw(usually(st.none(), maybe_reals))
        parameters["height_first"] = draw(st.booleans())
        parameters["flip_sin_to_cos"] = draw(st.booleans())
    if kind == "sincos_grid_3d":
        parameters["grid_frames"] = draw(size)
        parameters["temporal_dim"] = draw(st.none() | usually(st.sampled_from([2, 4, 8]), lengths))
        for name in ("spatial_interpolation_scale", "temporal_interpolation_scale"):
            parameters[name] = draw(usually(st.none(), maybe_reals))
    return kind, {name: value for name, value in parameters.items() if value is not None}


@pytest.mark.slow
@SEARCH
@given(spec=several_axis_specs(), dtype=st.sampled_from(["float32", "float64", "bfloat16"]))
def test_every_several_axis_spec_is_served_finite_or_refused(
    client: posenc.Client, spec: tuple[str, dict[str, Any]], dtype: str
) -> None:
    kind, parameters = spec
    try:
        table = posenc.Spec(kind, **parameters)
    except (posenc.InvalidArgumentError, ValueError, TypeError, OverflowError):
        assume(False)  # the SDK refused it before sending (a value out of its field's type)
        raise
    axes = 2 if kind == "sincos_grid_2d" else 3
    coordinates = np.array([row[:axes] for row in COORDINATES], dtype=np.int64)
    try:
        rows = client.get_positions(coordinates, table, dtype=dtype)
        ranged = client.get_range(0, 4, table, dtype=dtype)
    except posenc.InvalidArgumentError as error:
        fields = [name for name, _ in error.field_violations]
        assert fields and all(name.startswith("spec.") for name in fields), error
        event("refused")
        return
    event("served")
    for values in (rows, ranged):
        as_float = values.astype(np.float64)
        # Every kind's elements are sines and cosines: finite and within [-1, 1].
        assert np.isfinite(as_float).all() and (np.abs(as_float) <= 1).all(), (kind, parameters)
