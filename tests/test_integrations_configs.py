"""posenc.Spec.from_config reads every family's config as transformers 5.17 does.

For each family two configs are read: a JSON copy of the published ``config.json``
(``tests/data/configs``, typed from the published files, trimmed to what matters) and the
dict transformers' own config class makes of it (``AutoConfig.for_model(...).to_dict()``).
Each spec's table is compared with transformers' own module built from that config, at
positions 0..4096, within float32's error budget (the module rounds ``p * inv_freq`` and
``inv_freq`` to float32).
"""

from __future__ import annotations

import importlib
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posenc

# transformers' config classes and rotary modules: seconds to import and build (make test-fast
# skips them).
pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parent / "data" / "configs"
EPS32 = 2.0**-24
POSITIONS = np.arange(0, 4097)


def rotary_width(spec: posenc.Spec) -> int:
    """rotary_dim, as the proto defines it: int(head_dim * partial_rotary_factor)."""
    parameters = spec.parameters
    return int(parameters["head_dim"] * parameters.get("partial_rotary_factor", 1.0))


def published(name: str) -> dict[str, Any]:
    return dict(json.loads((CONFIGS / f"{name}.json").read_text()))


@pytest.fixture
def client(server: Any) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as client:
        yield client


def assert_close(ours: Any, theirs: Any, scale: float = 1.0) -> None:
    """Within 4 units of |p| * 2^-24 (and a few ulps) of the module's float32 rows."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape
    allowed = scale * (8 * EPS32 + 4 * EPS32 * POSITIONS[: len(ours), None].astype(np.float64))
    error = np.abs(ours - theirs)
    worst = np.unravel_index(np.argmax(error - allowed), error.shape)
    assert (error <= allowed).all(), f"position {worst[0]}, column {worst[1]}: {error[worst]:.3g}"


# -- rotary families, against transformers' modules -----------------------------------------------

ROTARY = [
    "llama-2-7b",
    "llama-3-8b",
    "llama-3.1-8b",
    "llama-3.2-1b",
    "mistral-7b-v0.1",
    "mixtral-8x7b-v0.1",
    "qwen2-7b",
    "qwen2.5-7b-instruct-yarn",
    "phi-3-mini-4k-instruct",
    "phi-3-mini-128k-instruct",
    "gemma-7b",
    "gemma-2-9b",
    "pythia-160m",
    "gpt-j-6b",
    "deepseek-v2-lite",
]


def transformers_rows(config: Any, stop: int) -> tuple[Any, Any, float]:
    """(cos, sin) of positions [0, stop) from the family's own code (its rotary module, or
    GPT-J's create_sinusoidal_positions), one column per frequency; and the scale."""
    torch = pytest.importorskip("torch")
    model_type = config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    if model_type == "gptj":
        table = module.create_sinusoidal_positions(stop, config.rotary_dim).double().numpy()
        sin, cos = np.split(table, 2, axis=1)
        return cos, sin, 1.0
    (rotary,) = (
        cls
        for name, cls in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(cls, type)
    )
    positions = torch.arange(stop)[None]
    with torch.no_grad():
        out = rotary(config)(torch.zeros(1), positions)
    if isinstance(out, torch.Tensor):  # DeepSeek-V2: cos + i sin
        values = out[0].to(torch.complex128).numpy()
        return values.real, values.imag, float(np.abs(values[0]).max())
    cos, sin = (half[0].double().numpy() for half in out)
    return cos[:, : cos.shape[1] // 2], sin[:, : sin.shape[1] // 2], float(cos[0].max())


def posenc_rows(client: posenc.Client, spec: posenc.Spec, stop: int) -> tuple[Any, Any]:
    rows = client.get_range(0, stop, spec).astype(np.float64)
    cos, sin = np.split(rows, 2, axis=1)
    layout = spec.parameters["layout"]
    half = rotary_width(spec) // 2
    if layout == "gptj":  # pairs: every other column
        return cos[:, ::2], sin[:, ::2]
    if layout == "transformers":  # duplicated halves
        return cos[:, :half], sin[:, :half]
    return cos, sin


def transformers_config(raw: dict[str, Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    values = {key: value for key, value in raw.items() if key != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(raw["model_type"], **values)


@pytest.mark.slow
@pytest.mark.parametrize("name", ROTARY)
@pytest.mark.parametrize("source", ["published", "config-class"])
def test_rotary_configs_match_transformers_modules(
    name: str, source: str, client: posenc.Client
) -> None:
    raw = published(name)
    config = transformers_config(raw)
    read = raw if source == "published" else config.to_dict()
    cases = [(len(POSITIONS), None)]
    if name == "phi-3-mini-128k-instruct":  # short below 4096 positions, long above
        cases = [(4096, None), (4097, 4097)]
    for stop, seq_len in cases:
        spec = posenc.Spec.from_config(read, seq_len=seq_len)
        cos, sin, scale = transformers_rows(config, stop)
        ours_cos, ours_sin = posenc_rows(client, spec, stop)
        assert_close(ours_cos, cos, scale)
        assert_close(ours_sin, sin, scale)


def test_published_quirks_are_read() -> None:
    phi3 = posenc.Spec.from_config(published("phi-3-mini-128k-instruct"), seq_len=9000).parameters
    # original_max_position_embeddings from the top level; the long table's seq_len.
    assert phi3["scaling"] == "longrope"
    assert phi3["original_max_position_embeddings"] == 4096
    assert phi3["seq_len"] == 4097
    assert phi3["max_position_embeddings"] == 131072
    gptj = posenc.Spec.from_config(published("gpt-j-6b")).parameters
    assert gptj == {"head_dim": 256, "layout": "gptj", "partial_rotary_factor": 0.25}
    pythia = posenc.Spec.from_config(published("pythia-160m")).parameters
    assert pythia["partial_rotary_factor"] == 0.25 and pythia["rope_theta"] == 10000.0
    gemma = posenc.Spec.from_config(published("gemma-7b")).parameters
    assert gemma["head_dim"] == 256  # not 3072 // 16
    deepseek = posenc.Spec.from_config(published("deepseek-v2-lite")).parameters
    assert deepseek["head_dim"] == 64
    assert (deepseek["mscale"], deepseek["mscale_all_dim"]) == (0.707, 0.707)
    assert deepseek["original_max_position_embeddings"] == 4096
    qwen = posenc.Spec.from_config(published("qwen2.5-7b-instruct-yarn")).parameters
    assert (qwen["scaling"], qwen["factor"]) == ("yarn", 4.0)


def test_every_scaling_field_comes_from_the_descriptor() -> None:
    from posenc_protocol.v1 import posenc_pb2 as pb

    scaling = pb.RotaryTable.DESCRIPTOR.oneofs_by_name["scaling"]
    for case in scaling.fields:
        assert case.message_type is not None
        rope: dict[str, Any] = {
            field.name: [1.0] * 4 if field.is_repeated else 3.0
            for field in case.message_type.fields
        }
        rope.update(rope_type=case.name, short_factor=[1.0] * 4, long_factor=[2.0] * 4)
        rope.update(truncate=False, unrelated_key=1.0)
        config = {"head_dim": 8, "max_position_embeddings": 7, "rope_parameters": rope}
        parameters = posenc.Spec.from_config(config).parameters
        assert parameters["scaling"] == case.name
        for field in case.message_type.fields:
            if field.name == "seq_len":
                assert "seq_len" not in parameters  # only from the seq_len argument
            elif field.name == "max_position_embeddings":
                assert parameters[field.name] == 7
            else:
                assert field.name in parameters, field.name
        assert "unrelated_key" not in parameters


def test_gemma4_proportional_layers_read_as_transformers_does() -> None:
    # Gemma 4's full-attention layers: rope type proportional over a quarter of the head.
    config = {
        "model_type": "gemma4_text",
        "head_dim": 512,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
    }
    full = posenc.Spec.from_config(config, layer_type="full_attention")
    assert full == posenc.Spec(
        "rotary",
        head_dim=512,
        layout="transformers",
        rope_theta=1e6,
        partial_rotary_factor=0.25,
        scaling="proportional",
    )
    sliding = posenc.Spec.from_config(config, layer_type="sliding_attention")
    assert sliding.parameters == {"head_dim": 512, "layout": "transformers", "rope_theta": 1e4}


def test_deepseek_v4_rope_parameters_keyed_main_and_compress() -> None:
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.125}
    config = {
        "model_type": "deepseek_v4",
        "head_dim": 512,
        "qk_rope_head_dim": 64,  # the config class's own int(head_dim * partial factor)
        "rope_parameters": {
            "main": {"rope_type": "default", **rope},
            "compress": {
                **rope,
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 65536,
                "attention_factor": 1.0,
            },
        },
    }
    main = posenc.Spec.from_config(config, layer_type="main", layout="vllm")
    assert main.parameters["partial_rotary_factor"] == 0.125
    assert main.parameters["head_dim"] == 512  # rotary_dim 64
    compress = posenc.Spec.from_config(config, layer_type="compress").parameters
    assert compress["scaling"] == "yarn" and compress["attention_factor"] == 1.0
    assert compress["rope_theta"] == 160000.0


def test_mrope_sections_can_be_read_as_the_plain_table() -> None:
    from posenc._configs import table_from_config

    config = {
        "model_type": "qwen3_5_text",
        "head_dim": 256,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    }
    with pytest.raises(posenc.InvalidArgumentError, match="partial rotary with mrope_section"):
        posenc.Spec.from_config(config)
    kind, parameters = table_from_config(config, sections=False)
    assert (kind, parameters["partial_rotary_factor"]) == ("rotary", 0.25)


def test_seq_len_is_normalised() -> None:
    dynamic = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    initial = posenc.Spec.from_config(dynamic)
    assert posenc.Spec.from_config(dynamic, seq_len=100) == initial
    assert posenc.Spec.from_config(dynamic, seq_len=2048) == initial
    assert posenc.Spec.from_config(dynamic, seq_len=2049).parameters["seq_len"] == 2049
    phi3 = published("phi-3-mini-128k-instruct")
    specs = {posenc.Spec.from_config(phi3, seq_len=n) for n in (None, 1, 4096, 4097, 9000, 131072)}
    assert len(specs) == 2


def test_rope_scaling_wins_over_rope_parameters_and_old_type_key() -> None:
    config = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5.0},
        "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 7.0},
    }
    assert posenc.Spec.from_config(config).parameters == {
        "head_dim": 16,
        "layout": "transformers",
        "rope_theta": 7.0,
        "scaling": "linear",
        "factor": 2.0,
    }


def test_partial_factor_gives_the_exact_rotary_dim() -> None:
    spec = posenc.Spec.from_config(
        {"model_type": "gptj", "n_embd": 96, "n_head": 1, "rotary_dim": 32}
    )
    assert rotary_width(spec) == 32


def test_unserved_rope_type_and_missing_width_are_refused() -> None:
    with pytest.raises(posenc.InvalidArgumentError, match="'xdrope' is not served"):
        posenc.Spec.from_config({"head_dim": 8, "rope_parameters": {"rope_type": "xdrope"}})
    with pytest.raises(posenc.InvalidArgumentError) as error:
        posenc.Spec.from_config({"rope_theta": 10.0})
    assert error.value.field_violations[0][0] == "config"
    with pytest.raises(posenc.InvalidArgumentError, match="layer type"):
        posenc.Spec.from_config(
            {"head_dim": 8, "rope_parameters": {"full_attention": {"rope_type": "default"}}}
        )


# -- hostile configs ------------------------------------------------------------------------------

# Whatever a config holds, from_config returns a Spec or raises InvalidArgumentError: never
# another exception, never a loop. The fuzz draws the same configs in every make test run
# (tests/conftest.py's derandomized profile) and new ones in make soak; what either finds
# joins HOSTILE.
_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-2, max_value=300),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-5, 100), st.floats(), st.text(max_size=2)), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_TOP_KEYS = (
    "head_dim",
    "qk_rope_head_dim",
    "hidden_size",
    "n_embd",
    "d_model",
    "num_attention_heads",
    "n_head",
    "rope_theta",
    "rotary_emb_base",
    "partial_rotary_factor",
    "rotary_pct",
    "rotary_dim",
    "max_position_embeddings",
    "n_positions",
    "original_max_position_embeddings",
    "pad_token_id",
    "sinusoidal_embeddings",
)
_ROPE_KEYS = (
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "attention_factor",
    "short_factor",
    "long_factor",
    "low_freq_factor",
    "high_freq_factor",
    "mrope_section",
    "mrope_interleaved",
)
_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "mrope", "su")
_MODEL_TYPES = (
    "llama",
    "gptj",
    "gpt_neox",
    "phi3",
    "qwen2_vl",
    "qwen3_vl_text",
    "whisper",
    "m2m_100",
    "marian",
    "xlm",
)
_ROPE = st.one_of(
    _ANY,
    st.fixed_dictionaries(
        {},
        optional={
            "rope_type": st.one_of(st.sampled_from(_ROPE_TYPES), _ANY),
            "type": st.sampled_from(_ROPE_TYPES),
            **dict.fromkeys(_ROPE_KEYS, _ANY),
        },
    ),
)
_CONFIGS = st.fixed_dictionaries(
    {},
    optional={
        "model_type": st.one_of(st.sampled_from(_MODEL_TYPES), _ANY),
        "rope_scaling": _ROPE,
        "rope_parameters": _ROPE,
        **dict.fromkeys(_TOP_KEYS, _ANY),
    },
)


