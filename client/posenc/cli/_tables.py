"""The table arguments of ``fetch`` and ``plot``, derived from the descriptors of the table
kinds (``--table``, the classic table's flags, ``--param``, ``--rope-config``), the Spec they
make, and how a server's refusal of a parameter is said in their terms."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from posenc._query import DTYPE_NAMES
from posenc.cli._shared import _usage_error
from posenc.errors import InvalidArgumentError
from posenc.spec import (
    Spec,
    cases,
    choice_oneofs,
    enum_names,
    kind_message,
    kind_names,
    parameter_fields,
)
from posenc_protocol.descriptors import INTEGER_RANGES, REALS

# The classic table's fields are flags of their own (--d-model, --base, --layout, ...); they
# also set the field of that name of another --table that has one (--d-model of whisper).
_CLASSIC_KIND = "sinusoidal"


def _flag(field: FieldDescriptor) -> str:
    return "--" + field.name.replace("_", "-")


def _parse_scalar(field: FieldDescriptor, text: str) -> object:
    """A flag's text as a value of ``field``'s type (the Spec checks enum names)."""
    cpp_type = field.cpp_type
    if cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field.name} must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    try:
        if cpp_type in INTEGER_RANGES:
            return int(text)
        if cpp_type in REALS:
            return float(text)
    except ValueError:
        kind = "an integer" if cpp_type in INTEGER_RANGES else "a number"
        raise ValueError(f"{field.name} must be {kind}, got {text!r}") from None
    return text


def _parse_value(field: FieldDescriptor, text: str) -> object:
    if field.is_repeated:  # comma-separated
        return [_parse_scalar(field, part.strip()) for part in text.split(",") if part.strip()]
    return _parse_scalar(field, text)


class _FlagValue:
    """The ``type=`` of a table field's flag: its text as the field's value, or a usage
    error that says what the flag takes (argparse names the function otherwise)."""

    def __init__(self, field: FieldDescriptor) -> None:
        self.field = field

    def __call__(self, text: str) -> object:
        try:
            return _parse_value(self.field, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


def _parameters_of(kind: str) -> dict[str, FieldDescriptor | None]:
    """What ``--param`` takes for ``kind``: its fields, its oneofs (None: a name), and the
    fields of each oneof's messages."""
    message = kind_message(kind)
    known: dict[str, FieldDescriptor | None] = {f.name: f for f in parameter_fields(message)}
    for oneof in choice_oneofs(message):
        known[oneof.name] = None
        for case in cases(oneof).values():
            assert case.message_type is not None
            known.update((f.name, f) for f in case.message_type.fields)
    return known


def _classic_options(field: FieldDescriptor) -> dict[str, Any]:
    """The argparse options of the classic table's flag for ``field``."""
    options: dict[str, Any] = {"default": None, "help": f"the table's {field.name}"}
    if field.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
        assert field.enum_type is not None
        options["choices"] = tuple(enum_names(field.enum_type))
        options["help"] += f" (default: {options['choices'][0]})"
    else:
        options["type"] = _FlagValue(field)
        options["metavar"] = "N" if field.cpp_type in INTEGER_RANGES else "X"
        if field.has_presence:
            options["help"] += " (default: the server's)"
    return options


def _add_table_arguments(fetch: argparse.ArgumentParser) -> None:
    """The table flags of ``fetch``, from the descriptors of the table kinds."""
    table = fetch.add_argument_group(
        "table",
        "The classic sinusoidal table by default, whose fields are the flags below;\n"
        "any other kind with --table KIND and --param NAME=VALUE (posenc info lists them).",
    )
    table.add_argument(
        "--table",
        choices=kind_names(),
        default=None,
        metavar="KIND",
        help=f"the table kind: {', '.join(kind_names())} (default: {_CLASSIC_KIND})",
    )
    for field in parameter_fields(kind_message(_CLASSIC_KIND)):
        table.add_argument(_flag(field), dest=f"classic_{field.name}", **_classic_options(field))
    table.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter of the --table kind, e.g. padding_idx=1, scaling=yarn, factor=8.0, "
        "short_factor=1.0,1.1,... (repeatable)",
    )
    table.add_argument(
        "--rope-config",
        type=Path,
        metavar="CONFIG_JSON",
        help="a transformers config.json: its rotary table (implies --table rotary; "
        "--param values override the config's)",
    )
    table.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=DTYPE_NAMES[0],
        help=f"element type (default: {DTYPE_NAMES[0]})",
    )


