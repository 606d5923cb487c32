"""The README's examples run as written, and its configuration table matches the code."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

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


@pytest.mark.parametrize("index", range(len(blocks("python"))))
@pytest.mark.timeout(120)
def test_python_examples_run(index: int, server: RunningServer) -> None:
    code = blocks("python")[index].replace(README_TARGET, server.target)
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})


@pytest.mark.timeout(120)
def test_cli_examples_run(server: RunningServer, tmp_path: Path) -> None:
    commands = [
        line[2:] for block in blocks("console") for line in block.splitlines() if line[:2] == "$ "
    ]
    assert commands
    env = {**os.environ, "POSENC_TARGET": server.target}
    bin_dir = Path(sys.executable).parent
    for command in commands:
        argv = shlex.split(command)
        argv[0] = str(bin_dir / argv[0])
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=60)
        assert result.returncode == 0, (command, result.stderr)
    table = np.load(tmp_path / "table.npy")
    assert table.shape == (1_000_000, 256) and table.dtype == np.float32


def test_configuration_table_lists_every_setting_with_its_default() -> None:
    rows = re.findall(r"^\| `--([a-z-]+)` \| `(POSENC_[A-Z_]+)` \| `([^`]+)` \|", README, re.M)
    documented = {flag.replace("-", "_"): (env, default) for flag, env, default in rows}
    for setting in dataclasses.fields(ServerConfig):
        assert setting.name in documented, f"README lacks --{setting.name}"
        env, default = documented[setting.name]
        assert env == "POSENC_" + setting.name.upper()
        assert default == (str(setting.default) if setting.default != "" else '""')
    assert len(documented) == len(dataclasses.fields(ServerConfig))
