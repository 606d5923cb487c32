"""posenc.integrations.transformers.patch on tiny random-initialised models of every family.

No weights are downloaded: each model is built from a config (``initializer_range`` large
enough that attention depends on position). For each rotary family:

- below position 2048, posenc-fed logits equal the model's own within float32 noise, and
  greedy ``generate`` gives the same tokens;
- at positions 2^20 and 2^24, posenc-fed float32 logits are closer to a float64 reference
  than the model's own float32 ones, by at least ``FACTOR``. The reference is the model in
  float64 fed float64 tables computed here from the config's rope parameters (numpy float64,
  exact integer positions) -- not ``model.double()``, whose rotary code casts to float32.

Sinusoidal families: the patched table equals the model's own (small positions), logits
match, and an input that outgrows the table grows it from posenc, not from the model.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
transformers = pytest.importorskip("transformers")
# Every test here builds transformers models: seconds each (make test-fast skips them).
pytestmark = pytest.mark.slow

import posenc  # noqa: E402
from posenc.integrations.transformers import patch  # noqa: E402

#: posenc-fed logits are at least this many times closer to the float64 reference than the
#: model's own float32 logits, at 2^20 and 2^24.
FACTOR = 1000.0
SEQ = 12
BATCH = 2


@pytest.fixture
def client(server: Any) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as client:
        yield client


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # transformers warns about configs it accepts (YaRN's implicit factor, missing masks).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


# -- tiny models ----------------------------------------------------------------------------------

TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.3,
    "max_position_embeddings": 4096,
}


def _llama3() -> Any:
    return transformers.LlamaConfig(
        **TINY,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    )


def _qwen2_yarn() -> Any:
    return transformers.Qwen2Config(
        **TINY,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    )


def _phi3_longrope() -> Any:
    half = 8  # head_dim 16
    return transformers.Phi3Config(
        **{**TINY, "max_position_embeddings": 131072},
        original_max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)],
        },
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def _dynamic() -> Any:
    return transformers.LlamaConfig(
        **{**TINY, "max_position_embeddings": 1024},
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    )


def _linear() -> Any:
    return transformers.LlamaConfig(
        **TINY, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    )


def _mistral() -> Any:
    return transformers.MistralConfig(**TINY, rope_theta=1000000.0)


def _mixtral() -> Any:
    return transformers.MixtralConfig(**TINY, num_local_experts=2, num_experts_per_tok=1)


def _gemma() -> Any:
    return transformers.GemmaConfig(**TINY, head_dim=32)


def _gemma2() -> Any:
    return transformers.Gemma2Config(**TINY, head_dim=32, sliding_window=4096)


def _gpt_neox() -> Any:
    return transformers.GPTNeoXConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        initializer_range=0.3,
        max_position_embeddings=4096,
        rotary_pct=0.25,
    )


def _gptj() -> Any:
    return transformers.GPTJConfig(
        vocab_size=96,
        n_embd=64,
        n_layer=2,
        n_head=2,
        rotary_dim=16,
        n_positions=2048,
        initializer_range=0.3,
    )


def _deepseek_v2() -> Any:
    return transformers.DeepseekV2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        first_k_dense_replace=2,  # dense MLPs: its MoE kernel has no float64 (the reference)
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        initializer_range=0.3,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    )


ROTARY: dict[str, Callable[[], Any]] = {
    "llama3": _llama3,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2-yarn": _qwen2_yarn,
    "phi3-longrope": _phi3_longrope,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gpt-neox": _gpt_neox,
    "gptj": _gptj,
    "deepseek-v2": _deepseek_v2,
    "llama-dynamic": _dynamic,
    "llama-linear": _linear,
}


def build(config: Any) -> Any:
    torch.manual_seed(0)
    # Eager kernels: the grouped MoE matmul has no float64 (the reference runs in float64).
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


# -- feeding a model rows of our choosing ---------------------------------------------------------


def feed(model: Any, rows: Callable[[Any], tuple[Any, Any]]) -> None:
    """Makes ``model`` take (cos, sin) of position_ids from ``rows`` (float64 numpy halves),
    through its rotary modules (complex for DeepSeek) or GPT-J's attention."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            complex_rows = "Deepseek" in type(module).__name__

            def forward(x: Any, position_ids: Any, _c: bool = complex_rows) -> Any:
                cos, sin = rows(position_ids)
                if _c:
                    return torch.complex(torch.from_numpy(cos), torch.from_numpy(sin))
                cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
                return torch.from_numpy(cos).to(x.dtype), torch.from_numpy(sin).to(x.dtype)

            module.forward = forward
        elif hasattr(module, "embed_positions") and hasattr(module, "rotary_dim"):
            native = type(module).forward

            def attention(*args: Any, _m: Any = module, _n: Any = native, **kwargs: Any) -> Any:
                ids = kwargs["position_ids"]
                cos, sin = rows(ids)
                sincos = torch.from_numpy(np.concatenate([sin, cos], -1))
                kwargs["position_ids"] = torch.arange(ids.shape[1]).expand(ids.shape)
                _m._get_embed_positions = lambda _ids: sincos
                return _n(_m, *args, **kwargs)

            module.forward = attention


