"""A model's ``config.json`` (or transformers config object) as the :class:`Spec` of its
positional table, read as transformers 5 reads it: the body of :meth:`Spec.from_config`.

Rotary families (Llama 2/3/3.1/3.2, Mistral, Mixtral, Qwen2/2.5, Phi-3/3.5, Gemma/Gemma 2,
GPT-NeoX/Pythia, GPT-J, DeepSeek-V2, and any config with transformers' rope parameters) give a
``"rotary"`` spec; sinusoidal families (Whisper's encoder, M2M100/NLLB, Speech2Text,
Marian/Pegasus, XLM) give their sinusoidal kind::

    spec = Spec.from_config(json.load(open("config.json")))
    spec = Spec.from_config(model.config, seq_len=9000)   # dynamic / longrope

The rope parameters are mapped onto the fields of the ``RotaryTable.scaling`` message the rope
type names, read from the protocol's descriptors: a field the proto adds is read from configs
as it is, and keys a scaling does not take are ignored, as transformers ignores them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor

from posenc._checks import bad_argument
from posenc.errors import InvalidArgumentError
from posenc_protocol.descriptors import INTEGER_RANGES, cases, message_of
from posenc_protocol.v1 import posenc_pb2 as pb

__all__ = ["MROPE_FAMILIES", "SINUSOIDAL_FAMILIES", "Table", "config_dict", "table_from_config"]

Table = tuple[str, dict[str, Any]]
"""A table kind and its parameters: what :class:`posenc.Spec` is built from."""

_SCALING: Final = pb.RotaryTable.DESCRIPTOR.oneofs_by_name["scaling"]
# transformers' aliases of the width keys (PretrainedConfig.attribute_map of GPT-J, XLM, ...).
_HIDDEN: Final = ("hidden_size", "n_embd", "d_model", "emb_dim")
_HEADS: Final = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_MAX_POSITIONS: Final = ("max_position_embeddings", "n_positions")
# Rope types whose pretraining length transformers takes from the top level of the config
# before the rope parameters (RotaryEmbeddingConfigMixin.standardize_rope_params): Phi-3's
# published config keeps original_max_position_embeddings there.
_TOP_LEVEL_ORIGINAL: Final = frozenset({"llama3", "yarn", "longrope"})
# Phi3Config.convert_rope_params_to_dict: the Phi-3 names of longrope.
_PHI3_LONGROPE: Final = frozenset({"su", "yarn"})
# GPTNeoXConfig.convert_rope_params_to_dict: the default rotary_pct.
_GPT_NEOX_ROTARY_PCT: Final = 0.25

#: The sinusoidal families, by ``model_type``, and the table kind each uses.
SINUSOIDAL_FAMILIES: Final[Mapping[str, str]] = {
    "whisper": "whisper",
    "m2m_100": "fairseq",  # NLLB checkpoints are m2m_100 models
    "speech_to_text": "fairseq",
    "marian": "sinusoidal (split)",
    "pegasus": "sinusoidal (split)",
    "xlm": "sinusoidal",
}

#: The M-RoPE families, by ``model_type`` (their text configs' without ``_text``): the
#: ``mrope_section`` their rotary modules default to, and whether they interleave it.
MROPE_FAMILIES: Final[Mapping[str, tuple[tuple[int, ...], bool]]] = {
    "qwen2_vl": ((16, 24, 24), False),
    "qwen2_5_vl": ((16, 24, 24), False),
    "qwen3_vl": ((24, 20, 20), True),
    "qwen3_vl_moe": ((24, 20, 20), True),
}


def config_dict(config: object) -> dict[str, Any]:
    """The config's keys: a mapping as it is, a transformers config through ``to_dict``
    (its text config for multimodal models)."""
    if isinstance(config, Mapping):
        return dict(config)
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config()
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise bad_argument("config", f"must be a mapping or a model config, got {type(config)}")
    values = to_dict()
    if not isinstance(values, Mapping):
        raise bad_argument("config", f"to_dict() must return a mapping, got {type(values)}")
    return dict(values)


def _integer(value: object, path: str, *, positive: bool = False) -> int:
    """A config's integer: an int, or a float with an integral value (JSON writes some
    integers as 4096.0); InvalidArgumentError naming ``path`` otherwise."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        real = _real(value, path)
        if not (math.isfinite(real) and real.is_integer()):
            raise bad_argument(path, f"must be an integer, got {value!r}")
        number = int(real)
    else:
        raise bad_argument(path, f"must be an integer, got {type(value).__name__}")
    if positive and number <= 0:
        raise bad_argument(path, f"must be positive, got {number}")
    return number


