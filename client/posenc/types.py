"""The public types of the SDK's signatures and results: what methods take and return."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, TypedDict

import numpy.typing as npt

from posenc.spec import Spec, enum_name
from posenc_protocol.stats import CacheStats
from posenc_protocol.v1 import posenc_pb2 as pb

if TYPE_CHECKING:
    # Only named in annotations: posenc never imports torch unless the caller passes it.
    from torch import dtype as TorchDType
else:
    TorchDType = Any

__all__ = [
    "DEFAULT",
    "CacheStats",
    "ClassicOptions",
    "DTypeArg",
    "Limits",
    "ServerInfo",
    "Table",
    "TableKind",
    "TableParameter",
    "Timeout",
]


class _Default(enum.Enum):
    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:
        return "<client default>"


#: Sentinel of per-call ``timeout=`` arguments: use the client's default timeout.
DEFAULT: Final = _Default.DEFAULT
#: A per-call ``timeout=``: seconds for the whole call, ``None`` for none, or ``DEFAULT``.
Timeout: TypeAlias = float | Literal[_Default.DEFAULT] | None
#: A ``dtype=``: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``, a numpy dtype, or
#: a torch dtype (which makes the result a ``torch.Tensor``).
DTypeArg: TypeAlias = str | npt.DTypeLike | TorchDType
#: What a table method's ``table`` is: the ``d_model`` of the classic sinusoidal table, or a
#: :class:`posenc.Spec`.
Table: TypeAlias = int | Spec


class ClassicOptions(TypedDict, total=False):
    """The keyword options of the classic table, allowed only when ``table`` is an int.

    ``base``: the frequency base (server default 10000); ``layout``: ``"interleaved"`` or
    ``"split"``; ``schedule``: ``"paper"`` or ``"tensor2tensor"``. They are the fields of
    ``SinusoidalTable``; a :class:`posenc.Spec` of kind ``"sinusoidal"`` takes the same.
    """

    base: float
    layout: str
    schedule: str


@dataclass(frozen=True)
class Limits:
    """Limits a server enforces; requests beyond them are refused."""

    max_d_model: int
    max_abs_position: int
    max_positions: int
    max_unary_bytes: int
    max_stream_bytes: int
    max_chunk_bytes: int
    max_receive_message_bytes: int


@dataclass(frozen=True)
class TableParameter:
    """A parameter of a table kind: its request field (``"spec.rotary.yarn.factor"``),
    meaning and default (empty: required)."""

    field: str
    description: str
    default: str


@dataclass(frozen=True)
class TableKind:
    """A table kind a server serves (``"whisper"``, ``"rotary"``, ``"rotary.yarn"`` for a
    scaling), and its parameters."""

    name: str
    description: str
    parameters: tuple[TableParameter, ...]


@dataclass(frozen=True)
class ServerInfo:
    """What ``server_info()`` returns: one server's description and counters."""

    version: str
    server_id: str
    limits: Limits
    dtypes: tuple[str, ...]
    cache: CacheStats
    rows_computed: int
    table_kinds: tuple[TableKind, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (nested dataclasses become dictionaries)."""
        return dataclasses.asdict(self)


def _fields_of(message: Any, cls: type[Any]) -> dict[str, Any]:
    # The dataclass's fields are the message's, by name.
    return {field.name: getattr(message, field.name) for field in dataclasses.fields(cls)}


def server_info_from_proto(response: pb.GetServerInfoResponse) -> ServerInfo:
    """The :class:`ServerInfo` of a ``GetServerInfoResponse``."""
    return ServerInfo(
        version=response.version,
        server_id=response.server_id,
        limits=Limits(**_fields_of(response.limits, Limits)),
        dtypes=tuple(enum_name(pb.Dtype.DESCRIPTOR, value) for value in response.dtypes),
        cache=CacheStats(**_fields_of(response.cache, CacheStats)),
        rows_computed=response.rows_computed,
        table_kinds=tuple(
            TableKind(
                name=kind.name,
                description=kind.description,
                parameters=tuple(
                    TableParameter(p.field, p.description, p.default) for p in kind.parameters
                ),
            )
            for kind in response.table_kinds
        ),
    )
