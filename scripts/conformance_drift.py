"""How far the models' own float32 tables drift from the exact ones, by position.

Usage: python scripts/conformance_drift.py          (prints the README's drift table)

Needs the conformance extra (torch, transformers). For each reference (a transformers
module or function, built from a config, no weights), the error is the largest
``|reference - exact|`` over every column of rows ``[p, p + 16)``, for ``p`` = 2^12, 2^16,
2^20 and 2^24; "exact" is posenc's float64 table, within 2**-50 of the true value (the
accuracy contract, tested against mpmath).

Rotary modules take any ``position_ids``, so they are called as they are. The sinusoidal
functions build whole tables of a given length (2^24 rows would take tens of GB), so their
rows at large positions come from a replay of the function's own arithmetic on the chosen
positions; ``tests/test_conformance.py`` checks that each replay is bit-identical to the
real function on every row of a 2^16-row table.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
import transformers

import posenc
from posenc_server import convert, engine
from posenc_server.config import ServerConfig
from posenc_server.errors import FieldViolation

POSITIONS = (2**12, 2**16, 2**20, 2**24)
WINDOW = 16
Array = npt.NDArray[Any]


def _load_configs() -> ModuleType:
    """tests/model_configs.py: the published models' settings, which the test suites build
    the same models from."""
    path = Path(__file__).resolve().parents[1] / "tests" / "model_configs.py"
    spec = importlib.util.spec_from_file_location("model_configs", path)
    assert spec is not None and spec.loader is not None, path
    configs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(configs)
    return configs


_CONFIGS = _load_configs()


def exact(spec: posenc.Spec) -> engine.Encoding:
    """posenc's float64 table of ``spec``, through the server's own conversion and checks."""
    violations: list[FieldViolation] = []
    table = convert.table_from_proto(spec.to_proto(), violations)
    assert table is not None, violations
    violations = table.validate(f"spec.{table.NAME}", ServerConfig())
    assert not violations, violations
    return engine.Encoding.prepare(table, "float64")


def exact_rows(spec: posenc.Spec, positions: Array) -> Array:
    """posenc's float64 rows of ``spec`` at ``positions``."""
    return engine.encode_positions(exact(spec), positions)


# -- references: the real modules, called as a model calls them -------------------------------


def rotary_module(module: torch.nn.Module, positions: Array) -> Array:
    """``[cos | sin]`` of a transformers rotary embedding (its float32 forward)."""
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, torch.as_tensor(positions, dtype=torch.int64)[None, :])
    return np.concatenate([cos[0].numpy(), sin[0].numpy()], axis=1)


class Published(NamedTuple):
    """A published model's rotary settings, as its released config holds them."""

    model: str  # transformers' {model}Config and {model}RotaryEmbedding
    name: str
    hidden_size: int
    attention_heads: int
    key_value_heads: int
    max_positions: int
    rope_parameters: dict[str, Any]


# Mistral 7B v0.2: default rope, theta 1e6.
MISTRAL_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 1000000.0}

# The drift table's published rotary models, by the name the conformance tests give them.
ROTARY_MODELS: dict[str, Published] = {
    "llama3": Published("Llama", "Llama 3.1 8B", 4096, 32, 8, 131072, _CONFIGS.LLAMA3_1_ROPE),
    "mistral": Published("Mistral", "Mistral 7B v0.2", 4096, 32, 8, 32768, MISTRAL_ROPE),
    "qwen2-yarn": Published(
        "Qwen2", "Qwen2.5 7B YaRN x4", 3584, 28, 4, 131072, _CONFIGS.QWEN2_5_YARN
    ),
}


def rotary_model(key: str) -> tuple[torch.nn.Module, posenc.Spec]:
    """transformers' rotary embedding of ``ROTARY_MODELS[key]`` and its table, both from one
    config."""
    published = ROTARY_MODELS[key]
    configuration = getattr(transformers, f"{published.model}Config")(
        hidden_size=published.hidden_size,
        num_attention_heads=published.attention_heads,
        num_key_value_heads=published.key_value_heads,
        max_position_embeddings=published.max_positions,
        rope_parameters=dict(published.rope_parameters),
    )
    name = configuration.model_type
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    module = getattr(modeling, f"{published.model}RotaryEmbedding")(configuration)
    return module, posenc.Spec.from_config(configuration.to_dict())


# Phi-3's real factors ship with its checkpoint; these have the same shape (48 each,
# growing with the dimension) and exercise the same code.
PHI3_SHORT = [1.0 + 0.05 * i / 47 for i in range(48)]
PHI3_LONG = [1.0 + 60.0 * (i / 47) ** 2 for i in range(48)]


def phi3_longrope_module() -> tuple[torch.nn.Module, Callable[[int], posenc.Spec]]:
    """Phi-3-mini-128k's shape of LongRoPE (head 96, 4096 -> 131072), synthetic factors."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(
        hidden_size=3072,
        num_attention_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": PHI3_SHORT,
            "long_factor": PHI3_LONG,
            "original_max_position_embeddings": 4096,
        },
    )
    spec = posenc.Spec.from_config(config.to_dict())

    def at(seq_len: int) -> posenc.Spec:
        # transformers switches to the long factors once max(position_ids) + 1 > 4096.
        return posenc.Spec("rotary", **{**spec.parameters, "seq_len": seq_len})

    return Phi3RotaryEmbedding(config), at


# -- references built from whole tables: replays of their arithmetic on chosen rows -----------


def whisper_replay(positions: Array, channels: int, max_timescale: float = 10000) -> Array:
    """``modeling_whisper.sinusoids``' arithmetic for the given rows."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.as_tensor(positions).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1).numpy()