def _real(value: object, path: str) -> float:
    """A config's real number; InvalidArgumentError naming ``path`` otherwise."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise bad_argument(path, f"must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise bad_argument(path, f"is too large for a float64, got {value!r}") from None


def _first(config: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def _head_dim(config: Mapping[str, Any]) -> int:
    # DeepSeek-V2/V3 (multi-head latent attention) rotate only qk_rope_head_dim columns of a
    # head; their config classes set head_dim to it.
    for name in ("qk_rope_head_dim", "head_dim"):
        if config.get(name):
            return _integer(config[name], f"config.{name}", positive=True)
    hidden, heads = _first(config, _HIDDEN), _first(config, _HEADS)
    if not hidden or not heads:
        raise bad_argument(
            "config", "needs head_dim, or hidden_size (n_embd) and num_attention_heads (n_head)"
        )
    hidden = _integer(hidden, "config.hidden_size", positive=True)
    return hidden // _integer(heads, "config.num_attention_heads", positive=True)


def _partial_factor(rotary_dim: int, head_dim: int) -> float:
    """A partial_rotary_factor f with int(head_dim * f) == rotary_dim, as the server computes
    it: rotary_dim / head_dim, nudged up when it rounds below (e.g. 32 / 96)."""
    if not 0 < rotary_dim <= head_dim:
        raise bad_argument(
            "config.rotary_dim", f"must be in 1..head_dim ({head_dim}), got {rotary_dim}"
        )
    factor = rotary_dim / head_dim
    # At most a few steps: the quotient is within a few units in the last place.
    while int(head_dim * factor) < rotary_dim:
        factor = math.nextafter(factor, math.inf)
    return factor


def _rope_parameters(config: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    # transformers 5 prefers rope_scaling (older configs) when both are given.
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise bad_argument("config.rope_parameters", "must be a JSON object")
    nested = [key for key, value in rope.items() if isinstance(value, Mapping)]
    if nested:  # per layer type (Gemma 3 style): {"full_attention": {...}, ...}
        if layer_type not in nested:
            raise bad_argument(
                "layer_type", f"the config has rope parameters per layer type: pass one of {nested}"
            )
        return dict(rope[layer_type])
    return dict(rope)


def table_from_config(
    config: object,
    *,
    layout: str | None = None,
    seq_len: int | None = None,
    layer_type: str | None = None,
    sections: bool = True,
) -> Table:
    """The kind and parameters of :meth:`posenc.Spec.from_config` (its docstring says what
    is read, and how), which builds the spec. ``sections=False`` reads a config with
    ``mrope_section`` as its plain rotary table (the rows of text positions, every axis
    equal), partial rotary included.

    Every config it cannot read is an InvalidArgumentError: the values are checked where
    they are read, and a failure of Python's own conversions on a value of a shape no check
    foresaw is reported as the config's too, never as a ValueError, TypeError, KeyError,
    OverflowError or ZeroDivisionError of this module's code.
    """
    try:
        return _spec_from_config(
            config, layout=layout, seq_len=seq_len, layer_type=layer_type, sections=sections
        )
    except InvalidArgumentError:
        raise
    except (ArithmeticError, LookupError, TypeError, ValueError) as error:
        raise bad_argument("config", f"cannot be read ({type(error).__name__}: {error})") from None


def _partial(
    values: Mapping[str, Any], rope: Mapping[str, Any], model_type: str, head_dim: int
) -> dict[str, Any]:
    """The partial rotary factor of a config, when it rotates part of the head (and the
    head_dim it is a part of, when that is not ``head_dim``)."""
    factor = _first(rope, ("partial_rotary_factor",))
    if factor is None:
        factor = _first(values, ("partial_rotary_factor", "rotary_pct"))
    if factor is None and values.get("rotary_dim"):
        rotary_dim = _integer(values["rotary_dim"], "config.rotary_dim")
        factor = _partial_factor(rotary_dim, head_dim)
    if factor is None and model_type == "gpt_neox":
        factor = _GPT_NEOX_ROTARY_PCT
    if factor is None or (factor := _real(factor, "config.partial_rotary_factor")) == 1.0:
        return {}
    own = values.get("head_dim")
    rotated = values.get("qk_rope_head_dim")
    if rotated and isinstance(own, int) and int(own * factor) == rotated:
        # DeepSeek-V4: qk_rope_head_dim is the rotated part of head_dim, which the partial
        # factor is of (DeepSeek-V2/V3 rotate all of qk_rope_head_dim).
        return {"partial_rotary_factor": factor, "head_dim": own}
    return {"partial_rotary_factor": factor}


def _spec_from_config(
    config: object,
    *,
    layout: str | None,
    seq_len: int | None,
    layer_type: str | None,
    sections: bool = True,
) -> Table:
    if seq_len is not None:
        seq_len = _integer(seq_len, "seq_len", positive=True)
    values = config_dict(config)
    model_type = str(values.get("model_type") or "")
    if model_type in SINUSOIDAL_FAMILIES:
        return _sinusoidal(model_type, values)
    head_dim = _head_dim(values)
    rope = _rope_parameters(values, layer_type)
    if layout is None:
        layout = "gptj" if model_type in ("gptj", "codegen") else "transformers"
    parameters: dict[str, Any] = {"head_dim": head_dim, "layout": layout}

    theta = _first(rope, ("rope_theta",)) or _first(values, ("rope_theta", "rotary_emb_base"))
    if theta is not None:
        parameters["rope_theta"] = _real(theta, "config.rope_theta")
    parameters.update(_partial(values, rope, model_type, head_dim))

    rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
    family = model_type.removesuffix("_text")
    if sections and (rope.get("mrope_section") is not None or family in MROPE_FAMILIES):
        return _mrope(family, rope, rope_type, parameters)
    if rope_type == "mrope":  # older configs' name of M-RoPE's default rope type
        rope_type = "default"
    if model_type == "phi3" and rope_type in _PHI3_LONGROPE:
        rope_type = "longrope"
    if rope_type != "default":
        parameters.update(_scaling(values, rope, rope_type, seq_len))
    return _table("rotary", **parameters)


def _mrope(
    family: str, rope: Mapping[str, Any], rope_type: str, parameters: dict[str, Any]
) -> Table:
    """M-RoPE (Qwen2-VL, Qwen2.5-VL; Qwen3-VL interleaved): rope parameters with
    ``mrope_section`` (older configs name the rope type ``"mrope"``, the default one), else
    the family's default sections, as its rotary module takes them."""
    sections, interleaved_default = MROPE_FAMILIES.get(family, ((), False))
    if rope_type not in ("default", "mrope"):
        raise bad_argument(
            "spec.mrope", f"rope type {rope_type!r} with mrope_section is not served"
        )
    if "partial_rotary_factor" in parameters:
        raise bad_argument("spec.mrope", "partial rotary with mrope_section is not served")
    interleaved = rope.get("mrope_interleaved")
    if interleaved is None:
        interleaved = interleaved_default
    given = rope.get("mrope_section") or sections
    if not isinstance(given, list | tuple):
        raise bad_argument(
            "config.mrope_section", f"must be a list of integers, got {type(given).__name__}"
        )
    return _table(
        "mrope",
        **parameters,
        mrope_section=[_integer(count, "config.mrope_section") for count in given],
        interleaved=bool(interleaved),
    )


