"""Tiny random-initialised models of every transformers family with a rotary module, and what
posenc's patch() makes of each (tests/test_integrations_transformers_sweep.py runs it).

A family's model is built from its own config class at its defaults (its published head
sizes and rope settings), shrunk where size does not touch the rotary table: two layers (or
one of each layer type), a small vocabulary, hidden and intermediate sizes, a few heads and
experts. The head size (head_dim, or hidden_size / heads where the config derives it), the
rope parameters and the partial rotary factors are kept. Each family then ends in one of:

- ``served``: patch() replaced its rotary modules, and the patched model's logits and every
  rotary module's output, called with the position ids the model itself passed, equal the
  unpatched model's within float32 noise;
- ``refused``: patch() raised a one-line ValueError or InvalidArgumentError naming why;
- ``failed``: anything else (another exception, a traceback from inside posenc, a patched
  forward that raises or differs);
- ``not built``: the tiny model could not be built or run unpatched (the sweep's limit, not
  posenc's).

Run ``python tests/transformers_sweep.py [family ...]`` against a running server
(``POSENC_TARGET``, default 127.0.0.1:50051) to print each family's outcome.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

import posenc
from posenc.integrations.transformers import ModuleFrequenciesWarning, patch

SEQ = 12
# Sizes that do not touch the rotary table.
_SMALL: dict[str, int] = {
    "vocab_size": 128,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "vision_start_token_id": 120,
    "image_token_id": 121,
    "video_token_id": 122,
}
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
HEADS = 2


@dataclass
class Outcome:
    """One family's result."""

    family: str
    status: str  # served, refused, failed, not built, no rotary
    detail: str = ""


@dataclass
class Report:
    """Every family's outcome."""

    outcomes: list[Outcome] = field(default_factory=list)

    def of(self, status: str) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.status == status]

    def counts(self) -> dict[str, int]:
        statuses = ("served", "refused", "failed", "not built", "no rotary")
        return {status: len(self.of(status)) for status in statuses}


def rotary_families() -> list[str]:
    """The model types whose modeling code defines a rotary module."""
    families = []
    for model_type in transformers.CONFIG_MAPPING:
        module = transformers.models.auto.configuration_auto.model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}")
        if spec is None or not spec.submodule_search_locations:
            continue
        directory = spec.submodule_search_locations[0]
        path = os.path.join(directory, f"modeling_{module}.py")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as source:
                if "RotaryEmbedding" in source.read():
                    families.append(model_type)
    return families


