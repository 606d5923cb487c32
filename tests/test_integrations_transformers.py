"""posenc.integrations.transformers.patch on tiny random-initialised models of every family.

No weights are downloaded: each model is built from a config with the family's published
head size and rope settings, shrunk in layers and hidden size only (``initializer_range``
large enough that attention depends on position), as the top-level class users load
(``...ForCausalLM``, ``...ForConditionalGeneration``), and patched whole. For each rotary
family:

- below position 2048, posenc-fed logits equal the model's own within float32 noise, and
  greedy ``generate`` gives the same tokens;
- at positions 2^20 and 2^24, posenc-fed float32 logits are closer to a float64 reference
  than the model's own float32 ones, by at least ``FACTOR``. The reference is the model in
  float64 fed float64 tables computed here from the config's rope parameters (numpy float64,
  exact integer positions) -- not ``model.double()``, whose rotary code casts to float32.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL take an image through their vision towers, whose rotary
tables patch() leaves alone. Sinusoidal families: the patched table equals the model's own
(small positions), logits match, and an input that outgrows the table grows it from posenc,
not from the model. torch.compile, deep copies and saving: at the end. The figures each test
prints (``-s``) are the coverage table's.

tests/test_integrations_transformers_oldest.py runs this file on the oldest supported
transformers.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from model_configs import (
    DEEPSEEK_V3_YARN,
    LLAMA3_1_ROPE,
    QWEN2_5_VL_VISION,
    QWEN2_5_YARN,
    QWEN2_VL_MROPE,
    QWEN2_VL_VISION,
    QWEN3_VL_MROPE,
    QWEN3_VL_VISION,
)

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
transformers = pytest.importorskip("transformers")
# Every test here builds transformers models: seconds each (make test-fast skips them).
pytestmark = pytest.mark.slow

import posenc  # noqa: E402
from posenc.integrations.transformers import (  # noqa: E402
    ModuleFrequenciesWarning,
    UntestedReleaseWarning,
    patch,
)

#: posenc-fed logits are at least this many times closer to the float64 reference than the
#: model's own float32 logits, at 2^20 and 2^24.
FACTOR = 1000.0
SEQ = 12
BATCH = 2


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # transformers warns about configs it accepts (YaRN's implicit factor, missing masks).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


# -- tiny models ----------------------------------------------------------------------------------

# Published head sizes and rope settings; layers, hidden size and heads shrunk. The head
# size is the config's head_dim where the family has one, else hidden_size / heads.
# _TINY_MHA: for the families whose every head has keys and values of its own; TINY: the
# grouped-query families, one key-value head.
_TINY_MHA = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "initializer_range": 0.3,
}
TINY = {**_TINY_MHA, "num_key_value_heads": 1}
# The smallest mixture of experts: two, one a token.
_TWO_EXPERTS = {"num_local_experts": 2, "num_experts_per_tok": 1}


def _llama3() -> Any:  # Llama 3.1 8B
    return transformers.LlamaConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(LLAMA3_1_ROPE),
    )


def _qwen2_yarn() -> Any:  # Qwen2.5 7B with its YaRN recipe
    return transformers.Qwen2Config(
        **TINY,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(QWEN2_5_YARN),
    )


def _phi3_longrope() -> Any:  # Phi-3 mini 128k: head 96; factors of its shape
    half = 48
    return transformers.Phi3Config(
        # At 0.3 this model's own float32 arithmetic is off by 2e-4 at 2^20 whatever its
        # table (fed the float64 one rounded to float32): too coarse to tell tables apart.
        **{**TINY, "hidden_size": 192, "initializer_range": 0.1},
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.01 * i for i in range(half)],
            "long_factor": [1.0 + 1.0 * i for i in range(half)],
        },
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def _dynamic() -> Any:
    return transformers.LlamaConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    )


def _linear() -> Any:
    return transformers.LlamaConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    )


def _mistral() -> Any:  # Mistral 7B v0.3
    return transformers.MistralConfig(
        **TINY, head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0
    )


def _mistral_small3() -> Any:  # Mistral Small 3 (24B 2501)
    return transformers.MistralConfig(
        **TINY, head_dim=128, max_position_embeddings=32768, rope_theta=100000000.0
    )


def _ministral() -> Any:  # Ministral 8B: sliding and full layers
    return transformers.MinistralConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 100000000.0},
        sliding_window=32768,
        layer_types=["sliding_attention", "full_attention"],
    )


def _mixtral() -> Any:  # Mixtral 8x7B
    return transformers.MixtralConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        **_TWO_EXPERTS,
    )


def _qwen3() -> Any:  # Qwen3 8B
    return transformers.Qwen3Config(
        **TINY,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def _qwen3_moe() -> Any:  # Qwen3 30B-A3B
    return transformers.Qwen3MoeConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
    )


def _phi4() -> Any:  # Phi-4 (14B): Phi-3's code, head 128
    return transformers.Phi3Config(
        **{**TINY, "hidden_size": 256},
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0},
        pad_token_id=0,
    )


def _gemma() -> Any:  # Gemma 7B
    return transformers.GemmaConfig(**TINY, head_dim=256, max_position_embeddings=8192)


def _gemma2() -> Any:  # Gemma 2 9B
    return transformers.Gemma2Config(
        **TINY, head_dim=256, max_position_embeddings=8192, sliding_window=4096
    )


_GEMMA3_TEXT: dict[str, Any] = {
    **TINY,
    "head_dim": 256,  # Gemma 3 4B
    "max_position_embeddings": 131072,
    "sliding_window": 1024,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
}


def _gemma3() -> Any:
    return transformers.Gemma3TextConfig(**_GEMMA3_TEXT)


_LLAMA4_TEXT: dict[str, Any] = {  # Llama 4 Scout: llama3 scaling, every other layer NoPE
    **TINY,
    "head_dim": 128,
    "intermediate_size_mlp": 96,
    **_TWO_EXPERTS,
    "interleave_moe_layer_step": 1,
    "no_rope_layers": [1, 0],
    "max_position_embeddings": 10485760,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
    },
}


def _llama4() -> Any:
    return transformers.Llama4TextConfig(**_LLAMA4_TEXT)


# The vision tower Gemma 3 and Llama 4 run with: one layer of two heads, 2 x 2 patches.
_TINY_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


def _gemma3_vl() -> Any:  # Gemma 3 4B as loaded: Gemma3ForConditionalGeneration
    return transformers.Gemma3Config(
        text_config=_GEMMA3_TEXT, vision_config=dict(_TINY_VISION), mm_tokens_per_image=4
    )


def _llama4_vl() -> Any:  # Llama 4 Scout as loaded: Llama4ForConditionalGeneration
    return transformers.Llama4Config(
        text_config=_LLAMA4_TEXT,
        vision_config={
            **_TINY_VISION,
            "vision_output_dim": 32,
            "projector_input_dim": 32,
            "projector_output_dim": 32,
        },
    )


def _gpt_oss() -> Any:  # gpt-oss 20B: YaRN, half-width tables
    return transformers.GptOssConfig(
        **TINY,
        head_dim=64,
        **_TWO_EXPERTS,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )


def _gpt_neox() -> Any:  # Pythia 160M: head 64, 16 rotary columns
    return transformers.GPTNeoXConfig(
        **{**_TINY_MHA, "hidden_size": 128}, max_position_embeddings=2048, rotary_pct=0.25
    )


def _gptj() -> Any:  # GPT-J 6B: head 256, rotary_dim 64
    return transformers.GPTJConfig(
        vocab_size=96,
        n_embd=512,
        n_layer=2,
        n_head=2,
        rotary_dim=64,
        n_positions=2048,
        initializer_range=0.3,
    )


def _deepseek(config: Any, mscale: float) -> Any:
    return config(
        **_TINY_MHA,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        first_k_dense_replace=2,  # dense MLPs: its MoE kernel has no float64 (the reference)
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_parameters={
            **DEEPSEEK_V3_YARN,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": mscale,
            "mscale_all_dim": mscale,
        },
    )


def _deepseek_v2() -> Any:
    return _deepseek(transformers.DeepseekV2Config, 0.707)


def _deepseek_v3() -> Any:
    return _deepseek(transformers.DeepseekV3Config, 1.0)


def _gemma4() -> Any:  # Gemma 4: proportional RoPE on 512-wide full-attention heads
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    return transformers.Gemma4TextConfig(
        **TINY,
        head_dim=256,
        global_head_dim=512,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,
    )


def _cohere() -> Any:  # Command R: GPT-J's interleaved pairs inside a Llama-style module
    return transformers.CohereConfig(
        **TINY,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 8000000.0},
    )


ROTARY: dict[str, Callable[[], Any]] = {
    "gemma4": _gemma4,
    "cohere": _cohere,
    "llama3": _llama3,
    "mistral": _mistral,
    "mistral-small-3": _mistral_small3,
    "ministral": _ministral,
    "mixtral": _mixtral,
    "qwen2-yarn": _qwen2_yarn,
    "qwen3": _qwen3,
    "qwen3-moe": _qwen3_moe,
    "phi3-longrope": _phi3_longrope,
    "phi4": _phi4,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3-vl": _gemma3_vl,
    "llama4": _llama4,
    "gpt-oss": _gpt_oss,
    "gpt-neox": _gpt_neox,
    "gptj": _gptj,
    "deepseek-v2": _deepseek_v2,
    "deepseek-v3": _deepseek_v3,
    "llama-dynamic": _dynamic,
    "llama-linear": _linear,
}


def build(config: Any) -> Any:
    """The top-level causal LM of ``config`` (what users load), eager kernels."""
    torch.manual_seed(0)
    # Image-text models: their ...ForConditionalGeneration, as loaded.
    auto = (
        transformers.AutoModelForImageTextToText
        if hasattr(config, "vision_config")
        else transformers.AutoModelForCausalLM
    )
    # Eager kernels: the grouped MoE matmul has no float64 (the reference runs in float64).
    model = auto.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return model.eval()


# -- feeding a model rows of our choosing ---------------------------------------------------------


def _is_rotary(module: Any) -> bool:
    return hasattr(module, "rope_type") and hasattr(module, "config") and not _vision(module)


def _vision(module: Any) -> bool:
    rope_type = module.rope_type
    kinds = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
    return "axial" in kinds or "Vision" in type(module).__name__


def _rotary_forward(
    rows: Callable[[Any, str | None], tuple[Any, Any]], complex_rows: bool, half: bool, pairs: bool
) -> Callable[..., Any]:
    """A rotary module's forward that returns ``rows``' (cos, sin) in the module's own form:
    complex, half width, GPT-J's pairs, or else the halves duplicated."""

    def forward(x: Any, position_ids: Any, layer_type: str | None = None) -> Any:
        cos, sin = rows(position_ids, layer_type)
        if complex_rows:
            return torch.complex(torch.from_numpy(cos), torch.from_numpy(sin))
        if pairs:
            cos, sin = np.repeat(cos, 2, -1), np.repeat(sin, 2, -1)
        elif not half:
            cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
        return torch.from_numpy(cos).to(x.dtype), torch.from_numpy(sin).to(x.dtype)

    return forward