def _scaling(
    config: Mapping[str, Any], rope: Mapping[str, Any], rope_type: str, seq_len: int | None
) -> dict[str, Any]:
    """The ``scaling`` choice and its message's fields, from the rope parameters."""
    scalings = cases(_SCALING)
    if rope_type not in scalings:
        raise bad_argument(
            f"spec.rotary.{_SCALING.name}",
            f"rope type {rope_type!r} is not served; posenc serves default, {', '.join(scalings)}",
        )
    message = message_of(scalings[rope_type])
    max_positions = _first(config, _MAX_POSITIONS)
    out: dict[str, Any] = {_SCALING.name: rope_type}
    for field in message.fields:
        name = field.name
        value = rope.get(name)
        if name == "original_max_position_embeddings":
            top = config.get(name) if rope_type in _TOP_LEVEL_ORIGINAL else None
            value = top if top is not None else value
            if value is None:
                value = max_positions
        elif name == "max_position_embeddings":
            value = max_positions
        elif name == "seq_len":
            value = None  # normalised below, once the other fields are known
        if value is not None:
            out[name] = _as_field(field, value)
    if seq_len is not None and "seq_len" in message.fields_by_name:
        normalised = _normalise_seq_len(rope_type, out, seq_len)
        if normalised is not None:
            out["seq_len"] = normalised
    return out


def _as_field(field: FieldDescriptor, value: Any) -> Any:
    """A config value as the field takes it: JSON writes some integers as floats (4096.0)."""
    if isinstance(value, list | tuple):
        return list(value)
    if field.cpp_type in INTEGER_RANGES and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _normalise_seq_len(rope_type: str, fields: Mapping[str, Any], seq_len: int) -> int | None:
    """The ``seq_len`` of the table transformers uses at ``seq_len``; ``None`` when it is
    the model's initial table."""
    if rope_type == "dynamic":
        limit = fields.get("max_position_embeddings")
        if limit is None:
            return seq_len
        return None if seq_len <= _integer(limit, "config.max_position_embeddings") else seq_len
    if rope_type == "longrope":
        name = "original_max_position_embeddings"
        if fields.get(name) is None:
            raise bad_argument(
                f"config.{name}",
                "longrope with seq_len needs it (or max_position_embeddings)",
            )
        original = _integer(fields[name], f"config.{name}")
        return original + 1 if seq_len > original else None
    return seq_len


def _table(kind: str, **parameters: Any) -> Table:
    return kind, parameters


def _sinusoidal(model_type: str, config: Mapping[str, Any]) -> Table:
    given = _first(config, _HIDDEN)
    if not given:
        raise bad_argument("config", f"a {model_type} config needs d_model")
    d_model = _integer(given, "config.d_model", positive=True)
    if model_type == "whisper":
        return _table("whisper", d_model=d_model)
    if model_type in ("m2m_100", "speech_to_text"):
        padding_idx = config.get("pad_token_id")
        return _table(
            "fairseq", d_model=d_model, padding_idx=1 if padding_idx is None else padding_idx
        )
    if model_type in ("marian", "pegasus"):
        return _table("sinusoidal", d_model=d_model, layout="split")
    # XLM: create_sinusoidal_embeddings, interleaved; only when the model uses it.
    if not config.get("sinusoidal_embeddings"):
        raise bad_argument(
            "config.sinusoidal_embeddings", "this XLM config learns its position embeddings"
        )
    return _table("sinusoidal", d_model=d_model)
