"""The README's and the docs' examples run as written, against a real server, and what they
document (the two commands, the table kinds, the configuration table) matches the code.

Every ```python block of README.md and docs/**/*.md runs, with its target pointed at a test
server; every `$ ` line of a ```console block runs as a command, and each file it writes is
compared with the table its text says. ```sh blocks are recipes that need more than a server
(make, containers, clusters) and are not run here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from conftest import ROOT

import posenc
from posenc_protocol.v1 import posenc_pb2
from posenc_server.app import RunningServer
from posenc_server.config import ServerConfig

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# The README, then every page of the docs site.
PAGES: dict[str, str] = {
    "README.md": README,
    **{
        str(path.relative_to(ROOT)): path.read_text()
        for path in sorted(DOCS.rglob("*.md"))
        if "_hooks" not in path.parts
    },
}
TARGET = "127.0.0.1:50051"
# The same-host examples' target, pointed at a unix socket of a test server.
UNIX_TARGET = "unix:/run/posenc/posenc.sock"


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^ *```{language}\n(.*?)^ *```", text, flags=re.DOTALL | re.MULTILINE)


def prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


EXAMPLES = [
    (page, index, code)
    for page, text in PAGES.items()
    for index, code in enumerate(blocks(text, "python"))
]


def test_every_page_has_been_read() -> None:
    assert len(PAGES) > 10 and "docs/guide/sdk.md" in PAGES
    assert len(EXAMPLES) >= 15


def test_readme_opens_with_the_two_commands() -> None:
    first = blocks(README, "sh")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]
    assert README.index("make run") < README.index("```python")


def test_readme_is_a_front_page() -> None:
    """At most about 250 lines: what posenc is, the two commands, three examples (a range, a
    decode step, ``patch(model)``), the table kinds, links to the docs."""
    assert len(README.splitlines()) <= 260
    code = "\n".join(blocks(README, "python"))
    for call in ("get_range(", "get_positions(", "patch(model"):
        assert call in code, f"the README lacks its {call}...) example"
    assert re.search(r"!\[[^]]*\]\(pictures/drift-[a-z]+\.png\)", README), "the drift picture"


def test_readme_links_lead_somewhere() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(README))
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.parametrize("page", ["README.md", "docs/guide/table-kinds.md"])
def test_the_table_kinds_table_lists_every_kind(page: str) -> None:
    """The proto is the one registry of kinds: a kind it has and the page lacks is drift."""
    text = PAGES[page]
    rows = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    kinds = posenc_pb2.EncodingSpec.DESCRIPTOR.oneofs_by_name["table"].fields
    scalings = posenc_pb2.RotaryTable.DESCRIPTOR.oneofs_by_name["scaling"].fields
    missing = [f.name for f in kinds if f'"{f.name}"' not in rows and f"`{f.name}`" not in rows]
    missing += [f.name for f in scalings if f'"{f.name}"' not in rows]
    assert not missing, f"{page}'s table of kinds lacks {missing}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_section_appears_once(page: str) -> None:
    # A section pasted twice, one copy stale, reads as two sections contradicting each other.
    headings = re.findall(r"^#{1,3} .+$", prose(PAGES[page]), flags=re.MULTILINE)
    repeated = sorted({heading for heading in headings if headings.count(heading) > 1})
    assert not repeated, f"{page}: sections that appear more than once: {repeated}"


# The examples that build a transformers or diffusers model take seconds: outside the fast set.
SLOW = ("import transformers", "from diffusers", "import diffusers")


@pytest.mark.parametrize(
    ("page", "index"),
    [
        pytest.param(
            page,
            index,
            marks=[pytest.mark.slow] if any(word in code for word in SLOW) else [],
            id=f"{page}:{index}",
        )
        for page, index, code in EXAMPLES
    ],
)
@pytest.mark.timeout(120)
def test_python_examples_run(
    page: str, index: int, server: RunningServer, request: pytest.FixtureRequest
) -> None:
    code = blocks(PAGES[page], "python")[index].replace(TARGET, server.target)
    if UNIX_TARGET in code:  # a same-host example: a server on a unix socket of its own
        unix_server: RunningServer = request.getfixturevalue("unix_server")
        code = code.replace(UNIX_TARGET, f"unix:{unix_server.config.unix_socket}")
    exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": "docs"})


@pytest.fixture
def unix_server(
    server_factory: Callable[..., RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> RunningServer:
    """A server that also serves a unix socket, with 64 MiB of shared memory."""
    path = tmp_path_factory.mktemp("unix") / "posenc.sock"
    return server_factory(unix_socket=str(path), shm_bytes=64 << 20)


# What each CLI example writes: (start, stop, table, dtype), as the SDK asks for it.
CLI_OUTPUTS: dict[str, tuple[int, int, int | posenc.Spec, str]] = {
    "table.npy": (0, 1_000_000, 256, "float32"),
    "t2t.safetensors": (0, 4096, posenc.Spec("tensor2tensor", d_model=1024), "bfloat16"),
    "whisper.npy": (0, 1500, posenc.Spec("whisper", d_model=384), "float32"),
    "m2m100.npy": (0, 1026, posenc.Spec("fairseq", d_model=1024, padding_idx=1), "float32"),
    "rope.npy": (0, 8192, posenc.Spec("rotary", head_dim=128, rope_theta=1e6), "float32"),
    "llama31.npy": (
        0,
        4096,
        posenc.Spec(
            "rotary",
            head_dim=128,
            rope_theta=500000.0,
            scaling="llama3",
            factor=8.0,
            original_max_position_embeddings=8192,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
        "float32",
    ),
    "pixart.npy": (  # a whole grid, written with its shape [64, 64, 1152]
        0,
        64 * 64,
        posenc.Spec("sincos_grid_2d", embed_dim=1152, grid_height=64, grid_width=64, base_size=32),
        "float32",
    ),
}
# The figures `posenc plot` draws: checked to be PNG images (tests/test_plot.py checks their
# data).
CLI_PICTURES = {"drift.png", "scaling.png", "rows.png", "grids.png"}


def load(path: Path, dtype: str) -> npt.NDArray[Any]:
    """The table of a file ``posenc fetch`` wrote, as numpy ``dtype``, one row a position."""
    if path.suffix == ".safetensors":  # read by the safetensors library, not by us
        safetensors_torch = pytest.importorskip("safetensors.torch")
        torch = pytest.importorskip("torch")
        tensor = safetensors_torch.load_file(path)["table"]
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        return tensor.view(bits).numpy().view(np.dtype(dtype))
    saved = np.load(path, mmap_mode="r")
    saved = saved.reshape(-1, saved.shape[-1])  # a grid's cells, row-major
    # .npy has no bfloat16: the file holds 2-byte voids.
    return saved.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else saved


def cli_commands() -> list[tuple[str, str]]:
    """Every `$ ` line of every console block, once, with the first page that shows it."""
    commands: dict[str, str] = {}
    for page, text in PAGES.items():
        for block in blocks(text, "console"):
            for line in block.splitlines():
                if line.startswith("$ "):
                    commands.setdefault(line[2:], page)
    return list(commands.items())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_examples_write_their_tables(server: RunningServer, tmp_path: Path) -> None:
    """Every CLI line of the README and the docs runs, and every file it writes is the
    table its text says (compared with the SDK's rows of that table)."""
    commands = cli_commands()
    assert any(command.startswith("posenc fetch") for command, _ in commands)
    env = {**os.environ, "POSENC_TARGET": server.target}
    bin_dir = Path(sys.executable).parent
    for command, page in commands:
        argv = shlex.split(command)
        argv[0] = str(bin_dir / argv[0])
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=120)
        assert result.returncode == 0, (page, command, result.stderr)
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == sorted([*CLI_OUTPUTS, *CLI_PICTURES]), "an example without a reference"
    for name in CLI_PICTURES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    with posenc.Client(server.target, timeout=120) as client:
        for name, (start, stop, table, dtype) in CLI_OUTPUTS.items():
            saved = load(tmp_path / name, dtype)
            assert len(saved) == stop - start, name
            for first, rows in client.iter_range(start, stop, table, dtype=dtype):
                got = saved[first - start : first - start + len(rows)]
                assert np.array_equal(
                    got.view(f"u{rows.itemsize}"), rows.view(f"u{rows.itemsize}")
                ), name


def test_configuration_table_lists_every_setting_with_its_default() -> None:
    page = PAGES["docs/guide/configuration.md"]
    rows = re.findall(r"^\| `--([a-z-]+)` \| `(POSENC_[A-Z_]+)` \| `([^`]+)` \|", page, re.M)
    documented = {flag.replace("-", "_"): (env, default) for flag, env, default in rows}
    for setting in dataclasses.fields(ServerConfig):
        assert setting.name in documented, f"the configuration page lacks --{setting.name}"
        env, default = documented[setting.name]
        assert env == "POSENC_" + setting.name.upper()
        assert default == (str(setting.default) if setting.default != "" else "none")
    assert len(documented) == len(dataclasses.fields(ServerConfig))