def fairseq_replay(positions: Array, embedding_dim: int, padding_idx: int | None) -> Array:
    """``M2M100SinusoidalPositionalEmbedding.get_embedding``'s arithmetic for the given rows."""
    half_dim = embedding_dim // 2
    emb_scale = math.log(10000) / (half_dim - 1)
    emb = torch.exp(torch.arange(half_dim, dtype=torch.int64).float() * -emb_scale)
    rows = torch.as_tensor(positions, dtype=torch.int64)
    emb = rows.float().unsqueeze(1) * emb.unsqueeze(0)
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(len(rows), -1)
    if embedding_dim % 2 == 1:
        emb = torch.cat([emb, torch.zeros(len(rows), 1)], dim=1)
    if padding_idx is not None:
        emb[rows == padding_idx, :] = 0
    return emb.numpy()


def gptj_replay(positions: Array, dim: int) -> Array:
    """GPT-J's ``create_sinusoidal_positions`` for the given rows, as its attention applies
    it: ``[repeat_interleave(cos) | repeat_interleave(sin)]``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    rows = torch.as_tensor(positions, dtype=torch.int64).float()
    sinusoid_inp = torch.einsum("i , j -> i j", rows, inv_freq).float()
    sincos = torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)
    sin, cos = torch.split(sincos, dim // 2, dim=-1)
    doubled = [torch.repeat_interleave(t, 2, dim=-1) for t in (cos, sin)]
    return torch.cat(doubled, dim=-1).numpy()


def marian_replay(positions: Array, dim: int) -> Array:
    """``MarianSinusoidalPositionalEmbedding.create_weight``'s arithmetic (float64 numpy,
    stored as float32) for the given rows."""
    position_enc = np.array(
        [[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in positions]
    )
    out = torch.empty(len(positions), dim, dtype=torch.float32)
    sentinel = dim // 2 if dim % 2 == 0 else (dim // 2) + 1
    out[:, 0:sentinel] = torch.FloatTensor(np.sin(position_enc[:, 0::2]))
    out[:, sentinel:] = torch.FloatTensor(np.cos(position_enc[:, 1::2]))
    return out.numpy()


@dataclass(frozen=True)
class Reference:
    """One row of the drift table."""

    label: str
    table: str
    rows: Callable[[Array], Array]  # the reference's float32 rows at these positions
    exact: Callable[[Array], Array]  # posenc's float64 rows


def references() -> list[Reference]:
    """Every reference of the drift table."""
    out: list[Reference] = []
    for key, published in ROTARY_MODELS.items():
        module, spec = rotary_model(key)
        encoding = exact(spec)
        scaling = spec.parameters.get("scaling")
        out.append(
            Reference(
                f"`{published.model}RotaryEmbedding`, {published.name}",
                "`rotary`" + (f", scaling `{scaling}`" if scaling else ""),
                lambda p, m=module: rotary_module(m, p),  # type: ignore[misc]
                lambda p, e=encoding: engine.encode_positions(e, p),  # type: ignore[misc]
            )
        )
    phi3, phi3_spec = phi3_longrope_module()
    out.append(
        Reference(
            "`Phi3RotaryEmbedding`, Phi-3-mini-128k shape",
            "`rotary`, scaling `longrope`",
            lambda p: rotary_module(phi3, p),
            lambda p: exact_rows(phi3_spec(int(p.max()) + 1), p),
        )
    )
    gptj = exact(posenc.Spec("rotary", head_dim=64, layout="gptj"))
    whisper = exact(posenc.Spec("whisper", d_model=384))
    m2m = exact(posenc.Spec("fairseq", d_model=1024, padding_idx=1))
    marian = exact(posenc.Spec("sinusoidal", d_model=512, layout="split"))
    out += [
        Reference(
            "GPT-J `create_sinusoidal_positions`, rotary_dim 64",
            "`rotary`, layout `gptj`",
            lambda p: gptj_replay(p, 64),
            lambda p: engine.encode_positions(gptj, p),
        ),
        Reference(
            "Whisper `sinusoids`, d 384",
            "`whisper`",
            lambda p: whisper_replay(p, 384),
            lambda p: engine.encode_positions(whisper, p),
        ),
        Reference(
            "M2M100 / Speech2Text `get_embedding`, d 1024",
            "`fairseq`",
            lambda p: fairseq_replay(p, 1024, 1),
            lambda p: engine.encode_positions(m2m, p),
        ),
        Reference(
            "Marian / Pegasus `create_weight`, d 512",
            "`sinusoidal`, layout `split`",
            lambda p: marian_replay(p, 512),
            lambda p: engine.encode_positions(marian, p),
        ),
    ]
    return out


def drift(reference: Reference, position: int) -> float:
    """Largest ``|reference - exact|`` over rows ``[position, position + WINDOW)``."""
    rows = np.arange(position, position + WINDOW, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference.rows(rows).astype(np.float64)
    return float(np.abs(theirs - reference.exact(rows)).max())


def table() -> str:
    """The README's drift table, in markdown."""
    header = "| reference (float32) | posenc table | " + " | ".join(
        f"2^{int(math.log2(p))}" for p in POSITIONS
    )
    lines = [header + " |", "|---|---|" + "---:|" * len(POSITIONS)]
    for reference in references():
        cells = " | ".join(f"{drift(reference, p):.2g}" for p in POSITIONS)
        lines.append(f"| {reference.label} | {reference.table} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(table())
