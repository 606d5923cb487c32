"""The README's examples run as written, and its configuration table matches the code."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from conftest import ROOT

import posenc
from posenc_server.app import RunningServer
from posenc_server.config import ServerConfig

README = (ROOT / "README.md").read_text()
README_TARGET = "127.0.0.1:50051"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_readme_opens_with_the_two_commands() -> None:
    first = blocks("sh")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]
    assert README.index("make run") < README.index("```python")


# The examples that build a transformers model take seconds: outside the fast set.
@pytest.mark.parametrize(
    "index",
    [
        pytest.param(index, marks=pytest.mark.slow) if "import transformers" in code else index
        for index, code in enumerate(blocks("python"))
    ],
)
@pytest.mark.timeout(120)
def test_python_examples_run(index: int, server: RunningServer) -> None:
    code = blocks("python")[index].replace(README_TARGET, server.target)
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})


def test_each_section_appears_once() -> None:
    # A section pasted twice, one copy stale, reads as two sections contradicting each other.
    prose = re.sub(r"```.*?```", "", README, flags=re.DOTALL)
    headings = re.findall(r"^#{1,3} .+$", prose, flags=re.MULTILINE)
    repeated = sorted({heading for heading in headings if headings.count(heading) > 1})
    assert not repeated, f"README sections that appear more than once: {repeated}"


# What each CLI example of the README writes: (start, stop, table, dtype), as the SDK asks.
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
}


def load(path: Path, dtype: str) -> npt.NDArray[Any]:
    """The table of a file ``posenc fetch`` wrote, as numpy ``dtype``."""
    if path.suffix == ".safetensors":  # read by the safetensors library, not by us
        safetensors_torch = pytest.importorskip("safetensors.torch")
        torch = pytest.importorskip("torch")
        tensor = safetensors_torch.load_file(path)["table"]
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        return tensor.view(bits).numpy().view(np.dtype(dtype))
    saved = np.load(path, mmap_mode="r")
    # .npy has no bfloat16: the file holds 2-byte voids.
    return saved.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else saved


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_examples_write_their_tables(server: RunningServer, tmp_path: Path) -> None:
    """Every CLI line of the README runs, and every file it writes is the table its text
    says (compared with the SDK's rows of that table)."""
    commands = [
        line[2:] for block in blocks("console") for line in block.splitlines() if line[:2] == "$ "
    ]
    assert commands
    env = {**os.environ, "POSENC_TARGET": server.target}
    bin_dir = Path(sys.executable).parent
    for command in commands:
        argv = shlex.split(command)
        argv[0] = str(bin_dir / argv[0])
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=120)
        assert result.returncode == 0, (command, result.stderr)
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == sorted(CLI_OUTPUTS), "a README example without a reference here"
    with posenc.Client(server.target, timeout=120) as client:
        for name, (start, stop, table, dtype) in CLI_OUTPUTS.items():
            saved = load(tmp_path / name, dtype)
            for first, rows in client.iter_range(start, stop, table, dtype=dtype):
                got = saved[first - start : first - start + len(rows)]
                assert np.array_equal(
                    got.view(f"u{rows.itemsize}"), rows.view(f"u{rows.itemsize}")
                ), name


def test_configuration_table_lists_every_setting_with_its_default() -> None:
    rows = re.findall(r"^\| `--([a-z-]+)` \| `(POSENC_[A-Z_]+)` \| `([^`]+)` \|", README, re.M)
    documented = {flag.replace("-", "_"): (env, default) for flag, env, default in rows}
    for setting in dataclasses.fields(ServerConfig):
        assert setting.name in documented, f"README lacks --{setting.name}"
        env, default = documented[setting.name]
        assert env == "POSENC_" + setting.name.upper()
        assert default == (str(setting.default) if setting.default != "" else "none")
    assert len(documented) == len(dataclasses.fields(ServerConfig))