# What the fuzz found (the first looped forever), checked in the fast set too.
HOSTILE: list[tuple[dict[str, Any], Any]] = [
    ({"head_dim": -300, "rotary_dim": 55}, None),
    ({"head_dim": 64, "rotary_dim": -1}, None),
    ({"hidden_size": 64, "num_attention_heads": 5e-324}, None),
    ({"head_dim": math.inf}, None),
    ({"head_dim": math.nan}, None),
    ({"head_dim": [1, 2]}, None),
    ({"head_dim": 64, "rope_theta": 10**400}, None),
    ({"head_dim": 64, "rope_theta": "x"}, None),
    ({"head_dim": 64, "rope_scaling": {"rope_type": "longrope"}}, 9000),
    (
        {"head_dim": 64, "max_position_embeddings": "x", "rope_scaling": {"type": "dynamic"}},
        9000,
    ),
    ({"head_dim": 64, "rope_scaling": {"mrope_section": 5}}, None),
    ({"head_dim": 64, "rope_scaling": {"mrope_section": ["a"]}}, None),
    ({"model_type": "whisper", "d_model": "x"}, None),
    ({"head_dim": 64}, -1.5),
]


def _spec_or_invalid_argument(config: Any, seq_len: Any = None, layout: Any = None) -> None:
    try:
        spec = posenc.Spec.from_config(config, seq_len=seq_len, layout=layout)
    except posenc.InvalidArgumentError as error:
        assert error.field_violations, error
    else:
        assert isinstance(spec, posenc.Spec)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("config", "seq_len"), HOSTILE)