def _head_dim(names: dict[str, Any]) -> int | None:
    given = names.get("head_dim")
    if isinstance(given, int) and given > 0:
        return given
    hidden = next((names[n] for n in _HIDDEN if isinstance(names.get(n), int)), None)
    heads = next((names[n] for n in _HEADS if isinstance(names.get(n), int)), None)
    if hidden and heads:
        return int(hidden // heads)
    return None


def _shrunk(config: Any) -> dict[str, Any]:
    """The keyword arguments that build a small config of ``config``'s class (sub-configs
    as dicts of theirs), keeping each one's head size: its class then derives what follows
    from them (per-layer overrides, layer types) as it does for a published config."""
    names = dict(vars(config))
    kwargs: dict[str, Any] = {}
    for name, value in names.items():
        if isinstance(value, transformers.PretrainedConfig):
            own = _shrunk(value)
            given = value.to_dict()
            if any(n in own for n in _LAYERS):
                # Per-layer overrides name layer indices: the class derives them again.
                given.pop("per_layer_config", None)
            kwargs[name] = {**given, **own}
    head_dim = _head_dim(names)
    layer_types = names.get("layer_types")
    if not isinstance(layer_types, list):
        # Hybrids that name their blocks otherwise (RecurrentGemma's block_types).
        layer_types = next(
            (
                names[n]
                for n in ("block_types", "layers_block_type")
                if isinstance(names.get(n), list)
            ),
            None,
        )
    for name in _LAYERS:
        if isinstance(names.get(name), int) and names[name] > 2:
            kept = 2
            if isinstance(layer_types, list) and layer_types:
                distinct = list(dict.fromkeys(layer_types))
                kept = max(2, len(distinct))
                if not isinstance(names.get("layer_types"), list):
                    # A cycled pattern: enough layers to reach each type's first block.
                    kept = max(2, *(layer_types.index(kind) + 1 for kind in distinct))
                # One of each type, in the order they first appear.
                if isinstance(names.get("layer_types"), list):
                    kwargs["layer_types"] = (distinct * kept)[:kept]
            kwargs[name] = kept
    for name, small in _SMALL.items():
        if isinstance(names.get(name), int) and names[name] > small:
            kwargs[name] = small
    vocab = kwargs.get("vocab_size", names.get("vocab_size"))
    if isinstance(vocab, int):
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(names.get(name), int) and names[name] >= vocab:
                kwargs[name] = vocab - 1 - ("pad", "bos", "eos").index(name.split("_")[0])
    heads = next((n for n in _HEADS if isinstance(names.get(n), int)), None)
    hidden = next((n for n in _HIDDEN if isinstance(names.get(n), int)), None)
    if head_dim and heads and hidden:
        explicit = isinstance(names.get("head_dim"), int) and names["head_dim"] > 0
        kwargs[heads] = HEADS
        for kv in _KV_HEADS:
            if isinstance(names.get(kv), int):
                kwargs[kv] = HEADS
        if explicit:
            kwargs[hidden] = min(names[hidden], 64)
        elif names[hidden] != HEADS * head_dim:
            kwargs[hidden] = HEADS * head_dim
    if isinstance(names.get("initializer_range"), float):
        kwargs["initializer_range"] = 0.2
    return kwargs


def _shrink_in_place(config: Any, seen: set[int]) -> None:
    """The same sizes set on a built config (and its sub-configs): for classes whose
    validators refuse the keyword arguments that would derive them."""
    if id(config) in seen:
        return
    seen.add(id(config))
    for value in list(vars(config).values()):
        if isinstance(value, transformers.PretrainedConfig):
            _shrink_in_place(value, seen)
    for name, value in _shrunk(config).items():
        if not isinstance(value, dict):
            object.__setattr__(config, name, value)


def tiny_config(family: str) -> Any:
    """A small config of ``family`` (its class's defaults, shrunk)."""
    config_class = transformers.CONFIG_MAPPING[family]
    try:
        return config_class(**_shrunk(config_class()))
    except Exception:
        config = config_class()
        _shrink_in_place(config, set())
        return config


def _model_class(config: Any) -> Any:
    for mapping in (
        transformers.MODEL_FOR_CAUSAL_LM_MAPPING,
        transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        transformers.MODEL_MAPPING,
    ):
        with contextlib.suppress(KeyError, ValueError):
            return mapping[type(config)]
    return None


def _rotaries(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if "RotaryEmbedding" in type(module).__name__ or "rotary" in name.rsplit(".", 1)[-1]
    }


def _inputs(config: Any, model: nn.Module) -> dict[str, Any]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 128) or 128)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 100), (1, SEQ), generator=generator)
    return {"input_ids": ids}


def _output(result: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        value = getattr(result, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(result, tuple) and isinstance(result[0], torch.Tensor):
        return result[0]
    raise TypeError(f"no tensor output in {type(result).__name__}")


@contextlib.contextmanager
def _recording(rotaries: dict[str, nn.Module]) -> Iterator[dict[str, list[Any]]]:
    """Each rotary module's calls (args, kwargs, output) during a forward."""
    calls: dict[str, list[Any]] = {name: [] for name in rotaries}
    hooks = []
    for name, module in rotaries.items():

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            if len(calls[name]) < 4:
                calls[name].append((args, dict(kwargs), output))

        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in hooks:
            handle.remove()


def _flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [torch.view_as_real(value) if value.is_complex() else value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _flatten(item)]
    return []


def _differs(ours: Any, theirs: Any, tolerance: float) -> str:
    mine, native = _flatten(ours), _flatten(theirs)
    if len(mine) != len(native):
        return f"{len(mine)} tensors, the model's {len(native)}"
    for a, b in zip(mine, native, strict=True):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)}, the model's {tuple(b.shape)}"
        if a.numel():
            difference = float((a.double() - b.double()).abs().max())
            scale = max(float(b.double().abs().max()), 1.0)
            if not difference <= tolerance * scale:
                return f"differs by {difference:.3g}"
    return ""


