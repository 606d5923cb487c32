"""Dependencies point one way: the protocol package imports neither the SDK nor the server, the
server imports nothing of the SDK, and no module imports back, directly or around a cycle, a
module that imports it. Every import counts, a late one inside a function too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

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
