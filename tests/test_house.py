"""The house rules a reader can count: how long the functions of the three packages are.

A function's length is its code lines: lines holding code, not blank, not only a comment, not
its docstring; a function nested in another counts in its parent (it is read with it). The
generated stubs (``posenc_protocol/v1``) are not counted.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

# No function longer than this...
LONGEST = 60
# ...and at most MOST_LONG of them longer than LONG.
LONG = 40
MOST_LONG = 10

_PACKAGES = (
    ROOT / "protocol" / "posenc_protocol",
    ROOT / "client" / "posenc",
    ROOT / "server" / "posenc_server",
)


def _sources() -> Iterator[Path]:
    for package in _PACKAGES:
        for path in sorted(package.rglob("*.py")):
            if "v1" not in path.relative_to(package).parts:
                yield path


def _code_lines(source: str) -> set[int]:
    """The lines of ``source`` that hold a token other than a comment or a newline."""
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def _docstring_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[int]:
    first = function.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return set()


def _outermost_functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions and methods, not those nested in a function."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _outermost_functions(node)


def function_lengths() -> dict[str, int]:
    """Every function of the packages by ``path:line name``, with its code lines."""
    lengths: dict[str, int] = {}
    for path in _sources():
        source = path.read_text()
        code = _code_lines(source)
        for function in _outermost_functions(ast.parse(source)):
            span = set(range(function.lineno, (function.end_lineno or function.lineno) + 1))
            where = f"{path.relative_to(ROOT)}:{function.lineno} {function.name}"
            lengths[where] = len((span & code) - _docstring_lines(function))
    return lengths


def test_the_length_counts_code_only() -> None:
    source = (
        "def f(x):\n"
        '    """Doc\n    string."""\n'
        "    # a comment\n"
        "\n"
        "    def g():\n"
        "        return (1,\n"
        "                2)\n"
        "    return g\n"
    )
    function = next(_outermost_functions(ast.parse(source)))
    span = set(range(function.lineno, (function.end_lineno or 0) + 1))
    assert len((span & _code_lines(source)) - _docstring_lines(function)) == 5


def test_no_function_is_longer_than_sixty_code_lines() -> None:
    longest = {where: n for where, n in function_lengths().items() if n > LONGEST}
    assert not longest, f"longer than {LONGEST} code lines: {longest}"


def test_at_most_ten_functions_are_longer_than_forty_code_lines() -> None:
    long = {where: n for where, n in function_lengths().items() if n > LONG}
    assert len(long) <= MOST_LONG, f"{len(long)} longer than {LONG} code lines: {long}"
