"""Small stand-ins for the SGLang modules its rotary package imports beyond itself.

:func:`load` puts them in ``sys.modules`` under their SGLang names, with the real
``sglang``, ``sglang.srt`` and ``sglang.srt.layers`` packages pointing at the files kept
from the wheel (tests/sglang_wheel.py), and imports ``sglang.srt.layers.rotary_embedding``:
its classes and ``get_rope`` are SGLang's own code. What is stood in for is platform glue
only: the fused-op base class (a module whose forward is the native one), the platform
probes (a CPU without AMX), the environment switches (their defaults), the runtime context
(no published role) and the triton kernels the cache computations never call.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import engine_wheel
import torch
from engine_wheel import stub_module as _module
from engine_wheel import stub_packages

# envs: SGLang's defaults (SGLANG_ROPE_CACHE_ALIGN is what the cache grows by).
env_values: dict[str, Any] = {"SGLANG_ROPE_CACHE_FP32": False, "SGLANG_ROPE_CACHE_ALIGN": 128}


class _Envs:
    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(get=lambda: env_values[name])


class BaseFusedOp(torch.nn.Module):
    """sglang.kernels.fused_op.BaseFusedOp: a module whose forward is the native one."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self, "_forward_method", None) or self.forward_native  # type: ignore[attr-defined]
        return method(*args, **kwargs)


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a kernel the CPU path never calls")


def load(root: Path) -> ModuleType:
    """``sglang.srt.layers.rotary_embedding`` from the wheel's files under ``root``."""
    rotary = "sglang.srt.layers.rotary_embedding"
    if rotary in sys.modules:
        return sys.modules[rotary]
    sglang = stub_packages(root, "sglang", "sglang.srt", "sglang.srt.layers", "sglang.kernels")
    stub_packages(root, "sglang.kernels.ops", "sglang.kernels.ops.attention")
    _module(
        "sglang.kernels.ops.attention.rotary_triton",
        triton_ernie45_rope_fused_inplace=_never,
        triton_mrope_fused=_never,
    )
    _module("sglang.kernels.ops.attention.mrope", apply_interleaved_rope_triton=_never)
    _module("sglang.kernels.fused_op", BaseFusedOp=BaseFusedOp)
    _module("sglang.srt.environ", envs=_Envs())
    _module("sglang.srt.platforms", current_platform=SimpleNamespace(is_out_of_tree=lambda: False))
    _module(
        "sglang.srt.runtime_context",
        attention_backends=lambda: SimpleNamespace(),
        get_exec=lambda: SimpleNamespace(deterministic=SimpleNamespace(rl_on_policy_target=None)),
        publish_role=lambda: None,
    )
    probes = {
        f"is_{device}": (lambda answer: lambda: answer)(device == "cpu")
        for device in ("cuda", "hip", "cpu", "npu", "xpu", "musa", "mps")
    }
    _module(
        "sglang.srt.utils",
        **probes,
        cpu_has_amx_support=lambda: False,
        get_bool_env_var=lambda name, default="false": False,
        get_compiler_backend=lambda: "inductor",
        get_device=lambda *args: "cpu",
        support_triton=lambda *args: False,
    )
    sglang.__version__ = importlib.import_module("sglang.version").__version__
    return importlib.import_module(rotary)


def unload() -> None:
    """Takes every ``sglang`` module out of ``sys.modules``: later tests see no SGLang."""
    engine_wheel.unload("sglang")