def rope_frequencies(config: Any, seq_len: int) -> tuple[np.ndarray, float]:
    """inv_freq and attention factor of transformers' modeling_rope_utils for ``config``,
    in float64 (the same formulas, evaluated without float32)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if config.model_type == "gptj":
        head_dim, factor_p, theta = config.n_embd // config.n_head, None, 10000.0
        dim = config.rotary_dim
    else:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
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
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / f, inv)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled)
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

        lo = max(math.floor(correction(rope.get("beta_fast") or 32)), 0)
        hi = min(math.ceil(correction(rope.get("beta_slow") or 1)), dim - 1)
        ramp = np.clip((np.arange(dim // 2) - lo) / ((hi - lo) or 0.001), 0, 1)
        extrapolation = 1 - ramp
        inv = inv / f * (1 - extrapolation) + inv * extrapolation
    elif kind == "longrope":
        original = rope["original_max_position_embeddings"]
        f = config.max_position_embeddings / original
        attention = math.sqrt(1 + math.log(f) / math.log(original)) if f > 1 else 1.0
        factors = rope["long_factor"] if seq_len > original else rope["short_factor"]
        inv = 1.0 / (np.asarray(factors, dtype=np.float64) * theta**exponents)
    return inv, attention


def reference_rows(config: Any, seq_len: int) -> Callable[[Any], tuple[Any, Any]]:
    inv, attention = rope_frequencies(config, seq_len)

    def rows(position_ids: Any) -> tuple[Any, Any]:
        angles = position_ids.numpy().astype(np.float64)[..., None] * inv
        return np.cos(angles) * attention, np.sin(angles) * attention

    return rows


def gptj_native_rows(config: Any) -> Callable[[Any], tuple[Any, Any]]:
    """GPT-J's own create_sinusoidal_positions (float32), at any positions."""
    dim = config.rotary_dim

    def rows(position_ids: Any) -> tuple[Any, Any]:
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
    attention = model.transformer.h[0].attn
    with patch(model, client) as handle:
        spec = handle.specs["transformer.h.0.attn"]
        assert spec.parameters["layout"] == "vllm"
        assert "forward" in attention.__dict__
    assert "forward" not in attention.__dict__
    assert "model" in repr(handle) or "Patch" in repr(handle)


def test_longrope_holds_two_tables(client: posenc.Client) -> None:
    model = build(_phi3_longrope())
    with patch(model, client) as handle:
        logits_at(model, 0)
        logits_at(model, 100)  # short
        logits_at(model, 5000)  # long: seq_len > 1024
        logits_at(model, 6000)
        logits_at(model, 7000)
        seq_lens = sorted(str(table.table.parameters.get("seq_len")) for table in handle.tables)
        assert seq_lens == ["1025", "None"]


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


@pytest.mark.slow
def test_speech2text_encoder_and_decoder(client: posenc.Client) -> None:
    torch.manual_seed(0)
    model = transformers.Speech2TextForConditionalGeneration(_speech2text()).eval()
    features = torch.randn(1, 40, model.config.input_feat_per_channel * 1)
    decoder = torch.randint(3, 96, (1, 6))
    with torch.no_grad():
        native = model(input_features=features, decoder_input_ids=decoder).logits
        with patch(model, client) as handle:
            assert {spec.kind for spec in handle.specs.values()} == {"fairseq"}
            ours = model(input_features=features, decoder_input_ids=decoder).logits
    assert_same_logits("speech2text", ours, native)


@pytest.mark.slow
def test_whisper_encoder_table_is_posenc(client: posenc.Client) -> None:
    config = transformers.WhisperConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=50,
        max_target_positions=32,
        init_std=0.3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    features = torch.randn(1, 8, 100)
    decoder = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        native = model(input_features=features, decoder_input_ids=decoder).logits
        with patch(model, client) as handle:
            (spec,) = handle.specs.values()
            assert spec == posenc.Spec("whisper", d_model=32)
            weight = model.model.encoder.embed_positions.weight
            np.testing.assert_array_equal(weight.numpy(), client.get_range(0, 50, spec))
            ours = model(input_features=features, decoder_input_ids=decoder).logits
    assert_same_logits("whisper", ours, native)


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
    with torch.no_grad():
        native = model(ids).last_hidden_state
        with patch(model, client, min_rows=64) as handle:
            (spec,) = handle.specs.values()
            assert spec == posenc.Spec("sinusoidal", d_model=32)
            ours = model(ids).last_hidden_state
            longer = model(torch.randint(3, 96, (1, 200))).last_hidden_state
            assert longer.shape == (1, 200, 32)
    assert_same_logits("xlm", ours, native)
