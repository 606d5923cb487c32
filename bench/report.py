"""Writes a run's results: Markdown tables, the same data as JSON, and a matplotlib plot."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from bench import memory
from bench.common import MIB, Section, Sizes, Target


def write(
    out: Path, name: str, about: dict[str, Any], sizes: Sizes, sections: list[Section]
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    document = {
        "machine": about,
        "sizes": dataclasses.asdict(sizes),
        "sections": [s.to_json() for s in sections],
        "targets": [{"section": s.key, **t.to_json()} for s in sections for t in s.targets],
    }
    paths[0].write_text(json.dumps(document, indent=1, default=_json_default) + "\n")
    paths[1].write_text(markdown(about, sections, paths[2].name))
    try:
        plot(sections, about, paths[2])
    except Exception as error:  # a missing matplotlib must not lose the figures
        print(f"[bench] no plot: {type(error).__name__}: {error}")
        paths.pop()
    return paths


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)


def _fmt(value: float, unit: str) -> str:
    if value != value:
        return "n/a"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "":
        return f"{value:.3g}"
    return f"{value:.1f}{unit}"


def _measured(target: Target) -> str:
    """The value, and the min-max of its runs when it has several."""
    text = _fmt(target.value, target.unit)
    if target.spread is not None:
        low, high = target.spread
        text += f" ({_fmt(low, target.unit)} - {_fmt(high, target.unit)})"
    return text


def markdown(about: dict[str, Any], sections: list[Section], png: str) -> str:
    lines = [
        "# posenc benchmarks",
        "",
        f"`{about['command']}` ({about['mode']} mode), {about['date']}, commit "
        f"`{about['git_commit']}`{' (with local changes)' if about['git_dirty'] else ''}, "
        f"{about['wall_seconds']:.0f} s wall time.",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {about['cpu_model']}, {about['logical_cpus']} logical CPUs "
        f"({about['usable_cpus']} usable) |",
        f"| RAM | {about['ram_gib']} GiB |",
        f"| load average (1, 5, 15 min) | {about['load_average_at_start']} at start, "
        f"{about.get('load_average_at_end', '?')} at the end |",
        f"| CPU time taken by the host (steal) during the run | {about.get('steal', '?')} of "
        "the machine's |",
        f"| software | Linux {about['kernel']}, Python {about['python']}, numpy {about['numpy']}, "
        f"grpcio {about['grpcio']}, protobuf {about['protobuf']}, posenc {about['posenc']} |",
        f"| servers | posenc `{about['posenc_server_flags']}`; floor: {about['server_processes']} "
        "process(es) |",
        "",
        "Every target is the ratio of two figures of this one run, measured interleaved on the "
        "same machine; medians of repeated measurements. Targets measured in several runs "
        "show the median run and (min - max) of the runs.",
        "",
        "## Targets",
        "",
        "| section | target | measured | wanted | verdict |",
        "|---|---|---|---|---|",
    ]
    for section in sections:
        if section.error:
            lines.append(f"| {section.key} | (section failed: {section.error}) | | | FAIL |")
        for target in section.targets:
            wanted = f"{target.op} {_fmt(target.threshold, target.unit)}" if target.op else ""
            lines.append(
                f"| {section.key} | {target.name} | {_measured(target)} | "
                f"{wanted} | {target.verdict()} |"
            )
    lines += ["", f"![plot]({png})", ""]
    for section in sections:
        lines += [f"## {section.key}. {section.title}", ""]
        if section.error:
            lines += [f"**Failed:** `{section.error}`", ""]
        if section.method:
            lines += [section.method, ""]
        for table in section.tables:
            lines += [f"{table.caption}:", ""]
            lines.append("| " + " | ".join(table.columns) + " |")
            lines.append("|" + "---|" * len(table.columns))
            for row in table.rows:
                lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
            lines.append("")
        for note in section.notes:
            lines += [note, ""]
        lines += [f"({section.seconds:.1f} s)", ""]
    return "\n".join(lines)


def _section(sections: list[Section], key: str) -> Section | None:
    for section in sections:
        if section.key == key and section.data:
            return section
    return None


def plot(sections: list[Section], about: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 3, figsize=(16, 13))
    figure.suptitle(
        f"posenc benchmarks ({about['mode']}), {about['cpu_model']} x{about['logical_cpus']}, "
        f"{about['date']}, {about['git_commit']}"
    )
    grid = axes.ravel()
    for ax in grid:
        ax.set_visible(False)

    if (a := _section(sections, "a")) is not None:
        ax = grid[0]
        ax.set_visible(True)
        # The table shapes' entries; the section's other data (per_value) is not plotted.
        shapes = [key for key, value in a.data.items() if "mib_per_s" in value]
        methods = list(a.data[shapes[0]]["mib_per_s"])
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = [a.data[s]["mib_per_s"][method] for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], values, width, label=method)
        ax.set_xticks([x + width for x in range(len(shapes))], shapes)
        top = max(max(a.data[s]["mib_per_s"].values()) for s in shapes)
        ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
        ax.set_ylabel("MiB/s of float32 output")
        ax.set_title("a. engine, cold (from position 1e6)")
        ax.legend(fontsize=8, loc="upper left")

    if (b := _section(sections, "b")) is not None:
        ax = grid[1]
        ax.set_visible(True)
        names = list(b.data["mib_per_s"])
        # One colour per dtype, so that bfloat16 and float16 stand beside float32's bars.
        colors = [
            "C2" if "bfloat16" in n else "C3" if "float16" in n else "C7" if n == "floor" else "C0"
            for n in names
        ]
        ax.bar(names, [b.data["mib_per_s"][n] for n in names], color=colors)
        ax.axhline(b.data["mib_per_s"]["floor"], color="k", linestyle=":", linewidth=1)
        ax.set_ylabel("MiB/s of output")
        ax.set_title("b. get_range 16384x4096 vs raw floor (dotted)")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)

    if (c := _section(sections, "c")) is not None:
        ax = grid[2]
        ax.set_visible(True)
        kinds = list(c.data["p50_s"])
        p50 = [c.data["p50_s"][k] * 1e6 for k in kinds]
        p99 = [c.data["p99_s"][k] * 1e6 for k in kinds]
        ax.bar(kinds, p99, color="C1", alpha=0.35, label="p99")
        ax.bar(kinds, p50, color="C1", label="p50")
        if "mean_s" in c.data:
            mean = [c.data["mean_s"][k] * 1e6 for k in kinds]
            ax.plot(kinds, mean, "k_", markersize=14, label="mean")
        ax.set_yscale("log")
        ax.set_ylabel("microseconds per call")
        ax.set_title("c. decode-step latency, d_model 4096")
        ax.tick_params(axis="x", labelrotation=30, labelsize=6)
        ax.legend(fontsize=8)

    if (d := _section(sections, "d")) is not None:
        ax = grid[3]
        ax.set_visible(True)
        for kind, style in (("posenc", "o-"), ("floor", "s--")):
            series = d.data["median_mib_per_s"][kind]
            xs = [int(n) for n in series]
            ax.plot(xs, list(series.values()), style, label=kind)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("client processes")
        ax.set_ylabel("aggregate MiB/s")
        ax.set_title(f"d. concurrency ({d.data['server_processes']} server process(es))")
        ax.legend(fontsize=8)

    if (e := _section(sections, "e")) is not None and "by_rows" in e.data:
        for ax, key, xlabel in (
            (grid[4], "by_rows", "rows (d_model %d)"),
            (grid[5], "by_d_model", "d_model (fixed bytes per call)"),
        ):
            ax.set_visible(True)
            points = e.data[key]
            xs = [p["rows"] if key == "by_rows" else p["d_model"] for p in points]
            for state, style in (("cold", "o-"), ("warm", "^-"), ("floor", "s--")):
                values = [p["median_s"][state] * 1e3 for p in points]
                if key == "by_d_model":
                    values = [
                        p["bytes"] / MIB / (v / 1e3) for p, v in zip(points, values, strict=True)
                    ]
                ax.plot(xs, values, style, label=state)
            ax.set_xscale("log")
            if key == "by_rows":
                ax.set_yscale("log")
                ax.set_ylabel("ms per get_range")
                ax.set_xlabel(xlabel % points[0]["d_model"])
                ax.set_title("e. time against rows")
            else:
                ax.set_ylim(bottom=0)
                ax.set_ylabel("MiB/s")
                ax.set_xlabel(xlabel)
                ax.set_title("e. throughput against d_model")
            ax.legend(fontsize=8)

    if (e := _section(sections, "e")) is not None and "server_rss" in e.data:
        ax = grid[6]
        ax.set_visible(True)
        rss = e.data["server_rss"]
        timeline = rss["timeline_s_kib"]
        ax.plot([t for t, _ in timeline], [k / 1024 for _, k in timeline], label="server RSS")
        budget = rss["cache_budget_bytes"] / MIB
        ax.axhline(budget, color="C2", linestyle=":", label="cache budget")
        rule = memory.sizing_rule_bytes(rss) / MIB
        ax.axhline(rule, color="C3", linestyle="--", label="sizing rule")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_title(f"e. server RSS while streaming {rss['bytes'] / MIB / 1024:g} GiB")
        ax.legend(fontsize=8)

    if (f := _section(sections, "f")) is not None:
        ax = grid[7]
        ax.set_visible(True)
        get = max(f.data["get_range"], key=lambda r: r["peak_kib"] - r["baseline_kib"])
        it = f.data["iter_range"]
        labels = [
            f"get_range\n{get['bytes'] / MIB:.0f} MiB",
            f"iter_range\n{it['bytes'] / MIB:.0f} MiB",
        ]
        peaks = [(r["peak_kib"] - r["baseline_kib"]) / 1024 for r in (get, it)]
        results = [r["bytes"] / MIB for r in (get, it)]
        ax.bar([0, 1], results, 0.4, label="result size", color="C7")
        ax.bar([0.4, 1.4], peaks, 0.4, label="client peak above baseline", color="C4")
        ax.set_xticks([0.2, 1.2], labels)
        ax.set_ylabel("MiB")
        ax.set_title("f. client peak RSS")
        ax.legend(fontsize=8)

    ax = grid[8]
    ax.set_visible(True)
    ax.axis("off")
    verdicts = [
        f"{s.key} {t.verdict():4} {t.name[:58]}: {t.value:.3g}"
        for s in sections
        for t in s.targets
        if t.op
    ]
    ax.text(0, 1, "\n".join(verdicts), va="top", family="monospace", fontsize=6.5)
    ax.set_title("targets")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
