"""A fresh client process whose peak RSS is the measurement (section f).

``python -m bench.memory_client TARGET {get_range|iter_range} START ROWS D_MODEL`` connects,
takes its baseline RSS (imports done, channel connected), resets its peak (VmHWM) where the
kernel allows, runs the call and prints one JSON line: baseline, peak and timings in KiB / s.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import posenc
from bench.common import proc_status_kib, reset_peak_rss


def main(argv: list[str]) -> int:
    target, mode, start, rows, d_model = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    with posenc.Client(target, timeout=None) as client:
        client.server_info()
        client.get_range(0, 8, d_model)  # both call paths warmed up before the baseline
        gc.collect()
        reset = reset_peak_rss()
        baseline = proc_status_kib("self", "VmRSS")
        hwm_before = proc_status_kib("self", "VmHWM")
        t0 = time.perf_counter()
        received = 0
        if mode == "get_range":
            table = client.get_range(start, start + rows, d_model, timeout=None)
            received = table.nbytes
            del table
        elif mode == "iter_range":
            for _, chunk in client.iter_range(start, start + rows, d_model, timeout=None):
                received += chunk.nbytes
        else:
            raise SystemExit(f"unknown mode {mode}")
        seconds = time.perf_counter() - t0
        peak = proc_status_kib("self", "VmHWM")
    print(
        json.dumps(
            {
                "mode": mode,
                "bytes": received,
                "seconds": seconds,
                "baseline_kib": baseline,
                "hwm_before_kib": hwm_before,
                "peak_kib": peak,
                "peak_reset": reset,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
