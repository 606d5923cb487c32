"""What every table kind is: the engine's ``Table`` plus its name, documentation and checks.

A table kind is a frozen dataclass whose fields are exactly the fields of its message in
``posenc.v1`` (an unset optional field is the dataclass default), so that ``convert`` builds
it from a request generically and the kind is the whole cache key of its rows. It is declared
by ``declared`` (its name and description) over fields made by ``parameter`` (each with its
documentation), so each is said once, where the field is. Kinds with a ``oneof`` of
sub-messages (rotary's scaling) list the classes of its cases in ``VARIANTS``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, dataclass_transform

from posenc_server import engine
from posenc_server.errors import FieldViolation

# Positions after a kind's offset stay where float64 holds them exactly.
MAX_MAPPED_POSITION = 1 << 52
# The largest angle (radians) a frequency may reach at an accepted position: the engine's
# double-double turns keep 2**-106 of it, so the angle stays within 2**-53 of exact.
MAX_ANGLE = float(1 << 52)


def max_frequency(limits: Limits, offset: int = 0) -> float:
    """The largest angular frequency whose angle at every accepted position (shifted by up to
    ``offset``) stays within ``MAX_ANGLE``: 1024 with the default 2**42 position limit."""
    return MAX_ANGLE / max(limits.max_abs_position + abs(offset), 1)


class Limits(Protocol):
    """The server limits a kind's validation needs (``ServerConfig`` has them)."""

    @property
    def max_d_model(self) -> int:
        """Widest accepted row."""
        ...

    @property
    def max_abs_position(self) -> int:
        """Largest accepted |position|."""
        ...


@dataclass(frozen=True)
class Doc:
    """What GetServerInfo says about a parameter: its meaning and default (empty: required)."""

    description: str
    default: str = ""


BASE = Doc("frequency base, finite and > 1", "10000")
"""The documentation of a geometric schedule's base (``rope_theta``, ``base``)."""


class Documented(abc.ABC):
    """A table kind or a variant of one: its proto field name and its documentation, which
    ``declared`` sets."""

    NAME: ClassVar[str]
    """The field of the message that selects it (``EncodingSpec.table``'s, or a oneof's)."""
    DESCRIPTION: ClassVar[str]
    PARAMETERS: ClassVar[Mapping[str, Doc]]
    """Every field of its message by name, except the ``VARIANTS`` cases."""
    VARIANTS: ClassVar[Mapping[str, Mapping[str, type[Documented]]]] = {}
    """Per oneof of sub-messages: the class of each case, by field name."""
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    """Every one is a dataclass (``declared``)."""


T = TypeVar("T")
D = TypeVar("D", bound=Documented)
_DOC = "posenc.doc"


def parameter(default: T, doc: Doc | str, shown: str | None = None) -> T:
    """A field of a kind's message, with what GetServerInfo says of it: ``doc`` (``shown``,
    when given, is the default it names in place of ``doc``'s)."""
    if isinstance(doc, str):
        doc = Doc(doc, shown or "")
    elif shown is not None:
        doc = Doc(doc.description, shown)
    return field(default=default, metadata={_DOC: doc})


@dataclass_transform(frozen_default=True)
def declared(name: str, description: str) -> Callable[[type[D]], type[D]]:
    """Declare a table kind or a variant: a frozen dataclass, selected by the field ``name``
    and described by ``description``; its ``PARAMETERS`` are the docs of its ``parameter``
    fields, in field order (the message's)."""

    def declare(cls: type[D]) -> type[D]:
        kind = dataclass(frozen=True)(cls)
        kind.NAME, kind.DESCRIPTION = name, description
        kind.PARAMETERS = {
            f.name: f.metadata[_DOC] for f in dataclasses.fields(kind) if _DOC in f.metadata
        }
        return kind

    return declare


class TableKind(Documented):
    """A table kind: the engine's ``Table`` (width, position map, waves, columns) and the
    validation of its own parameters."""

    AXES: ClassVar[int] = 1
    """Position axes of a row: more than one for ``engine.AxisTable`` kinds, whose rows
    a ``CoordinateList`` of that many axes selects."""

    @property
    @abc.abstractmethod
    def width(self) -> int:
        """Columns of a row."""

    @property
    def position_map(self) -> engine.PositionMap:
        """Row ``p`` is the wave table's row ``p`` unless a kind says otherwise."""
        return IDENTITY

    @abc.abstractmethod
    def waves(self) -> engine.Waves:
        """The exact frequencies, to ``engine.PRECISION`` digits (costly: call once)."""

    @abc.abstractmethod
    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """Write rows of ``v = sin + i cos`` into ``target`` in this kind's column order."""

    def validate(self, path: str, limits: Limits) -> list[FieldViolation]:
        """Every problem of the parameters, named ``{path}.{field}`` (``path`` is the
        kind's message, e.g. ``spec.rotary``). The engine may run the kind when empty."""
        check = Checker(path)
        self.check(check, limits)
        return check.violations

    @abc.abstractmethod
    def check(self, check: Checker, limits: Limits) -> None:
        """Add every problem of the parameters to ``check`` (``validate``)."""


IDENTITY = engine.PositionMap()


def footprint(value: object) -> int:
    """Approximately the bytes a table kind's parameters hold (a longrope spec's two lists
    of 32,768 floats: 2 MiB), for the spec table's budget."""
    if isinstance(value, tuple):
        # The tuple's pointers, and a float object (24 bytes) per element.
        return 56 + 32 * len(value)
    if dataclasses.is_dataclass(value):
        return 64 + sum(footprint(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 32


def number(value: float) -> str:
    """``value`` short (``%g``) when that is exact, else in full."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


@dataclass
class Checker:
    """Collects the violations of one message's fields (``path`` names the message)."""

    path: str
    violations: list[FieldViolation] = field(default_factory=list)

    def add(self, name: str, description: str) -> None:
        """A problem of field ``name``."""
        self.violations.append(FieldViolation(f"{self.path}.{name}", description))

    def nested(self, name: str) -> Checker:
        """A checker of the sub-message ``name`` that adds to the same violations."""
        return Checker(f"{self.path}.{name}", self.violations)

    def real(
        self,
        name: str,
        value: float | None,
        low: float,
        *,
        strict: bool = True,
        high: float = math.inf,
    ) -> bool:
        """Check that ``value`` (None: unset, valid) is finite, > ``low`` (>= unless
        ``strict``) and <= ``high``; returns whether it is valid."""
        if value is None:
            return True
        if (
            math.isfinite(value)
            and (value > low or (not strict and value == low))
            and value <= high
        ):
            return True
        relation = ">" if strict else ">="
        upper = "" if high == math.inf else f" and <= {number(high)}"
        # proto3 sends an unset number as 0: the caller may not have given it at all.
        got = f"{value!r} (or not set)" if value == 0 else repr(value)
        self.add(name, f"must be finite, {relation} {number(low)}{upper}, got {got}")
        return False

    def between(
        self, name: str, value: int | None, low: int, high: int, high_text: str = ""
    ) -> bool:
        """Check that ``low <= value <= high`` (None: unset, valid)."""
        if value is None or low <= value <= high:
            return True
        self.add(name, f"must be between {low} and {high_text or high}, got {value}")
        return False

    def one_of(self, name: str, value: str, known: Mapping[str, object]) -> bool:
        """Check that ``value`` is one of the names ``known`` supports."""
        if value in known:
            return True
        self.add(name, f"unknown value {value!r}; known: {', '.join(known)}")
        return False