def test_hostile_configs_give_invalid_argument(config: dict[str, Any], seq_len: Any) -> None:
    with pytest.raises(posenc.InvalidArgumentError):
        posenc.Spec.from_config(config, seq_len=seq_len)


@pytest.mark.slow  # 1,500 configs
@pytest.mark.timeout(300)
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=_CONFIGS,
    seq_len=st.one_of(st.none(), _ANY),
    layout=st.one_of(st.none(), st.sampled_from(["vllm", "gptj"]), _ANY),
)
def test_any_config_gives_a_spec_or_invalid_argument(
    config: dict[str, Any], seq_len: Any, layout: Any
) -> None:
    _spec_or_invalid_argument(config, seq_len, layout)


def test_a_config_object_whose_to_dict_is_not_a_mapping_is_refused() -> None:
    class Odd:
        def to_dict(self) -> list[int]:
            return [1]

    with pytest.raises(posenc.InvalidArgumentError, match="to_dict"):
        posenc.Spec.from_config(Odd())


# -- sinusoidal families --------------------------------------------------------------------------

SINUSOIDAL = {
    "whisper-tiny": posenc.Spec("whisper", d_model=384),
    "m2m100_418M": posenc.Spec("fairseq", d_model=1024, padding_idx=1),
    "nllb-200-distilled-600M": posenc.Spec("fairseq", d_model=1024, padding_idx=1),
    "s2t-small-librispeech-asr": posenc.Spec("fairseq", d_model=256, padding_idx=1),
    "opus-mt-en-de": posenc.Spec("sinusoidal", d_model=512, layout="split"),
    "pegasus-xsum": posenc.Spec("sinusoidal", d_model=1024, layout="split"),
}