def feed(model: Any, rows: Callable[[Any, str | None], tuple[Any, Any]]) -> None:
    """Makes ``model`` take (cos, sin) of position_ids from ``rows(position_ids,
    layer_type)`` (float64 numpy halves), through its rotary modules (in the form each
    returns: complex, half or full width, GPT-J's (sin, cos)) or GPT-J's attention."""
    for module in model.modules():
        if _is_rotary(module):
            layer_types = list(module.rope_type) if isinstance(module.rope_type, dict) else [None]
            kwargs = {} if layer_types[0] is None else {"layer_type": layer_types[0]}
            probe = type(module).forward(module, torch.zeros(1), torch.arange(2)[None], **kwargs)
            complex_rows = isinstance(probe, torch.Tensor) and probe.is_complex()
            width = rows(torch.arange(1)[None], layer_types[0])[0].shape[-1]
            half = not complex_rows and probe[0].shape[-1] == width  # GPT-OSS
            # Cohere: GPT-J's pairs (cos_0, cos_0, cos_1, ...), not duplicated halves.
            pairs = not complex_rows and torch.equal(probe[0][0, 1, 0::2], probe[0][0, 1, 1::2])

            module.forward = _rotary_forward(rows, complex_rows, half, pairs)
        elif hasattr(module, "embed_positions") and hasattr(module, "rotary_dim"):
            native = type(module).forward

            def attention(*args: Any, _m: Any = module, _n: Any = native, **kwargs: Any) -> Any:
                ids = kwargs["position_ids"]
                cos, sin = rows(ids, None)
                sincos = torch.from_numpy(np.concatenate([sin, cos], -1))
                kwargs["position_ids"] = torch.arange(ids.shape[1]).expand(ids.shape)
                _m._get_embed_positions = lambda _ids: sincos
                return _n(_m, *args, **kwargs)

            module.forward = attention
        elif hasattr(module, "embed_positions") and hasattr(module, "pos_embd_dim"):
            # GPTJRotaryEmbedding (transformers 5.24): (sin, cos), half width each.
            def gptj_rotary(x: Any, position_ids: Any) -> Any:
                cos, sin = rows(position_ids, None)
                return torch.from_numpy(sin).to(x.dtype), torch.from_numpy(cos).to(x.dtype)

            module.forward = gptj_rotary


