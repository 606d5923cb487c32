"""``posenc info``: describe the server: version, limits, cache, table kinds."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Sequence
from typing import Final

from posenc.cli._shared import (
    EXIT_OK,
    _add_client_arguments,
    _client,
    _Command,
    _first_answer,
    _targets,
)
from posenc.errors import PosencError
from posenc.spec import (
    choice_oneofs,
    kind_message,
)
from posenc.types import TableKind

COMMAND: Final = _Command("describe the server: version, limits, cache")


# -- info, health -----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    with _client(args, _targets(args)) as client:
        info = _first_answer(client, args, args.timeout)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return EXIT_OK
    print(f"version:       {info.version}")
    print(f"server_id:     {info.server_id}")
    print(f"dtypes:        {', '.join(info.dtypes)}")
    # Named as fetch takes them: --table KIND, and a variant of a kind (rotary.yarn) with
    # --param ONEOF=NAME (scaling=yarn).
    names = [kind.name for kind in info.table_kinds]
    print(f"table kinds:   {', '.join(n for n in names if '.' not in n)} (fetch --table KIND)")
    for kind in dict.fromkeys(n.partition(".")[0] for n in names if "." in n):
        variants = [n.partition(".")[2] for n in names if n.startswith(kind + ".")]
        with contextlib.suppress(PosencError):
            for oneof in choice_oneofs(kind_message(kind)):
                print(
                    f"  {kind} {oneof.name}: {', '.join(variants)} "
                    f"(--table {kind} --param {oneof.name}=NAME)"
                )
    print(f"rows_computed: {info.rows_computed:,}")
    for title, section in (("limits", info.limits), ("cache", info.cache)):
        print(f"{title}:")
        for name, value in vars(section).items():
            print(f"  {name + ':':<27}{value:,}")
    _print_parameters(info.table_kinds)
    return EXIT_OK


def _print_parameters(kinds: Sequence[TableKind]) -> None:
    """Each kind's parameters, named as ``fetch --param`` takes them, with their defaults
    (none: required) and meaning."""
    print("parameters:   (fetch --table KIND --param NAME=VALUE; no default: required)")
    for kind in kinds:
        print(f"  {kind.name}: {kind.description}")
        for parameter in kind.parameters:
            name = parameter.field.rpartition(".")[2]
            default = f"= {parameter.default}" if parameter.default else "(required)"
            print(f"    {name:<33} {default:<14} {parameter.description}")


def add_arguments(info: argparse.ArgumentParser) -> None:
    """The ``info`` command's arguments."""
    info.add_argument("--json", action="store_true", help="print JSON")
    _add_client_arguments(info, timeout=10.0)
