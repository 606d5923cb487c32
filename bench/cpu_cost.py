"""Server CPU per returned byte for small requests that used to cost a lot (issue 10, item 9).

Two cases, each request new to the server:

- ``scattered``: GetEncoding of 64 scattered positions of a d_model 1 float16 table (128
  bytes), random over +-2**42 so that no block is cached;
- ``new theta``: GetEncoding of one row of a rotary table with head_dim 32,768 (256 KiB),
  with a new rope_theta each call, so that every call sets up a new spec.

The server of this checkout and, with ``--baseline REF``, the server of that git ref (a
temporary worktree, on the same Python and packages) run side by side, one process each, and
the calls alternate between them; the figure is the server process's CPU seconds (user +
system, from /proc) per returned byte, median of ``--rounds`` rounds.

    .venv/bin/python -m bench.cpu_cost --baseline 7f0cc82 [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench.common import REPO, cpu_seconds, median
from bench.procs import ServerProcess, install_cleanup
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc

import grpc  # isort: skip

Call = Callable[[posenc_pb2_grpc.PositionalEncodingServiceStub, int], int]


def scattered(stub: posenc_pb2_grpc.PositionalEncodingServiceStub, serial: int) -> int:
    positions = np.random.default_rng(serial).integers(-(2**42), 2**42, 64).tolist()
    spec = pb.EncodingSpec(dtype=pb.DTYPE_FLOAT16, sinusoidal=pb.SinusoidalTable(d_model=1))
    request = pb.GetEncodingRequest(spec=spec, positions=pb.PositionList(positions=positions))
    return len(stub.GetEncoding(request, timeout=600).tensor.data)


def new_theta(stub: posenc_pb2_grpc.PositionalEncodingServiceStub, serial: int) -> int:
    spec = pb.EncodingSpec(
        rotary=pb.RotaryTable(
            head_dim=32768, rope_theta=10000.0 + serial, layout=pb.ROPE_LAYOUT_VLLM
        )
    )
    request = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=0, stop=1))
    return len(stub.GetEncoding(request, timeout=600).tensor.data)


CASES: dict[str, tuple[Call, int]] = {"scattered": (scattered, 20), "new theta": (new_theta, 4)}
"""Each case and its calls per round."""


@contextlib.contextmanager
def baseline_tree(ref: str) -> Iterator[Path]:
    """A temporary git worktree of ``ref``."""
    with tempfile.TemporaryDirectory(prefix="posenc-baseline-") as directory:
        path = Path(directory) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(path), ref], cwd=REPO, check=True
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False
            )


def start(tree: Path | None) -> ServerProcess:
    """A one-process server of ``tree`` (None: this checkout) on a free port."""
    saved = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tree / "server"), str(tree / "client")])
    try:
        argv = [sys.executable, "-m", "posenc_server", "--port", "0", "--processes", "1"]
        return ServerProcess("posenc", [*argv, "--metrics-port", "-1"]).wait_ready()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref of the server to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cpu_cost.md")
    arguments = parser.parse_args()
    install_cleanup()
    with contextlib.ExitStack() as stack:
        servers = {"this checkout": start(None)}
        if arguments.baseline:
            tree = stack.enter_context(baseline_tree(arguments.baseline))
            servers[f"baseline {arguments.baseline}"] = start(tree)
        stubs = {}
        for name, server in servers.items():
            channel = stack.enter_context(grpc.insecure_channel(server.target))
            stubs[name] = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        samples: dict[tuple[str, str], list[float]] = {}
        serial = 0
        for _ in range(arguments.rounds):
            for case, (call, calls) in CASES.items():
                for name, server in servers.items():  # alternating, same inputs
                    before = cpu_seconds(server.pids())
                    returned = sum(call(stubs[name], serial + i) for i in range(calls))
                    spent = cpu_seconds(server.pids()) - before
                    samples.setdefault((case, name), []).append(spent / returned)
                serial += calls
    lines = [
        "# Server CPU per returned byte (issue 10, item 9)",
        "",
        f"`python -m bench.cpu_cost {' '.join(sys.argv[1:])}`; median of {arguments.rounds}"
        " rounds (min .. max); load average at the end "
        f"{os.getloadavg()[0]:.1f}",
        "",
        "| case | server | CPU ns per returned byte | per call |",
        "|---|---|---:|---|",
    ]
    for (case, name), values in samples.items():
        call_bytes = 128 if case == "scattered" else 32768 * 4
        lines.append(
            f"| {case} | {name} | {median(values) * 1e9:,.0f} ({min(values) * 1e9:,.0f} .. "
            f"{max(values) * 1e9:,.0f}) | {median(values) * call_bytes * 1e3:.2f} ms CPU for "
            f"{call_bytes:,} bytes |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    arguments.out.write_text(report)


if __name__ == "__main__":
    main()
