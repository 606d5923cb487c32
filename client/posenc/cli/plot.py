"""``posenc plot``: draw a figure of the tables into a .png or .svg."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Final

from posenc.cli._shared import (
    EXIT_OK,
    EXIT_USAGE,
    _add_client_arguments,
    _client,
    _Command,
    _first_answer,
    _install_command,
    _positive_float,
    _targets,
)
from posenc.cli._tables import _add_table_arguments, _table, _table_given
from posenc.cli._writer import _check_output
from posenc.plot import BASES, FIGURES, default_spec, figure, render


def _bases(text: str) -> list[float]:
    values = [_positive_float(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated bases, e.g. 100,1e4")
    return values


# -- plot -------------------------------------------------------------------------------

_PLOT_FORMATS = (".png", ".svg")


_PLOT_EPILOG = """\
Figures (posenc.plot has the functions that return each figure's data):
  drift         largest error per position, 1 to 2**42: posenc's --dtype table, the naive
                float32 position * div_term table and, for rotary tables with transformers
                installed, LlamaRotaryEmbedding's, against exact values (mpmath)
                (default: --d-model 512; also --table tensor2tensor, whisper, fairseq with
                an even --d-model, and --table rotary without scaling)
  rope-scaling  inverse frequency per index of default, linear, dynamic, yarn, llama3 and
                longrope scalings of a rotary table (default: head_dim 128, theta 500000)
  heatmap       rows [0, 256) of the table and each row's distance to its nearest other
  rotation      max |PE(p + k) - R(k) PE(p)| over p, R(k) from the row at position k
  similarity    cosine similarity of PE(p) and PE(p + k) against k, for --bases
  wavelength    2 pi / inv_freq per pair of columns, for --bases
The sinusoidal figures take the classic table's --d-model (default 128) and --base.
"""


COMMAND: Final = _Command(
    "draw a figure of the tables into a .png or .svg (needs the [plot] extra)",
    "Draw figure KIND of a table, from a server's rows, into a .png or .svg.",
    _PLOT_EPILOG,
)


def run(args: argparse.Namespace) -> int:
    spec = _table(args) if _table_given(args) else default_spec(args.kind)
    _check_output(args.output, _PLOT_FORMATS, "plot")
    try:  # the [plot] extra, checked before connecting
        import matplotlib  # noqa: F401
        import mpmath  # noqa: F401
    except ImportError as error:
        print(
            f"posenc plot: needs the module {error.name}, which is not installed.\n"
            f"Install it with: {_install_command('plot')}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    with _client(args, _targets(args)) as client:
        _first_answer(client, args, args.timeout)
        drawn = figure(args.kind, client, spec, bases=args.bases, dtype=args.dtype)
    render(drawn, args.output)
    print(f"posenc plot: wrote {args.kind} of {spec!r} to {args.output}", file=sys.stderr)
    return EXIT_OK


def add_arguments(plot: argparse.ArgumentParser) -> None:
    """The ``plot`` command's arguments."""
    plot.add_argument("kind", choices=tuple(FIGURES), metavar="KIND", help=", ".join(FIGURES))
    _add_table_arguments(plot)
    plot.add_argument(
        "--bases",
        type=_bases,
        default=list(BASES),
        metavar="B1,B2,...",
        help="the bases of similarity and wavelength (default: "
        + ",".join(f"{base:g}" for base in BASES)
        + ")",
    )
    plot.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        help=f"the file to write; its suffix chooses the format: {', '.join(_PLOT_FORMATS)}",
    )
    _add_client_arguments(plot, timeout=120.0)
