"""What installing posenc asks of a user's environment, and what each distribution ships.

Installing posenc or posenc-server (or one of their user-facing extras) must never downgrade
or replace the transformers, torch, vLLM, SGLang or diffusers a user already runs: those
requirements carry lower bounds only, and an integration verifies each table against the
module's own rows at load instead. Exact versions belong to the test-only extras (``dev``,
``conformance``), and to the server's requirement of the SDK's distribution of its release.

The SDK's distribution (``posenc``: ``posenc_protocol`` and ``posenc``) ships no server code,
and the server's (``posenc-server``) ships only ``posenc_server``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from packaging.requirements import Requirement

# Extras a user installs; `dev` and `conformance` are the project's own test environments,
# `docs` the tools of `make docs`.
_TEST_ONLY = {"dev", "conformance", "docs"}


# The two distributions' project files: the SDK's, and the server's.
_PROJECTS = (ROOT / "pyproject.toml", ROOT / "server" / "pyproject.toml")


def _project(path: Path = _PROJECTS[0]) -> dict[str, Any]:
    with open(path, "rb") as file:
        project: dict[str, Any] = tomllib.load(file)["project"]
    return project


def _user_requirements() -> list[tuple[str, Requirement]]:
    found = []
    for path in _PROJECTS:
        project = _project(path)
        where = f"{path.relative_to(ROOT)}"
        for text in project["dependencies"]:
            requirement = Requirement(text)
            if requirement.name != "posenc":  # the server's SDK release: test_the_server_...
                found.append((f"{where} dependencies", requirement))
        for extra, requirements in project.get("optional-dependencies", {}).items():
            if extra not in _TEST_ONLY:
                found += [(f"{where} [{extra}]", Requirement(r)) for r in requirements]
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


def test_the_server_requires_the_sdk_of_its_own_release() -> None:
    # posenc_protocol comes with the SDK's distribution: the server is built against the
    # stubs and the codec of its own release, whatever the SDK's lower bounds allow.
    versions = (ROOT / "client" / "posenc" / "_version.py").read_text()
    version = versions.split("__version__ = ", 1)[1].split()[0].strip("\"'")
    requirements = [Requirement(r) for r in _project(_PROJECTS[1])["dependencies"]]
    (sdk,) = [r for r in requirements if r.name == "posenc"]
    assert str(sdk.specifier) == f"=={version}"


def _wheel_packages(directory: Path, tmp_path: Path) -> set[str]:
    """The top-level names in the wheel built from ``directory`` (its .dist-info aside)."""
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path)]
    result = subprocess.run([*argv, str(directory)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = {name.split("/")[0] for name in archive.namelist()}
    return {name for name in names if not name.endswith(".dist-info")}


@pytest.mark.slow  # builds two wheels
def test_the_sdk_wheel_ships_no_server_code_and_the_servers_only_the_server(
    tmp_path: Path,
) -> None:
    assert _wheel_packages(ROOT, tmp_path / "sdk") == {"posenc", "posenc_protocol"}
    assert _wheel_packages(ROOT / "server", tmp_path / "server") == {"posenc_server"}