def run_family(family: str, client: posenc.Client) -> Outcome:
    """Builds, runs, patches and checks one family."""
    torch.manual_seed(0)
    try:
        config = tiny_config(family)
        model_class = _model_class(config)
        if model_class is None:
            return Outcome(family, "not built", "no model class")
        try:
            model = model_class(config).eval()
        except Exception:
            config = transformers.CONFIG_MAPPING[family]()
            _shrink_in_place(config, set())
            model = model_class(config).eval()
        rotaries = _rotaries(model)
        if not rotaries:
            return Outcome(family, "no rotary", model_class.__name__)
        inputs = _inputs(config, model)
        with torch.no_grad(), _recording(rotaries) as calls:
            native = _output(model(**inputs))
    except Exception as error:
        return Outcome(family, "not built", f"{type(error).__name__}: {str(error)[:160]}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = patch(model, client)
        fallback = [str(w.message) for w in caught if w.category is ModuleFrequenciesWarning]
    except (ValueError, posenc.InvalidArgumentError) as error:
        message = str(error)
        if "holds no positional table posenc serves" in message:
            # Rotary tables of its vision tower only, which patch() leaves alone.
            return Outcome(family, "no rotary", message)
        if "\n" in message or "Traceback" in message:
            return Outcome(family, "failed", f"multi-line refusal: {message[:300]}")
        return Outcome(family, "refused", message)
    except Exception as error:
        return Outcome(family, "failed", f"{type(error).__name__} from patch(): {error}")
    try:
        with torch.no_grad():
            ours = _output(model(**inputs))
            problems = []
            for name, module in rotaries.items():
                if name in handle.skipped:
                    continue
                for args, kwargs, output in calls[name]:
                    again = module(*args, **kwargs)
                    why = _differs(again, output, 2e-5)
                    if why:
                        problems.append(f"{name}: {why}")
                        break
        why = _differs(ours, native, 1e-3)
        if why:
            problems.append(f"logits: {why}")
        unnamed = [n for n in rotaries if n not in handle.skipped and not _patched(handle, n)]
        if unnamed:
            problems.append(f"neither patched nor skipped: {', '.join(unnamed)}")
    except Exception as error:
        handle.undo()
        return Outcome(family, "failed", f"{type(error).__name__} from the patched model: {error}")
    handle.undo()
    if problems:
        return Outcome(family, "failed", "; ".join(problems))
    served = ", ".join(f"{n}: {s}" for n, s in handle.specs.items())
    if fallback:
        return Outcome(family, "served", f"module frequencies: {fallback[0]}")
    return Outcome(family, "served", served[:200])


def _patched(handle: Any, name: str) -> bool:
    return any(key == name or key.startswith(f"{name}:") for key in handle.specs) or any(
        name.startswith(f"{key}.") for key in handle.specs if key
    )


def sweep(client: posenc.Client, families: list[str] | None = None) -> Report:
    """Every family's outcome."""
    transformers.logging.set_verbosity_error()
    report = Report()
    for family in families or rotary_families():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = run_family(family, client)
        report.outcomes.append(outcome)
    return report


if __name__ == "__main__":
    with posenc.Client(os.environ.get("POSENC_TARGET", "127.0.0.1:50051")) as sdk:
        found = sweep(sdk, sys.argv[1:] or None)
    for item in found.outcomes:
        print(f"{item.family:32} {item.status:10} {item.detail}")
    print(found.counts())
