"""What installing posenc asks of a user's environment.

Installing posenc (or one of its user-facing extras) must never downgrade or replace the
transformers, torch, vLLM, SGLang or diffusers a user already runs: those requirements carry
lower bounds only, and an integration verifies each table against the module's own rows at
load instead. Exact versions belong to the test-only extras (``dev``, ``conformance``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.requirements import Requirement

# Extras a user installs; `dev` and `conformance` are the project's own test environments,
# `docs` the tools of `make docs`.
_TEST_ONLY = {"dev", "conformance", "docs"}


def _project() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        project: dict[str, object] = tomllib.load(file)["project"]
    return project


def _user_requirements() -> list[tuple[str, Requirement]]:
    project = _project()
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    found = [("dependencies", Requirement(r)) for r in project["dependencies"]]  # type: ignore[attr-defined]
    for extra, requirements in extras.items():
        if extra not in _TEST_ONLY:
            found += [(extra, Requirement(r)) for r in requirements]
    return found


@pytest.mark.parametrize(
    ("where", "requirement"),
    _user_requirements(),
    ids=lambda value: str(value) if isinstance(value, str) else value.name,
)
def test_a_user_facing_requirement_has_a_lower_bound_only(
    where: str, requirement: Requirement
) -> None:
    operators = {spec.operator for spec in requirement.specifier}
    assert operators <= {">="}, (
        f"{where}: {requirement} caps or pins a version; installing posenc would then replace "
        "what a user runs"
    )


def test_every_integration_has_an_extra_and_a_tested_pin() -> None:
    extras = _project()["optional-dependencies"]
    assert isinstance(extras, dict)
    named = {
        Requirement(r).name for extra in ("transformers", "vllm", "sglang") for r in extras[extra]
    }
    assert {"transformers", "vllm", "sglang"} <= named
    pinned = {Requirement(r).name: Requirement(r) for r in extras["conformance"]}
    for name in ("torch", "transformers", "diffusers"):
        assert [spec.operator for spec in pinned[name].specifier] == ["=="], name


def _imported_names(tree: ast.AST) -> Iterator[str]:
    """Every module an import statement of ``tree`` names, late imports included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def test_the_sdk_imports_nothing_of_the_server() -> None:
    # `posenc serve` looks for the server and hands the process over to it: the SDK and its
    # CLI install and import without it.
    wrong = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "client" / "posenc").rglob("*.py"))
        for name in _imported_names(ast.parse(path.read_text(encoding="utf-8")))
        if name.partition(".")[0] == "posenc_server"
    ]
    assert wrong == []


def test_posenc_serve_hands_over_to_the_servers_own_command() -> None:
    bin_dir = Path(sys.executable).parent
    for argv in ([bin_dir / "posenc", "serve", "--help"], [bin_dir / "posenc-server", "--help"]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "--processes" in result.stdout and "POSENC_PORT" in result.stdout