def _table_given(args: argparse.Namespace) -> bool:
    """Whether any table flag was given (``plot`` has a default table per figure)."""
    classic = parameter_fields(kind_message(_CLASSIC_KIND))
    return (
        args.table is not None
        or args.rope_config is not None
        or bool(args.param)
        or any(getattr(args, f"classic_{field.name}") is not None for field in classic)
    )


def _table(args: argparse.Namespace) -> Spec:
    """The table of a fetch (or plot): --table, the classic flags, --param, --rope-config."""
    kind = args.table or ("rotary" if args.rope_config is not None else _CLASSIC_KIND)
    if args.rope_config is not None and kind != "rotary":
        raise _usage_error("--rope-config goes with --table rotary", args.command)
    known = _parameters_of(kind)
    values: dict[str, object] = {}
    for field in parameter_fields(kind_message(_CLASSIC_KIND)):
        value = getattr(args, f"classic_{field.name}")
        if value is None:
            continue
        if field.name not in known:
            raise _usage_error(f"{_flag(field)} does not apply to --table {kind}", args.command)
        values[field.name] = value
    for item in args.param:
        name, sep, text = item.partition("=")
        if not sep or name not in known:
            raise _usage_error(
                f"--param {item!r}: expected NAME=VALUE with NAME one of {', '.join(known)}",
                args.command,
            )
        parameter = known[name]
        values[name] = text if parameter is None else _parse_value(parameter, text)
    if args.rope_config is not None:
        config = json.loads(args.rope_config.read_text())
        # No --param layout: the family's own (GPT-J's is "gptj"), as Spec.from_config reads it.
        layout = values.get("layout")
        spec = Spec.from_config(config, layout=None if layout is None else str(layout))
        return Spec(spec.kind, **{**spec.parameters, **values})
    if kind == _CLASSIC_KIND and "d_model" not in values:
        raise _usage_error("--d-model is required (or another --table)", args.command)
    return Spec(kind, **values)


def _explain(error: Exception, args: argparse.Namespace) -> str:
    """The line a failure is reported with. A parameter the user never set reaches the
    server as 0 (proto3 sends no "unset"), and its refusal says "got 0": said here as not
    set, with the flag that sets it."""
    if not isinstance(error, InvalidArgumentError) or not error.field_violations:
        return str(error)
    given = _given_parameters(args)
    parts = []
    for field, description in error.field_violations:
        name = field.rpartition(".")[2]
        unset = re.search(r",? got 0(\.0)?( \(or not set\))?$", description)
        if unset is not None and name not in given and field.startswith("spec."):
            flag = f"--param {name}=VALUE"
            if args.command in ("fetch", "plot") and name in _classic_names():
                flag = _flag_of(name)
            description = f"not set ({description[: unset.start()]}): give it with {flag}"
        parts.append(f"{field}: {description}")
    return f"{error.code.name}: {'; '.join(parts)}"


def _classic_names() -> set[str]:
    return {field.name for field in parameter_fields(kind_message(_CLASSIC_KIND))}


def _flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given_parameters(args: argparse.Namespace) -> set[str]:
    """The table parameters the command line set (flags, --param, --rope-config's)."""
    given = {item.partition("=")[0] for item in getattr(args, "param", None) or ()}
    given |= {
        name for name in _classic_names() if getattr(args, f"classic_{name}", None) is not None
    }
    if getattr(args, "rope_config", None) is not None:
        with contextlib.suppress(Exception, SystemExit):  # read before, so it reads
            given |= set(_table(args).parameters)
    return given
