"""The spec table: serialized ``EncodingSpec`` bytes -> the validated spec, ready to run.

It is the server's only memo of specs. Decode loops send the same spec over and over: a
known spec costs one dictionary lookup, and its table kind's waves (the exact frequencies
and the block rotation table, the costly part) are computed once, when the spec is first
seen, and live as long as the entry. Specs that differ only in bytes (a default set
explicitly, another field order) share one ``Spec``, so their cached rows are shared too.

The table is bounded: beyond ``max_entries`` keys or ``max_bytes`` of entries (a wide
table's rotation table takes up to 4 MiB) the least recently used entry is forgotten (a
forgotten spec is resolved again on its next request, with a new ``serial``; the service's
blocks of the old one age out of its cache). The newest entry always stays.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from posenc_server import engine
from posenc_server.errors import InvalidRequestError
from posenc_server.requests import Query, Selection
from posenc_server.tables import Limits, TableKind
from posenc_server.tables.base import footprint

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 16 << 20
# A dictionary slot, the key object and the Spec around its encoding, roughly.
_ENTRY_OVERHEAD = 256


@dataclass(frozen=True, eq=False)
class Spec:
    """A validated spec: its table kind prepared to run, and what responses need."""

    name: str
    """The ``EncodingSpec.table`` field of its kind; violations are named below ``spec.{name}``."""
    encoding: engine.Encoding
    dtype_code: int
    """The ``posenc.v1.Dtype`` number responses carry."""
    serial: int
    """Unique per ``Spec`` of this table, never reused: a short cache key for its rows."""

    @property
    def width(self) -> int:
        """Columns of a row."""
        return self.encoding.width

    @property
    def row_bytes(self) -> int:
        """Bytes of a row."""
        return self.encoding.row_bytes

    @property
    def nbytes(self) -> int:
        """Approximately the memory it holds: the waves and the table kind's parameters."""
        return self.encoding.nbytes + footprint(self.encoding.table)


@dataclass(frozen=True)
class Request:
    """A request whose spec and selection are valid."""

    spec: Spec
    selection: Selection
    max_chunk_bytes: int


class SpecTable:
    """Interns specs by their serialized bytes; thread-safe."""

    def __init__(
        self,
        limits: Limits,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._limits = limits
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._by_key: OrderedDict[bytes, Spec] = OrderedDict()
        # Specs by value, as long as some key (or a request in flight) holds them.
        self._by_value: weakref.WeakValueDictionary[tuple[TableKind, str], Spec] = (
            weakref.WeakValueDictionary()
        )
        self._bytes = 0
        self._serials = itertools.count()
        self._lock = threading.Lock()

    def resolve(self, query: Query) -> Request:
        """The valid request of ``query``, or InvalidRequestError naming every problem."""
        spec = self._lookup(query.spec_key)
        if spec is None or query.violations:
            spec = self._intern(query)
        assert query.selection is not None  # _intern raised otherwise
        return Request(spec, query.selection, query.max_chunk_bytes)

    def known(self, query: Query) -> Request | None:
        """The request of ``query`` if its spec is remembered and the query is valid (a
        lookup: nothing is validated or prepared); None otherwise."""
        if query.violations or query.selection is None:
            return None
        spec = self._lookup(query.spec_key)
        return None if spec is None else Request(spec, query.selection, query.max_chunk_bytes)

    def _lookup(self, key: bytes) -> Spec | None:
        with self._lock:
            spec = self._by_key.get(key)
            if spec is not None:
                self._by_key.move_to_end(key)
            return spec

    def _intern(self, query: Query) -> Spec:
        """Validate the query's spec and remember it (when the whole query is valid)."""
        violations = list(query.violations)
        table = query.table
        name = "" if table is None else table.NAME
        if table is not None:
            violations[:0] = table.validate(f"spec.{name}", self._limits)
        if violations:
            raise InvalidRequestError(violations)
        assert table is not None
        value = (table, query.dtype)
        with self._lock:
            spec = self._by_value.get(value)
        if spec is None:
            # Outside the lock: the waves of a wide table take a while. Two threads may
            # both compute them; the first to store wins.
            encoding = engine.Encoding.prepare(table, query.dtype)
            with self._lock:
                spec = self._by_value.get(value)
                if spec is None:
                    spec = Spec(name, encoding, query.dtype_code, next(self._serials))
                    self._by_value[value] = spec
        self._remember(query.spec_key, spec)
        return spec

    def _remember(self, key: bytes, spec: Spec) -> None:
        with self._lock:
            old = self._by_key.pop(key, None)
            if old is not None:
                self._bytes -= _entry_bytes(key, old)
            self._by_key[key] = spec
            self._bytes += _entry_bytes(key, spec)
            while len(self._by_key) > 1 and (
                len(self._by_key) > self._max_entries or self._bytes > self._max_bytes
            ):
                evicted_key, evicted = self._by_key.popitem(last=False)
                self._bytes -= _entry_bytes(evicted_key, evicted)

    @property
    def nbytes(self) -> int:
        """Approximately the memory the entries hold (shared specs counted per key)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        """Number of keys remembered."""
        with self._lock:
            return len(self._by_key)


def _entry_bytes(key: bytes, spec: Spec) -> int:
    return len(key) + spec.nbytes + _ENTRY_OVERHEAD