def rope_frequencies(
    config: Any, seq_len: int, layer_type: str | None = None
) -> tuple[np.ndarray, float]:
    """inv_freq and attention factor of transformers' modeling_rope_utils for ``config``,
    in float64 (the same formulas, evaluated without float32)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        rope = dict(rope[layer_type])
    kind = rope.get("rope_type", "default")
    if layer_type is not None and getattr(config, "per_layer_config", None) is not None:
        with contextlib.suppress(Exception):  # Gemma 4's per-layer head sizes
            config = config.per_layer_config[layer_type]
    if kind == "proportional":
        head_dim = config.head_dim
        rotated = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        exponents = np.arange(0, 2 * rotated, 2, dtype=np.float64) / head_dim
        inv = 1.0 / float(rope["rope_theta"]) ** exponents
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - rotated)])
        return inv / rope.get("factor", 1.0), 1.0
    if config.model_type == "gptj":
        theta = 10000.0
        dim = config.rotary_dim
    else:
        head_dim = (
            getattr(config, "qk_rope_head_dim", None)
            or getattr(config, "head_dim", None)
            or (config.hidden_size // config.num_attention_heads)
        )
        theta = float(rope["rope_theta"])
        factor_p = rope.get("partial_rotary_factor", 1.0)
        dim = int(head_dim * factor_p) if config.model_type in ("gpt_neox", "phi3") else head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    if kind == "dynamic":
        mpe, f = config.max_position_embeddings, rope["factor"]
        length = max(seq_len, mpe)
        theta *= (f * length / mpe - (f - 1)) ** (dim / (dim - 2))
    inv = 1.0 / theta**exponents
    attention = 1.0
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":
        f, old = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / f, inv)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        if high > low:  # Llama 4 Scout's are equal: no band between
            smooth = (old / wavelen - low) / (high - low)
            inv = np.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled)
        else:
            inv = scaled
    elif kind == "yarn":
        f, original = rope["factor"], rope["original_max_position_embeddings"]

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention = mscale(f, rope["mscale"]) / mscale(f, rope["mscale_all_dim"])
        else:
            attention = mscale(f)

        def correction(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction(rope.get("beta_fast") or 32), correction(rope.get("beta_slow") or 1)
        if rope.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        ramp = np.clip((np.arange(dim // 2) - lo) / ((hi - lo) or 0.001), 0, 1)
        extrapolation = 1 - ramp
        inv = inv / f * (1 - extrapolation) + inv * extrapolation
    elif kind == "longrope":
        original = config.original_max_position_embeddings
        f = config.max_position_embeddings / original
        attention = math.sqrt(1 + math.log(f) / math.log(original)) if f > 1 else 1.0
        factors = rope["long_factor"] if seq_len > original else rope["short_factor"]
        inv = 1.0 / (np.asarray(factors, dtype=np.float64) * theta**exponents)
    return inv, attention


def reference_rows(config: Any, seq_len: int) -> Callable[[Any, str | None], tuple[Any, Any]]:
    def rows(position_ids: Any, layer_type: str | None) -> tuple[Any, Any]:
        inv, attention = rope_frequencies(config, seq_len, layer_type)
        angles = position_ids.numpy().astype(np.float64)[..., None] * inv
        return np.cos(angles) * attention, np.sin(angles) * attention

    return rows


def gptj_native_rows(config: Any) -> Callable[[Any, str | None], tuple[Any, Any]]:
    """GPT-J's own create_sinusoidal_positions (float32), at any positions."""
    dim = config.rotary_dim

    def rows(position_ids: Any, _layer_type: str | None) -> tuple[Any, Any]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
        angles = torch.einsum("bi,j->bij", position_ids.float(), inv_freq).float()
        return angles.cos().double().numpy(), angles.sin().double().numpy()

    return rows


