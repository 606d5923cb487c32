"""Draws the pictures of the README and the docs: ``make plots``.

Starts a posenc server on a free loopback port, in this process, and runs
``posenc plot KIND ... -o DIRECTORY/NAME.png`` against it for each picture.
"""

from __future__ import annotations

import sys
from pathlib import Path

from posenc.cli import main
from posenc_server.app import start_server
from posenc_server.config import ServerConfig

# Each picture: its file name and the `posenc plot` arguments that draw it.
PICTURES: dict[str, list[str]] = {
    "drift-sinusoidal": ["drift", "--d-model", "512"],
    "drift-rotary": [
        "drift",
        "--table",
        "rotary",
        "--param",
        "head_dim=128",
        "--param",
        "rope_theta=500000",
    ],
    "rope-scaling": ["rope-scaling"],
    "heatmap": ["heatmap"],
    "rotation": ["rotation"],
    "similarity": ["similarity"],
    "wavelength": ["wavelength"],
    "table-rotary-axes": ["table"],
    "grid-drift": ["grid-drift"],
}


def run(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    running = start_server(ServerConfig(port=0, metrics_port=-1))
    try:
        for name, arguments in PICTURES.items():
            output = directory / f"{name}.png"
            code = main(["plot", *arguments, "--target", running.target, "-o", str(output)])
            if code:
                return code
    finally:
        running.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1] if len(sys.argv) > 1 else "pictures")))
