"""Small stand-ins for the vLLM modules its rotary package imports beyond itself.

:func:`load` puts them in ``sys.modules`` under their vLLM names, with the real ``vllm``,
``vllm.model_executor`` and ``vllm.model_executor.layers`` packages pointing at the files
kept from the wheel (tests/vllm_wheel.py), and imports
``vllm.model_executor.layers.rotary_embedding``: its classes and ``get_rope`` are vLLM's own
code. What is stood in for is platform glue only: custom-op registration (a ``CustomOp``
whose forward is the native one), ``current_platform`` (a CPU), the config getter (Phi-3's
class reads ``max_model_len``), the logger, and triton, flashinfer, AITER and
tensor-parallel hooks the cache computations never call.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import engine_wheel
import torch
from engine_wheel import stub_module as _module
from engine_wheel import stub_packages

# get_current_vllm_config(): Phi3LongRoPEScaledRotaryEmbedding reads max_model_len from it.
current_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))
# rocm_aiter_ops: with `enabled`, RotaryEmbedding keeps its second, bfloat16 cache.
aiter = SimpleNamespace(enabled=False)


class CustomOp(torch.nn.Module):
    """vllm.model_executor.custom_op.CustomOp: registration by name, native forward."""

    name: str

    def __init__(self, *, enforce_enable: bool = False, compile_native: bool = False) -> None:
        super().__init__()

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        def decorator(op_cls: type) -> type:
            op_cls.name = name  # type: ignore[attr-defined]
            return op_cls

        return decorator

    @classmethod
    def enabled(cls) -> bool:
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)  # type: ignore[attr-defined]


class _Platform:
    """current_platform: a CPU, no accelerator."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("is_"):
            return lambda *args: name == "is_cpu"
        raise AttributeError(name)


def _jit(*args: Any, **kwargs: Any) -> Any:
    """triton.jit, as ``@triton.jit`` and ``@triton.jit(...)``: the kernel, never launched."""
    return args[0] if args and callable(args[0]) else (lambda kernel: kernel)


def _init_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.warning_once = logger.warning  # type: ignore[attr-defined]
    logger.info_once = logger.info  # type: ignore[attr-defined]
    logger.debug_once = logger.debug  # type: ignore[attr-defined]
    return logger


def load(root: Path) -> ModuleType:
    """``vllm.model_executor.layers.rotary_embedding`` from the wheel's files under ``root``."""
    name = "vllm.model_executor.layers.rotary_embedding"
    if name in sys.modules:
        return sys.modules[name]
    vllm = stub_packages(root, "vllm", "vllm.model_executor", "vllm.model_executor.layers")
    _module("vllm.model_executor.custom_op", CustomOp=CustomOp)
    _module(
        "vllm._aiter_ops",
        rocm_aiter_ops=SimpleNamespace(
            is_triton_rotary_embed_enabled=lambda: aiter.enabled,
            get_triton_rotary_embedding_op=lambda: None,
        ),
    )
    _module("vllm.logger", init_logger=_init_logger)
    _module("vllm.platforms", current_platform=_Platform())
    _module("vllm.config", get_current_vllm_config=lambda: current_config)
    stub_packages(root, "vllm.utils")
    _module("vllm.utils.torch_utils", direct_register_custom_op=lambda **kwargs: None)
    _module("vllm.utils.flashinfer", has_flashinfer=lambda: False)
    _module(
        "vllm.triton_utils", triton=SimpleNamespace(jit=_jit), tl=SimpleNamespace(constexpr=object)
    )
    _module(
        "vllm.distributed",
        get_tensor_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_world_size=lambda: 1,
    )
    vllm.__version__ = importlib.import_module("vllm._version").__version__
    return importlib.import_module(name)


def unload() -> None:
    """Takes every ``vllm`` module out of ``sys.modules``: later tests see no vLLM."""
    engine_wheel.unload("vllm")