def tokens() -> Any:
    return torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def logits_at(model: Any, start: int) -> Any:
    ids = tokens()
    positions = torch.arange(start, start + SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        return model(ids, position_ids=positions).logits.double()


# -- rotary families ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", list(ROTARY))
def test_small_positions_match_the_model(family: str, client: posenc.Client) -> None:
    model = build(ROTARY[family]())
    native = [logits_at(model, start) for start in (0, 1000, 2000)]
    ids = tokens()
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    with patch(model, client) as handle:
        assert handle.specs
        ours = [logits_at(model, start) for start in (0, 1000, 2000)]
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    for start, theirs, mine in zip((0, 1000, 2000), native, ours, strict=True):
        scale = float(theirs.abs().max())
        difference = float((mine - theirs).abs().max())
        print(
            f"{family} @{start}: max |logit difference| {difference:.3g} (max |logit| {scale:.3g})"
        )
        # float32 noise: the model's own table is off by ~|p| * 2^-24 at position p.
        assert difference <= 2e-3 * scale
    assert torch.equal(generated, expected)
    # Undone: the model computes its own tables again.
    assert torch.equal(logits_at(model, 1000), native[1])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(ROTARY))
@pytest.mark.parametrize("start", [2**20, 2**24])
def test_large_positions_are_closer_to_float64(
    family: str, start: int, client: posenc.Client, record_property: Any
) -> None:
    config = ROTARY[family]()
    model = build(config)
    reference = copy.deepcopy(model).double()
    feed(reference, reference_rows(model.config, start + SEQ))
    expected = logits_at(reference, start)
    if family == "gptj":  # its buffer stops at n_positions: its formula, at these positions
        native_model = copy.deepcopy(model)
        feed(native_model, gptj_native_rows(model.config))
        native = logits_at(native_model, start)
    else:
        native = logits_at(model, start)
    with patch(model, client):
        ours = logits_at(model, start)
    native_error = float((native - expected).abs().max())
    our_error = float((ours - expected).abs().max())
    record_property("errors", (family, start, native_error, our_error))
    print(f"{family} @2^{int(math.log2(start))}: native {native_error:.3g}, posenc {our_error:.3g}")
    assert our_error * FACTOR <= native_error, (native_error, our_error)


def test_patch_reads_the_family_spec_and_undoes(client: posenc.Client) -> None:
    model = build(_gptj())
    # GPT-J's table: its attention's buffer before transformers 5.24, a rotary module since.
    owners = {
        name: module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "embed_positions", None), torch.Tensor)
    }
    with patch(model, client) as handle:
        assert handle.specs.keys() == owners.keys()
        for name, module in owners.items():
            spec = handle.specs[name]
            assert spec.parameters["layout"] == "vllm"
            assert spec.parameters["partial_rotary_factor"] * 256 == 64
            assert "forward" in module.__dict__
    assert not any("forward" in module.__dict__ for module in owners.values())
    assert "Patch" in repr(handle)


def test_longrope_holds_two_tables(client: posenc.Client) -> None:
    model = build(_phi3_longrope())
    with patch(model, client) as handle:
        logits_at(model, 0)
        logits_at(model, 100)  # short
        logits_at(model, 5000)  # long: seq_len > 1024
        logits_at(model, 6000)
        logits_at(model, 7000)
        seq_lens = sorted(str(table.table.parameters.get("seq_len")) for table in handle.tables)
        assert seq_lens == ["4097", "None"]


def test_dynamic_follows_transformers_seq_len_rule(client: posenc.Client) -> None:
    model = build(_dynamic())
    before = logits_at(model, 3000)  # grows transformers' state to seq_len 3012
    after = logits_at(model, 10)  # resets it
    with patch(model, client):
        assert float((logits_at(model, 3000) - before).abs().max()) <= 2e-3 * float(
            before.abs().max()
        )
        assert float((logits_at(model, 10) - after).abs().max()) <= 1e-4 * float(after.abs().max())


class _CallerCalls(grpc.UnaryUnaryClientInterceptor):
    """Counts the unary calls made on threads other than the client's read-ahead thread."""

    def __init__(self) -> None:
        self.count = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.count += threading.current_thread().name != "posenc-read-ahead"
        return continuation(details, request)


def test_a_dynamic_decode_loop_fetches_each_next_table_ahead(server: Any) -> None:
    """Past ``max_position_embeddings`` a dynamic-NTK table changes with every token: the
    patched module prefetches the next step's rows while the model runs, so the steps
    after the first make no call of their own; every step's (cos, sin) are those of
    transformers' own seq_len rule."""
    model = build(_dynamic())
    native = copy.deepcopy(model.model.rotary_emb)
    module = model.model.rotary_emb
    x = torch.zeros(1)
    calls = _CallerCalls()
    with posenc.Client(server.target, interceptors=[calls]) as client, patch(model, client):
        calls.count = 0  # the patch's own check
        for step in range(16):
            ids = torch.tensor([[5_000 + step], [3_000 + step]])
            cos, sin = module(x, ids)
            want_cos, want_sin = native(x, ids)
            # transformers' float32 angles at 5,000 are off by up to ~5e-4.
            torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-3)
            torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-3)
            time.sleep(0.005)  # the model's forward pass
    # Without prefetching, every step calls (16). A prefetch that fails leaves its step to
    # make its own call, by design; a full suite on a busy 2-core machine once saw one such
    # step, so one is tolerated: the test measures the design, not the machine's load.
    assert calls.count <= 2


def test_a_misread_config_is_refused(client: posenc.Client) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    class Custom(LlamaRotaryEmbedding):  # model code computing other frequencies than its config
        def forward(self, x: Any, position_ids: Any) -> Any:
            return super().forward(x, position_ids * 2)

    model = build(_llama3())
    model.model.rotary_emb = Custom(model.config)
    with pytest.raises(ValueError, match="differs from the model's own"):
        patch(model, client)
    assert "forward" not in model.model.rotary_emb.__dict__


def test_bfloat16_model_gets_bfloat16_tables(client: posenc.Client) -> None:
    model = build(_llama3()).to(torch.bfloat16)
    with patch(model, client) as handle:
        logits = logits_at(model, 100)
        assert torch.isfinite(logits).all()
        assert {table.dtype.name for table in handle.tables} == {"bfloat16"}


