"""Published models' positional settings, shared by the suites that build tiny copies of them.

Each constant is what the named model's released config holds (or, for the vision towers, the
one tiny tower the suites run them with): one place to read them, so that two suites testing
the same model test the same settings.
"""

from __future__ import annotations

from typing import Any

# Qwen2-VL and Qwen2.5-VL 7B: head 128 split into sections 16 / 24 / 24, theta 1e6.
QWEN2_VL_MROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 1e6,
    "mrope_section": [16, 24, 24],
}

# The smallest vision towers Qwen2-VL and Qwen2.5-VL build: one block, two heads.
QWEN2_VL_VISION: dict[str, Any] = {"depth": 1, "embed_dim": 32, "hidden_size": 256, "num_heads": 2}
QWEN2_5_VL_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "out_hidden_size": 256,
    "num_heads": 2,
    "intermediate_size": 32,
}

# DeepSeek-V3's YaRN: factor 40 over its 4096 training positions, theta 1e4.
DEEPSEEK_V3_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
}

# Qwen3-VL 8B: head 128, interleaved sections 24 / 20 / 20, theta 5e6.
QWEN3_VL_MROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 5e6,
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
}

# Qwen3-VL's tower is Qwen2.5-VL's with no deepstack layers.
QWEN3_VL_VISION: dict[str, Any] = {**QWEN2_5_VL_VISION, "deepstack_visual_indexes": []}

# Llama 3.1 8B: theta 5e5, llama3 scaling by 8 over 8192 training positions.
LLAMA3_1_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}

# Qwen2.5 7B's documented YaRN: factor 4 over 32768 positions, theta 1e6.
QWEN2_5_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
}
