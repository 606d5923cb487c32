"""Dependencies point one way: the protocol package imports neither the SDK nor the server, the
server imports nothing of the SDK, and no module imports back, directly or around a cycle, a
module that imports it. Every import counts, a late one inside a function too. And one
request passes each module of the SDK once: a traced call, its calls and its returns, stays in
each module once on the way down and once on the way up."""

from __future__ import annotations

import ast
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import numpy as np
import pytest
from conftest import ROOT

import posenc
from posenc.testing import MockTransport, positions

PACKAGES = {
    "posenc_protocol": ROOT / "protocol" / "posenc_protocol",
    "posenc": ROOT / "client" / "posenc",
    "posenc_server": ROOT / "server" / "posenc_server",
}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules ``name`` imports: for ``from a import b``, ``a.b`` if it is a
    module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in known else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: set(_imported(name, path, known)) for name, path in known.items()}


def _package(module: str) -> str:
    return module.partition(".")[0]


def test_the_protocol_and_the_server_import_nothing_of_the_sdk() -> None:
    allowed = {"posenc_protocol": {"posenc_protocol"}, "posenc_server": {"posenc_server"}}
    allowed["posenc_server"].add("posenc_protocol")
    wrong = [
        (module, target)
        for module, targets in _graph().items()
        for target in targets
        if _package(module) in allowed and _package(target) not in allowed[_package(module)]
    ]
    assert wrong == []


def test_no_module_imports_back_a_module_that_imports_it() -> None:
    graph = _graph()
    # A package's __init__ re-exports its modules; a module that imports its own package
    # imports that __init__, so the edge from __init__ down is what makes a cycle.
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        seen = set()
        while stack:
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in seen and target > start:  # each cycle once, from its least
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert cycles == []


# -- the path of one request ---------------------------------------------------------------------


def _stays(call: Callable[[], object]) -> list[str]:
    """The SDK modules ``call`` stays in, in order: every Python call and return event of
    this thread, each given to the nearest SDK frame's module (library code in between is
    that module's work), consecutive events of one module making one stay."""
    stays: list[str] = []

    def module(frame: FrameType | None) -> str | None:
        while frame is not None:
            name = str(frame.f_globals.get("__name__", ""))
            if name == "posenc" or name.startswith("posenc."):
                return name
            frame = frame.f_back
        return None

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event not in ("call", "return"):
            return
        name = module(frame)
        if name is not None and stays[-1:] != [name]:
            stays.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stays


def _settled(client: posenc.Client) -> None:
    """Until the client's read-ahead thread has nothing left to do."""
    for _ in range(500):
        time.sleep(0.002)
        if client._ahead_queue.empty() and not client._core.rows.in_flight:
            return
    raise AssertionError("read-ahead never settled")


def test_a_cached_decode_step_stays_in_each_module_once_down_and_once_up() -> None:
    """A decode step whose rows the row cache holds, calls and returns traced: the public
    method, the core's fast path, the row cache's lookup, and the driver handing the result
    back. At most 2m - 1 stays for m modules: a module is not asked twice for pieces of one
    step, and nothing is built that the answer does not need."""
    client = posenc.Client(transport=MockTransport(lambda r: np.zeros((len(positions(r)), 64))))
    with client:
        for step in range(4):
            client.get_positions([1000 + step], 64)
            _settled(client)
        for positions_of_step in ([1004], np.array([1005]), np.array([[1006]])):
            stays = _stays(lambda p=positions_of_step: client.get_positions(p, 64))
            assert stays[0] == "posenc._base" and stays[-1] == "posenc._base", stays
            assert len(stays) <= 2 * len(set(stays)) - 1, stays
            assert "posenc._query" not in stays, "a cached step builds no query"


@pytest.mark.parametrize("width_known", [False, True], ids=["first", "again"])
def test_a_get_range_stays_in_each_module_once_down_and_once_up(width_known: bool) -> None:
    """A small ``get_range``, calls and returns traced, as the floors of the SDK: the public
    method; its plan (the arguments, the spec, the output's form, the budget, the request),
    built once; the driver, which makes the plan's call over a connection of the pool; the
    transport; the core, which turns the response into the result. At most 2m - 1 stays for
    m modules: no module is asked twice for pieces of one request."""
    client = posenc.Client(transport=MockTransport(lambda r: np.zeros((len(positions(r)), 64))))
    with client:
        if width_known:
            client.get_range(0, 4, 64)
        stays = _stays(lambda: client.get_range(0, 4, 64))
    assert len(stays) <= 2 * len(set(stays)) - 1, stays
    assert [name for name in dict.fromkeys(stays) if name in _FLOORS] == list(_FLOORS), stays


# The floors of a planned call, in the order a request meets them on its way down.
_FLOORS = ("posenc._base", "posenc._query", "posenc._client", "posenc.testing", "posenc._core")