# -- sinusoidal families --------------------------------------------------------------------------


# One tiny encoder-decoder shape for every sinusoidal family (random weights, wide init so
# attention depends on position); each family adds only what its config calls otherwise.
_TINY_SEQ2SEQ: dict[str, Any] = {
    "vocab_size": 96,
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "init_std": 0.3,
}


def _m2m100() -> Any:
    return transformers.M2M100Config(**_TINY_SEQ2SEQ, max_position_embeddings=64)


def _marian() -> Any:
    return transformers.MarianConfig(
        **_TINY_SEQ2SEQ, max_position_embeddings=64, decoder_start_token_id=0, pad_token_id=0
    )


def _pegasus() -> Any:
    return transformers.PegasusConfig(**_TINY_SEQ2SEQ, max_position_embeddings=64)


def _speech2text() -> Any:
    return transformers.Speech2TextConfig(
        **_TINY_SEQ2SEQ, max_source_positions=64, max_target_positions=64
    )


SEQ2SEQ = {"m2m100": _m2m100, "marian": _marian, "pegasus": _pegasus}


def assert_same_logits(family: str, ours: Any, native: Any) -> None:
    """Patched and native outputs of a sinusoidal model: equal within float32 noise (the
    tables differ by float32 rounding at these positions)."""
    difference, scale = float((ours - native).abs().max()), float(native.abs().max())
    print(f"{family}: max |output difference| {difference:.3g} (max |output| {scale:.3g})")
    assert difference <= 1e-4 * scale


def native_and_patched(
    model: Any,
    client: posenc.Client,
    forward: Callable[[], Any],
    check: Callable[[Any], object],
    **options: Any,
) -> tuple[Any, Any]:
    """``forward()``'s output from the native model, then from the model patched by
    ``patch(model, client, **options)``; ``check(handle)`` runs on the patch after that
    forward."""
    with torch.no_grad():
        native = forward()
        with patch(model, client, **options) as handle:
            ours = forward()
            check(handle)
    return native, ours


def assert_same_audio_logits(
    family: str,
    model: Any,
    client: posenc.Client,
    inputs: tuple[Any, Any],
    check: Callable[[Any], object],
) -> None:
    """An encoder-decoder audio model's logits for ``inputs`` (input features, decoder ids):
    patched as native, within float32 noise; ``check(handle)`` on the patch."""
    features, decoder = inputs
    native, ours = native_and_patched(
        model,
        client,
        lambda: model(input_features=features, decoder_input_ids=decoder).logits,
        check,
    )
    assert_same_logits(family, ours, native)


def seq2seq_logits(model: Any, source: int, target: int) -> Any:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 96, (BATCH, source), generator=generator)
    decoder = torch.randint(3, 96, (BATCH, target), generator=generator)
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=decoder).logits.double()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SEQ2SEQ))
def test_seq2seq_tables_match_and_grow_from_posenc(family: str, client: posenc.Client) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(SEQ2SEQ[family]()).eval()
    native = seq2seq_logits(model, 20, 10)
    with patch(model, client, min_rows=128) as handle:
        assert {spec.kind for spec in handle.specs.values()} == {
            "fairseq" if family == "m2m100" else "sinusoidal"
        }
        ours = seq2seq_logits(model, 20, 10)
        assert_same_logits(family, ours, native)
        # An input longer than the model's table (64 positions, 128 rows here) grows it.
        long = seq2seq_logits(model, 300, 10)
        assert torch.isfinite(long).all()
        (table,) = handle.tables
        assert len(table) >= 300
        expected = client.get_range(0, len(table), table.table)
        np.testing.assert_array_equal(table.rows(), expected)


def test_a_patched_seq2seq_model_deep_copies(client: posenc.Client, tmp_path: Any) -> None:
    """A deep copy's tables grow on the copy (its methods are bound to it), from posenc."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(_m2m100()).eval()
    encoder = model.model.encoder.embed_positions
    with patch(model, client, min_rows=128):
        rows = len(encoder.weights)
        twin = copy.deepcopy(model)
        long = seq2seq_logits(twin, 300, 10)
        assert len(twin.model.encoder.embed_positions.weights) >= 300
        assert len(encoder.weights) == rows  # the original did not grow
        torch.testing.assert_close(seq2seq_logits(model, 300, 10), long, rtol=0, atol=0)
        with pytest.raises(TypeError, match=r"state_dict\(\)"):
            torch.save(twin, tmp_path / "model.pt")


@pytest.mark.slow
def test_speech2text_encoder_and_decoder(client: posenc.Client) -> None:
    torch.manual_seed(0)
    model = transformers.Speech2TextForConditionalGeneration(_speech2text()).eval()
    features = torch.randn(1, 40, model.config.input_feat_per_channel * 1)
    decoder = torch.randint(3, 96, (1, 6))

    def check(handle: Any) -> None:
        assert {spec.kind for spec in handle.specs.values()} == {"fairseq"}

    assert_same_audio_logits("speech2text", model, client, (features, decoder), check)


@pytest.mark.slow
def test_whisper_encoder_table_is_posenc(client: posenc.Client) -> None:
    config = transformers.WhisperConfig(
        **_TINY_SEQ2SEQ,
        num_mel_bins=8,
        max_source_positions=50,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    features = torch.randn(1, 8, 100)
    decoder = torch.tensor([[1, 2, 3]])

    def check(handle: Any) -> None:
        (spec,) = handle.specs.values()
        assert spec == posenc.Spec("whisper", d_model=32)
        weight = model.model.encoder.embed_positions.weight
        np.testing.assert_array_equal(weight.numpy(), client.get_range(0, 50, spec))

    assert_same_audio_logits("whisper", model, client, (features, decoder), check)


@pytest.mark.slow
def test_xlm_sinusoidal_grows(client: posenc.Client) -> None:
    config = transformers.XLMConfig(
        vocab_size=96,
        emb_dim=32,
        n_layers=1,
        n_heads=2,
        max_position_embeddings=64,
        sinusoidal_embeddings=True,
        causal=False,
    )
    torch.manual_seed(0)
    model = transformers.XLMModel(config).eval()
    ids = torch.randint(3, 96, (1, 40))

    def check(handle: Any) -> None:
        (spec,) = handle.specs.values()
        assert spec == posenc.Spec("sinusoidal", d_model=32)
        longer = model(torch.randint(3, 96, (1, 200))).last_hidden_state
        assert longer.shape == (1, 200, 32)

    native, ours = native_and_patched(
        model, client, lambda: model(ids).last_hidden_state, check, min_rows=64
    )
    assert_same_logits("xlm", ours, native)


# -- whole multimodal models, images through the vision tower -------------------------------------

_VL_TEXT: dict[str, Any] = {**TINY, "max_position_embeddings": 128000}
_VL_TOKENS = {
    "image_token_id": 90,
    "video_token_id": 91,
    "vision_start_token_id": 92,
    "vision_end_token_id": 93,
}


def _qwen_vl(model: str, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """transformers' ``{model}ForConditionalGeneration`` of a ``{model}Config``: the tiny
    text model with ``text``'s settings, the vision tower ``vision``."""
    config = getattr(transformers, f"{model}Config")(
        text_config={**_VL_TEXT, **text}, vision_config=dict(vision), **_VL_TOKENS
    )
    return getattr(transformers, f"{model}ForConditionalGeneration")(config)


