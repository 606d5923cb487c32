"""A fresh client process, for section s: ``python -m bench.fresh_client MODE TARGET ...``.

``import``: times ``import posenc`` (or, ``import-floor``, ``import grpc, numpy``) and prints
the seconds. ``call``: imports posenc, makes a client of ``TARGET``, connects it (its
GetServerInfo), then times its first table call, ``get_range(START, START + ROWS, D_MODEL,
dtype=DTYPE)`` into an array allocated and touched before; ``floor``: the same for the
floor's stream of the same bytes. Prints ``import construct first`` seconds, one line.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "import":
        t0 = time.perf_counter()
        import posenc

        print(time.perf_counter() - t0)
        return 0
    if mode == "import-floor":
        t0 = time.perf_counter()
        import grpc  # noqa: F401
        import numpy  # noqa: F401

        print(time.perf_counter() - t0)
        return 0
    target, dtype, rows, d_model, start = argv[1], argv[2], *map(int, argv[3:6])
    itemsize = 8 if dtype == "float64" else 4 if dtype == "float32" else 2
    t0 = time.perf_counter()
    if mode == "floor":
        import numpy as np

        from bench.floor import FloorClient

        t1 = time.perf_counter()
        floor = FloorClient(target)
        floor.wait_ready()
        floor.touch(rows * d_model * itemsize)
        t2 = time.perf_counter()
        floor.get(rows * d_model * itemsize)
        t3 = time.perf_counter()
        floor.close()
    else:
        import numpy as np

        import posenc

        t1 = time.perf_counter()
        client = posenc.Client(target, timeout=600.0)
        client.server_info()
        # The result's memory, touched as the floor's is: the call's own cost is measured.
        # (np.dtype("bfloat16") is known once a client is made: ml_dtypes is loaded.)
        out = np.ones((rows, d_model), dtype=f"u{itemsize}").view(np.dtype(dtype))
        t2 = time.perf_counter()
        client.get_range(start, start + rows, d_model, dtype=dtype, out=out)
        t3 = time.perf_counter()
        client.close()
    print(t1 - t0, t2 - t1, t3 - t2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
