"""g. Inference integration: posenc inside a transformers model, a decode step, a prefill table.

Needs torch and transformers (the conformance extra that ``make test`` installs); without
them the section reports that and measures nothing. Every ratio is of two measurements made
in the same run, interleaved (A, B, A, B, ...), so that load on the machine hits both alike;
each is given with its spread over the repetitions.
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path
from typing import Any

# Llama 3.1 8B's rope settings, as the test suites build the same model.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from model_configs import LLAMA3_1_ROPE  # type: ignore[import-not-found]  # tests/: no package

import posenc
from bench.common import Section, Sizes, Table, Target, median, percentile, ratio, runs_target
from bench.floor import FloorClient
from bench.harness import Servers, interleaved, step_times, timed

BATCH = 8
NEW_TOKENS = 64
HEAD_DIM = 128
PREFILL = 131_072
MODEL_SECONDS = 0.005


def _llama3_config(transformers: Any, **overrides: Any) -> Any:
    values = {
        "vocab_size": 256,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,  # head_dim 128
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rope_parameters": dict(LLAMA3_1_ROPE),
        **overrides,
    }
    return transformers.LlamaConfig(**values)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _step_times(steps: list[float]) -> str:
    return f"{median(steps) * 1e3:.2f} ms (p90 {percentile(steps, 90) * 1e3:.2f})"


def run(sizes: Sizes, servers: Servers) -> Section:
    section = Section("g", "Inference integration (torch, transformers)")
    try:
        import torch
        import transformers
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    except ImportError as error:
        section.error = f"needs the conformance extra (torch, transformers): {error}"
        return section
    from posenc.integrations.transformers import patch

    # torch's default threads, as a user's process runs (the figures say the machine).
    transformers.logging.set_verbosity_error()
    repeats = 3 if sizes.quick else 11
    # Runs of generate vary by up to 40% with the machine's other work: posenc's and the
    # native steps take turns within each run, and the target is a median over many runs.
    generate_repeats = 3 if sizes.quick else 31
    rounds = 200 if sizes.quick else 1000
    section.method = (
        f"One client process (torch CPU, its default {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs) and the posenc server of the run. "
        f"(1) A tiny Llama 3.1-shaped model (head_dim {HEAD_DIM}, 2 layers, random weights) "
        f"generates {NEW_TOKENS} greedy tokens for a batch of {BATCH}, patched "
        f"(`posenc.integrations.transformers.patch`), {generate_repeats} times; its decode "
        "steps take turns between posenc's rotary forward and the native one (a stopping "
        "criterion times every step and switches the forward for the next), each run gives "
        "the ratio of its median posenc step to its median native step, and the target is "
        "the median run (min - max of the runs). "
        f"(2) A decode step of {BATCH} sequences: "
        f"`(cos, sin)` of their next positions from the patched rotary module (posenc rows "
        f"from the client's read-ahead) against the native module's forward, with "
        f"{MODEL_SECONDS * 1e3:.0f} ms of model time between steps, and an empty unary gRPC "
        f"call to a trivial server (b'' -> b''), {rounds} steps each. (3) Prefill: (cos, sin) "
        f"of positions 0..{PREFILL - 1} (head_dim {HEAD_DIM}, float32): a warm "
        "`GrowingTable` (rows in memory), a cold one (a new spec each time: the server "
        "computes, the table fetches), and the native module computing them in float32. "
        f"(4) A dynamic-NTK model past max_position_embeddings: every step grows seq_len, so "
        f"every step is a new table; the patched module's step against the empty call."
    )
    floor = FloorClient(servers.floor_target)
    floor.wait_ready()
    client = posenc.Client(servers.posenc_target)
    targets: list[Target] = []
    rows: list[list[Any]] = []
    try:
        # (1) generate
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_llama3_config(transformers)).eval()
        prompt = torch.randint(0, 256, (BATCH, 16), generator=torch.Generator().manual_seed(1))

        patched = patch(model, client)
        rotary = model.model.rotary_emb
        # The patch makes the rotary module's forward posenc's (an instance attribute):
        # the steps of one generate call switch between it and the native forward.
        forwards = {True: rotary.forward, False: types.MethodType(type(rotary).forward, rotary)}

        class StepClock(transformers.StoppingCriteria):
            """Times each decode step (transformers asks after every token) and hands the
            next step to the other rotary forward: posenc's and the native one take turns
            step by step, so both see the same load and the same sequence lengths."""

            def __init__(self, first: bool) -> None:
                self.use_posenc = first
                self.times: dict[bool, list[float]] = {True: [], False: []}
                self.started: float | None = None
                rotary.forward = forwards[first]  # the prompt's step (a prefill, untimed)

            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                now = time.perf_counter()
                if self.started is not None:
                    self.times[self.use_posenc].append(now - self.started)
                self.use_posenc = not self.use_posenc
                rotary.forward = forwards[self.use_posenc]
                self.started = time.perf_counter()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        def generate(first: bool) -> dict[bool, list[float]]:
            """The decode steps of one generate call, in seconds, posenc's and native."""
            clock = StepClock(first)
            with torch.no_grad():
                model.generate(
                    prompt,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    stopping_criteria=transformers.StoppingCriteriaList([clock]),
                )
            return clock.times

        generate(True)  # warm-up: allocator, kernels, the growing table's first fetch
        runs = [generate(i % 2 == 0) for i in range(generate_repeats)]
        rotary.forward = forwards[True]
        patched.undo()
        posenc_runs = [run[True] for run in runs]
        native_runs = [run[False] for run in runs]
        # Steps of one run share the machine's load; the median run is what a step costs.
        posenc_steps = [step for run in posenc_runs for step in run]
        native_steps = [step for run in native_runs for step in run]
        step_ratios = [median(p) / median(n) for p, n in zip(posenc_runs, native_runs, strict=True)]
        rows.append(
            [
                f"generate, batch {BATCH}, {NEW_TOKENS} tokens: decode step (median of "
                f"{len(posenc_steps)} steps)",
                _step_times(posenc_steps),
                _step_times(native_steps),
                f"{median(step_ratios):.3f}x (median of {len(step_ratios)} runs; "
                f"{_spread(step_ratios)})",
            ]
        )
        targets.append(
            runs_target(
                "generate step, posenc-fed / native (median run)",
                step_ratios,
                "<=",
                1.05,
            )
        )

        # (2) decode step
        config = _llama3_config(transformers)
        native_module = LlamaRotaryEmbedding(config)
        patched_model = transformers.LlamaForCausalLM(
            _llama3_config(transformers, num_hidden_layers=1)
        ).eval()
        handle = patch(patched_model, client)
        ours_module = patched_model.model.rotary_emb
        x = torch.zeros(1, dtype=torch.float32)
        lengths = torch.tensor([1_000_003 + 9_973 * i for i in range(BATCH)])[:, None]

        def steps(module: Any, offset: int) -> list[float]:
            ids = [lengths + offset + index for index in range(rounds)]  # made untimed

            def step(index: int) -> None:
                with torch.no_grad():
                    module(x, ids[index])

            return step_times(step, rounds, MODEL_SECONDS)

        def empties() -> list[float]:
            return step_times(lambda _: floor.empty(), rounds, MODEL_SECONDS)

        steps(ours_module, 0)  # warm-up: the read-ahead starts
        ours = steps(ours_module, rounds)
        native = steps(native_module, 0)
        empty = empties()
        ours_again = steps(ours_module, 2 * rounds)
        ours += ours_again
        for name, values in (
            ("posenc (patched module)", ours),
            ("native rotary module", native),
            ("empty unary call", empty),
        ):
            rows.append(
                [
                    f"decode step, {BATCH} sequences, head_dim {HEAD_DIM}: {name}",
                    f"p50 {median(values) * 1e6:.0f} us",
                    f"p99 {percentile(values, 99) * 1e6:.0f} us",
                    "",
                ]
            )
        targets += [
            Target(
                "decode step p50, posenc / native rotary",
                ratio(median(ours), median(native)),
                "",
                0.0,
            ),
            Target(
                "decode step p50, posenc / empty unary call",
                ratio(median(ours), median(empty)),
                "",
                0.0,
            ),
            Target(
                "decode step p99, posenc / empty unary call",
                ratio(percentile(ours, 99), percentile(empty, 99)),
                "",
                0.0,
            ),
        ]
        handle.undo()

        # (3) prefill
        positions = torch.arange(PREFILL)[None]
        spec = posenc.Spec.from_config(config)
        warm_table = posenc.GrowingTable(client, spec)
        warm_table.get(positions)
        view_table = posenc.GrowingTable(client, spec, views=True)
        view_table.get(positions)
        cold_specs = iter(range(10_000))

        def warm() -> float:
            return timed(lambda: warm_table.get(positions, cos_sin=True))

        def viewed() -> float:
            return timed(lambda: view_table.get(positions, cos_sin=True))

        def cold() -> float:
            theta = 500000.0 + next(cold_specs)  # a table no server cache holds
            fresh = posenc.Spec.from_config(
                _llama3_config(
                    transformers,
                    rope_parameters={
                        **config.rope_parameters,
                        "rope_theta": theta,
                    },
                )
            )
            return timed(lambda: posenc.GrowingTable(client, fresh).get(positions, cos_sin=True))

        def native_table() -> None:
            with torch.no_grad():
                native_module(x, positions)

        def computed() -> float:
            return timed(native_table)

        native_times, warm_times = interleaved(computed, warm, repeats)
        native_times2, cold_times = interleaved(computed, cold, repeats)
        native_times3, view_times = interleaved(computed, viewed, repeats)
        warm_ratios = [n / w for n, w in zip(native_times, warm_times, strict=True)]
        view_ratios = [n / v for n, v in zip(native_times3, view_times, strict=True)]
        cold_ratios = [n / c for n, c in zip(native_times2, cold_times, strict=True)]
        rows.append(
            [
                f"prefill table, {PREFILL} positions, head_dim {HEAD_DIM}: warm GrowingTable",
                f"{median(warm_times) * 1e3:.1f} ms",
                f"{median(native_times) * 1e3:.1f} ms (native float32)",
                f"{median(warm_ratios):.1f}x faster ({_spread(warm_ratios)})",
            ]
        )
        rows.append(
            [
                "the same, a table made with views=True (a view of the held rows)",
                f"{median(view_times) * 1e3:.3f} ms",
                f"{median(native_times3) * 1e3:.1f} ms (native float32)",
                f"{median(view_ratios):.0f}x faster ({_spread(view_ratios)})",
            ]
        )
        rows.append(
            [
                "the same, cold (server computes, table fetches)",
                f"{median(cold_times) * 1e3:.1f} ms",
                f"{median(native_times2) * 1e3:.1f} ms (native float32)",
                f"{median(cold_ratios):.2f}x faster ({_spread(cold_ratios)})",
            ]
        )
        targets += [
            Target("prefill warm: native time / posenc time", median(warm_ratios), ">=", 10.0),
            Target(
                "prefill warm, views=True: native time / posenc time",
                median(view_ratios),
                "",
                0.0,
            ),
            Target("prefill cold: native time / posenc time", median(cold_ratios), ">=", 1.0),
        ]

        # (4) dynamic NTK, seq_len growing every step
        dynamic = transformers.LlamaForCausalLM(
            _llama3_config(
                transformers,
                num_hidden_layers=1,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
            )
        ).eval()
        handle = patch(dynamic, client)
        module = dynamic.model.rotary_emb
        start_length = 5000

        def dynamic_steps(offset: int) -> list[float]:
            ids = [torch.full((BATCH, 1), start_length + offset + i) for i in range(rounds)]

            def step(index: int) -> None:
                with torch.no_grad():
                    module(x, ids[index])

            return step_times(step, rounds, MODEL_SECONDS)

        dynamic_steps(0)
        # Three runs, each its steps then as many empty calls: the target is the median
        # run's ratio, with the min and max of the runs.
        dyn: list[float] = []
        empties_all: list[float] = []
        run_ratios: list[float] = []
        for run in range(3):
            run_steps = dynamic_steps((run + 1) * rounds)
            run_empties = empties()
            dyn += run_steps
            empties_all += run_empties
            run_ratios.append(ratio(median(run_steps), median(run_empties)))
        handle.undo()
        rows.append(
            [
                f"dynamic NTK decode, seq_len growing every step, batch {BATCH}",
                f"p50 {median(dyn) * 1e6:.0f} us",
                f"p99 {percentile(dyn, 99) * 1e6:.0f} us",
                f"{ratio(median(dyn), median(empties_all)):.2f}x the empty call (p50)",
            ]
        )
        targets.append(
            runs_target("dynamic NTK step p50 / empty unary call p50", run_ratios, "<=", 2.0)
        )
    finally:
        client.close()
        floor.close()
    section.tables.append(
        Table("Measured side by side", ["what", "posenc", "baseline", "ratio"], rows)
    )
    section.targets += targets
    return section