def _qwen2_vl() -> Any:  # Qwen2-VL 7B: head 128, sections 16 / 24 / 24
    text = {"hidden_size": 256, "rope_parameters": dict(QWEN2_VL_MROPE)}
    return _qwen_vl("Qwen2VL", text, QWEN2_VL_VISION)


def _qwen2_5_vl() -> Any:  # Qwen2.5-VL 7B
    text = {"hidden_size": 256, "rope_parameters": dict(QWEN2_VL_MROPE)}
    return _qwen_vl("Qwen2_5_VL", text, QWEN2_5_VL_VISION)


def _qwen3_vl() -> Any:  # Qwen3-VL 8B: head 128, interleaved 24 / 20 / 20
    text = {"head_dim": 128, "rope_parameters": dict(QWEN3_VL_MROPE)}
    return _qwen_vl("Qwen3VL", text, {**QWEN3_VL_VISION, "out_hidden_size": 64})


VISION_LANGUAGE = {"qwen2-vl": _qwen2_vl, "qwen2.5-vl": _qwen2_5_vl, "qwen3-vl": _qwen3_vl}


def image_inputs(model: Any) -> dict[str, Any]:
    """A prompt with one 4 x 6-patch image between text tokens, as a processor makes it."""
    vision = model.config.vision_config
    grid = torch.tensor([[1, 4, 6]])
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(int(grid.prod()), width, generator=torch.Generator().manual_seed(3))
    merged = int(grid.prod()) // vision.spatial_merge_size**2
    ids = torch.tensor([[5, 6, 7, 92] + [90] * merged + [93, 8, 9, 10]])
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "mm_token_type_ids": (ids == 90).int(),
    }


@pytest.mark.parametrize("family", list(VISION_LANGUAGE))
def test_whole_vision_language_model_with_an_image(family: str, client: posenc.Client) -> None:
    """patch() on the model users load: the text M-RoPE table is posenc's, the vision
    tower's rotary table is left alone (and said so); an image prompt's logits and greedy
    tokens are the native ones."""
    torch.manual_seed(0)
    model = VISION_LANGUAGE[family]().eval()
    inputs = image_inputs(model)
    with torch.no_grad():
        native = model(**inputs).logits.double()
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        with patch(model, client) as handle:
            assert {spec.kind for spec in handle.specs.values()} == {"mrope"}
            assert handle.specs.keys() == {"model.language_model.rotary_emb"}
            assert "axial" in handle.skipped["model.visual.rotary_pos_emb"]
            ours = model(**inputs).logits.double()
            generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    difference = float((ours - native).abs().max())
    print(f"{family}: max |logit difference| {difference:.3g} ({float(native.abs().max()):.3g})")
    assert difference <= 1e-4 * float(native.abs().max())
    assert torch.equal(generated, expected)


def test_patch_names_what_it_leaves_alone(
    client: posenc.Client, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = _qwen3_vl().eval()
    with (
        caplog.at_level(logging.INFO, logger="posenc.integrations.transformers"),
        patch(model, client) as handle,
    ):
        assert set(handle.skipped) == {"model.visual.rotary_pos_emb", "model.visual.pos_embed"}
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("posenc")]
    assert "model.language_model.rotary_emb (mrope)" in line
    assert "model.visual.rotary_pos_emb" in line and "model.visual.pos_embed" in line