@pytest.mark.parametrize("name", list(SINUSOIDAL))
def test_sinusoidal_specs_from_published_configs(name: str) -> None:
    raw = published(name)
    assert posenc.Spec.from_config(raw) == SINUSOIDAL[name]
    assert posenc.Spec.from_config(transformers_config(raw).to_dict()) == SINUSOIDAL[name]


def test_published_xlm_learns_its_positions() -> None:
    with pytest.raises(posenc.InvalidArgumentError, match="learns"):
        posenc.Spec.from_config(published("xlm-mlm-en-2048"))
    config = transformers_config({**published("xlm-mlm-en-2048"), "sinusoidal_embeddings": True})
    assert posenc.Spec.from_config(config) == posenc.Spec("sinusoidal", d_model=2048)


@pytest.mark.slow
def test_sinusoidal_tables_match_transformers(client: posenc.Client) -> None:
    torch = pytest.importorskip("torch")
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    from transformers.models.whisper.modeling_whisper import sinusoids
    from transformers.models.xlm.modeling_xlm import create_sinusoidal_embeddings

    stop, d = 4097, 64
    config = {"d_model": d, "pad_token_id": 1}
    cases = {
        "whisper": sinusoids(stop, d),
        "m2m_100": M2M100SinusoidalPositionalEmbedding.get_embedding(stop, d, 1),
        "marian": MarianSinusoidalPositionalEmbedding(stop, d).create_weight(),
        "xlm": create_sinusoidal_embeddings(stop, d, torch.empty(stop, d)),
    }
    for model_type, theirs in cases.items():
        spec = posenc.Spec.from_config(
            {**config, "model_type": model_type, "emb_dim": d, "sinusoidal_embeddings": True}
        )
        assert_close(client.get_range(0, stop, spec), theirs.double().numpy())


def test_a_transformers_config_object_is_read(client: posenc.Client) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTJConfig(n_embd=128, n_head=4, rotary_dim=16)
    spec = posenc.Spec.from_config(config)
    assert spec.parameters["layout"] == "gptj" and rotary_width(spec) == 16
    assert client.get_range(0, 2, spec).shape == (2, 32)
    assert not math.isnan(float(client.get_range(5, 6, spec).sum()))