# -- releases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["5.16.1", "5.26.0", "6.0.0"])
def test_an_untested_release_is_verified_not_refused(
    version: str, client: posenc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build(_llama3())
    # The module transformers' lazy import left in sys.modules, where its version is read.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    window = r"\(>=5\.17,<5\.26\)"
    with pytest.warns(
        UntestedReleaseWarning, match=rf"transformers {version} is outside.*{window}"
    ):
        patch(model, client).undo()
    # verify=False outside the window verifies anyway, and says so.
    with pytest.warns(UntestedReleaseWarning, match="verify=False is overridden"):
        patch(model, client, verify=False).undo()
    assert "forward" not in model.model.rotary_emb.__dict__


def test_an_untested_release_refuses_a_table_that_differs_in_one_line(
    client: posenc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    class Custom(LlamaRotaryEmbedding):  # a release whose rotary code changed
        def forward(self, x: Any, position_ids: Any) -> Any:
            return super().forward(x, position_ids * 2)

    model = build(_llama3())
    model.model.rotary_emb = Custom(model.config)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.0")
    with pytest.warns(UntestedReleaseWarning), pytest.raises(ValueError) as refused:
        patch(model, client, verify=False)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("model.rotary_emb (Custom, rope type 'llama3'): ")
    assert "differs from the model's own at row 1, cos column 0: 0.540302 against -0.416147" in (
        message
    )
    assert "forward" not in model.model.rotary_emb.__dict__


def test_the_installed_release_is_a_tested_one(client: posenc.Client) -> None:
    # tests/test_integrations_transformers_oldest.py runs this file on the oldest release.
    expected = os.environ.get("POSENC_EXPECT_TRANSFORMERS")
    assert expected in (None, transformers.__version__)
    model = build(_llama3())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntestedReleaseWarning)
        patch(model, client).undo()


# -- torch.compile, deep copies, saving -----------------------------------------------------------


def test_a_compiled_patched_model_equals_eager(client: posenc.Client) -> None:
    """torch.compile (the default backend, fullgraph=False) of a patched model runs, and its
    logits equal eager ones, near 0 and at 2^20."""
    model = build(_qwen3())
    ids = tokens()
    positions = [torch.arange(s, s + SEQ).expand(BATCH, SEQ) for s in (0, 2**20)]
    with torch.no_grad(), patch(model, client):
        eager = [model(ids, position_ids=p).logits.double() for p in positions]
        torch._dynamo.reset()
        compiled = torch.compile(model)
        ours = [compiled(ids, position_ids=p).logits.double() for p in positions]
    for theirs, mine in zip(eager, ours, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * float(theirs.abs().max()))


def test_a_compiled_patched_model_trains(client: posenc.Client) -> None:
    """Backward through a compiled patched model: the rows carry no gradient, as the
    model's own tables do not."""
    model = build(_qwen3()).train()
    ids = tokens()
    with patch(model, client):
        torch._dynamo.reset()
        loss = torch.compile(model)(ids, labels=ids).loss
        loss.backward()
    assert torch.isfinite(loss)
    assert float(model.model.embed_tokens.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama4", "gptj", "llama-dynamic"])
def test_a_patched_model_traces_without_a_graph_break(family: str, client: posenc.Client) -> None:
    """The rows are one custom op to dynamo: a prompt and a one-token decode step trace
    whole (Gemma 3: a table per layer type; Llama 4: complex frequencies; dynamic NTK: a
    table per seq_len; GPT-J: its rotary module from transformers 5.24, its attention, a
    graph break, before)."""
    model = build(ROTARY[family]())
    far = 2**20
    steps = [
        (tokens(), torch.arange(far, far + SEQ).expand(BATCH, SEQ)),
        (tokens()[:, :1], torch.tensor([[far + SEQ], [far + 2 * SEQ]])),
    ]
    gptj_attention = family == "gptj" and any(
        hasattr(module, "_get_embed_positions") for module in model.modules()
    )
    with torch.no_grad(), patch(model, client):
        for ids, positions in steps:
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(ids, position_ids=positions)
            if gptj_attention:
                assert explained.graph_break_count >= 1
                assert all("disable" in str(r.reason) for r in explained.break_reasons)
            else:
                assert explained.graph_break_count == 0, explained.break_reasons


def test_a_patched_model_deep_copies_and_saves_its_state_dict(
    client: posenc.Client, tmp_path: Any
) -> None:
    model = build(_gemma3())
    native_keys = set(model.state_dict())
    with patch(model, client) as handle:
        far = logits_at(model, 2**24)
        twin = copy.deepcopy(model)
        # The copy is patched too (its own module, the same client): the same exact logits.
        torch.testing.assert_close(logits_at(twin, 2**24), far, rtol=0, atol=0)
        assert twin.model.rotary_emb.forward.__self__ is twin.model.rotary_emb
        assert set(model.state_dict()) == native_keys
        torch.save(model.state_dict(), tmp_path / "weights.pt")
        with pytest.raises(TypeError, match=r"state_dict\(\).*undo\(\)"):
            torch.save(model, tmp_path / "model.pt")
        assert handle.specs
    # Undone: the model pickles again.
    torch.save(model, tmp_path / "model.pt")
    assert not (set(torch.load(tmp_path / "weights.pt")) ^ native_keys)


def image_positions(start: int) -> Any:
    """(t, h, w) position ids [3, 1, 14] of image_inputs' prompt, as Qwen2-VL's rule lays
    them out (text 0-3, the 2 x 3 merged image at 4 + (0, row, column), text from 7), from
    ``start``."""
    text = [(p, p, p) for p in range(4)]
    image = [(4, 4 + row, 4 + column) for row in range(2) for column in range(3)]
    after = [(p, p, p) for p in range(7, 11)]
    return torch.tensor(text + image + after).T[:, None, :] + start


def mrope_reference_rows(config: Any) -> Callable[[Any, str | None], tuple[Any, Any]]:
    """M-RoPE's merged (cos, sin) halves in float64: each column's angle from its axis (t,
    h, w by sections; Qwen3-VL interleaves h and w)."""
    text = config.get_text_config()
    rope = text.rope_parameters
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    inv = 1.0 / float(rope["rope_theta"]) ** (np.arange(0, head_dim, 2) / head_dim)
    sections = list(rope["mrope_section"])
    if rope.get("mrope_interleaved"):
        axis = np.zeros(head_dim // 2, dtype=int)
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset : sections[dim] * 3 : 3] = dim
    else:
        axis = np.repeat([0, 1, 2], sections)

    def rows(position_ids: Any, _layer_type: str | None) -> tuple[Any, Any]:
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        angles = position_ids.numpy().astype(np.float64)[..., None] * inv  # [3, b, s, half]
        merged = np.moveaxis(angles[axis, ..., np.arange(len(axis))], 0, -1)
        return np.cos(merged), np.sin(merged)

    return rows


def feed_mrope(model: Any, rows: Callable[[Any, str | None], tuple[Any, Any]]) -> None:
    for module in model.modules():
        if _is_rotary(module):

            def forward(x: Any, position_ids: Any) -> Any:
                cos, sin = rows(position_ids, None)
                cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
                return torch.from_numpy(cos).to(x.dtype), torch.from_numpy(sin).to(x.dtype)

            module.forward = forward


@pytest.mark.parametrize("family", list(VISION_LANGUAGE))
@pytest.mark.parametrize("start", [2**20, 2**24])
def test_vision_language_far_positions_are_closer_to_float64(
    family: str, start: int, client: posenc.Client
) -> None:
    torch.manual_seed(0)
    model = VISION_LANGUAGE[family]().eval()
    inputs = {**image_inputs(model), "position_ids": image_positions(start)}
    reference = copy.deepcopy(model).double()
    feed_mrope(reference, mrope_reference_rows(model.config))
    with torch.no_grad():
        expected = reference(**inputs).logits.double()
        native = model(**inputs).logits.double()
        with patch(model, client):
            ours = model(**inputs).logits.double()
    native_error = float((native - expected).abs().max())
    our_error = float((ours - expected).abs().max())
    print(f"{family} @2^{int(math.log2(start))}: native {native_error:.3g}, posenc {our_error:.3g}")
    assert our_error * FACTOR <= native_error, (native_error, our_error)


def test_whole_llama4_for_conditional_generation(client: posenc.Client) -> None:
    """Llama 4 Scout as loaded: patch() on Llama4ForConditionalGeneration patches the text
    table (rope layers; NoPE layers take none) and leaves the vision tower's. The model's
    own forward fails in transformers 5.24 whatever its tables (it reads ``image_outputs``
    from its language model's output, which has none), so the logits are its language
    model's, run inside the patched whole."""
    model = build(_llama4_vl())
    text = model.language_model
    start = 2**24
    reference = copy.deepcopy(text).double()
    feed(reference, reference_rows(text.config, start + SEQ))
    expected = logits_at(reference, start)
    native = [logits_at(text, position) for position in (0, 2000, start)]
    with patch(model, client) as handle:
        assert handle.specs.keys() == {"language_model.model.rotary_emb"}
        assert "Llama4VisionRotaryEmbedding" in handle.skipped["vision_model.rotary_embedding"]
        ours = [logits_at(text, position) for position in (0, 2000, start)]
    for theirs, mine in zip(native[:2], ours[:2], strict=True):
        assert float((mine - theirs).abs().max()) <= 2e-3 * float(theirs.abs().max())
    native_error = float((native[2] - expected).abs().max())
    our_error = float((ours[2] - expected).abs().max())
    print(f"llama4-vl @2^24: native {native_error:.3g}, posenc {our_error:.3g}")
    assert our_error * FACTOR <= native_error, (native_error, our_error)


# -- the newest families, rope types posenc does not compute, other forms -------------------------

# Families patch() refused or crashed on before (tests/transformers_sweep.py builds them from
# their config classes' defaults): proportional RoPE, keyed main / compress parameters and a
# partial compressor, per-layer head sizes, partial factors kept elsewhere, partial M-RoPE,
# M-RoPE variants, two-axis position ids, forms of module that are not the standard one.
NEWEST = [
    "gemma4_text",
    "lfm3",
    "deepseek_v4",
    "cohere2",
    "ergo",
    "neomme",
    "qwen3_5_text",
    "cosmos3_edge",
    "glm_ocr",
    "embedding_gemma2",
    "minimax_m3_vl",
    "mistral4",
    "jetmoe",
    "evolla",
    "musicflamingo",
    "recurrent_gemma",
]


@pytest.mark.parametrize("family", NEWEST)
def test_the_newest_families_are_served_exactly(family: str, client: posenc.Client) -> None:
    from transformers_sweep import run_family

    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    outcome = run_family(family, client)
    assert outcome.status == "served", outcome
    assert "module frequencies" not in outcome.detail, outcome


def test_an_unknown_rope_type_is_served_for_its_module_frequencies(
    client: posenc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import modeling_rope_utils

    def day_one(config: Any, device: Any = None, **kwargs: Any) -> tuple[Any, float]:
        # A rope type of a release newer than posenc: frequencies posenc has no formula for.
        inv_freq, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["linear"](config, device, **kwargs)
        return inv_freq * (1 + torch.arange(len(inv_freq)) / 1000), 1.25

    monkeypatch.setitem(modeling_rope_utils.ROPE_INIT_FUNCTIONS, "day_one", day_one)
    config = transformers.LlamaConfig(
        **TINY,
        head_dim=128,
        rope_parameters={"rope_type": "day_one", "rope_theta": 10000.0, "factor": 2.0},
    )
    model = build(config)
    native = logits_at(model, 100)
    with pytest.warns(ModuleFrequenciesWarning, match="rope type 'day_one'"):
        handle = patch(model, client)
    with handle:
        spec = handle.specs["model.rotary_emb"]
        assert spec.parameters["scaling"] == "frequencies"
        assert spec.parameters["attention_factor"] == 1.25
        held = model.model.rotary_emb.inv_freq.double().tolist()
        assert list(spec.parameters["inv_freq"]) == held  # the float32 values, exactly
        ours = logits_at(model, 100)
    assert float((ours - native).abs().max()) <= 1e-4 * float(native.abs().max())


def test_a_rotary_module_of_another_form_is_named_with_why(client: posenc.Client) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    class Merged(LlamaRotaryEmbedding):  # one tensor, not (cos, sin)
        def forward(self, x: Any, position_ids: Any) -> Any:
            cos, sin = super().forward(x, position_ids)
            return torch.cat([cos, sin], -1)

    model = build(_llama3())
    model.model.rotary_emb = Merged(model.config)
    with pytest.raises(ValueError) as refused:
        patch(model, client)
    message = str(refused.value)
    assert "\n" not in message
    assert "model.rotary_emb: Merged: its forward returns neither (cos, sin)" in message
    assert "forward" not in model.model.rotary_emb.__dict__
