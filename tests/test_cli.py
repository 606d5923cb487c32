"""The ``posenc`` command line, against real servers on loopback."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
from conftest import ServerProcess, free_port

import posenc
from posenc.cli import main
from posenc.cli.health import _default_health_url
from posenc_server import config, metrics
from posenc_server.app import RunningServer

BIN = Path(sys.executable).parent


def test_fetch_writes_npy_equal_to_get_range(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "table.npy"
    argv = ["fetch", "-100", "20000", "--d-model", "128", "-o", str(out)]
    assert main([*argv, "--target", server.target, "--chunk-bytes", "48KiB"]) == 0
    with posenc.Client(server.target) as client:
        expected = client.get_range(-100, 20000, 128)
    table = np.load(out)
    assert table.dtype == np.float32
    assert np.array_equal(table, expected)
    assert "20,100 x 128 float32 rows" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["table.npy"]  # no partial file left


def test_fetch_options_and_bfloat16(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "bf16.npy"
    argv = ["fetch", "0", "3000", "--d-model", "63", "--dtype", "bfloat16", "--layout", "split"]
    argv += ["--schedule", "tensor2tensor", "--base", "500", "-o", str(out)]
    assert main([*argv, "--target", server.target]) == 0
    raw = np.load(out)
    # What the --help text promises: .npy has no bfloat16, numpy reads 2-byte voids.
    assert raw.dtype == np.dtype("V2")
    with posenc.Client(server.target) as client:
        expected = client.get_range(
            0, 3000, 63, dtype="bfloat16", layout="split", schedule="tensor2tensor", base=500
        )
    assert np.array_equal(raw.view(ml_dtypes.bfloat16), expected)


def test_fetch_positions_file(server: RunningServer, tmp_path: Path) -> None:
    positions = np.array([9, 1 << 40, -3, 9], dtype=np.int64)
    as_npy, as_text = tmp_path / "p.npy", tmp_path / "p.txt"
    np.save(as_npy, positions)
    as_text.write_text("\n".join(map(str, positions)) + "\n")
    with posenc.Client(server.target) as client:
        expected = client.get_positions(positions, 16)
    for source in (as_npy, as_text):
        out = tmp_path / f"out-{source.suffix[1:]}.npy"
        argv = ["fetch", "--positions-file", str(source), "--d-model", "16", "-o", str(out)]
        assert main([*argv, "--target", server.target]) == 0
        assert np.array_equal(np.load(out), expected)


def test_fetch_positions_file_of_coordinates(server: RunningServer, tmp_path: Path) -> None:
    """A kind of several position axes takes [rows, axes] coordinates, from .npy or from
    text with a row per line; a file of another shape is a one-line error."""
    coordinates = np.array([[0, 3, 5], [7, 1 << 30, 2], [1, 1, 1]], dtype=np.int64)
    as_npy, as_text = tmp_path / "c.npy", tmp_path / "c.txt"
    np.save(as_npy, coordinates)
    as_text.write_text("\n".join(" ".join(map(str, row)) for row in coordinates) + "\n")
    spec = posenc.Spec("rotary_axes", axes_dim=[4, 6, 6])
    with posenc.Client(server.target) as client:
        expected = client.get_positions(coordinates, spec)
    table = ["--table", "rotary_axes", "--param", "axes_dim=4,6,6", "--target", server.target]
    for source in (as_npy, as_text):
        out = tmp_path / f"out-{source.suffix[1:]}.npy"
        assert main(["fetch", "--positions-file", str(source), *table, "-o", str(out)]) == 0
        assert np.array_equal(np.load(out), expected)
    np.save(as_npy, coordinates[:, :2])
    out = tmp_path / "refused.npy"
    assert main(["fetch", "--positions-file", str(as_npy), *table, "-o", str(out)]) == 1
    assert not out.exists()


def test_fetch_uses_env_target(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSENC_TARGET", server.target)
    assert main(["fetch", "0", "10", "--d-model", "4", "-o", str(tmp_path / "t.npy")]) == 0


def test_fetch_error_is_one_line_without_traceback(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bad.npy"
    argv = ["fetch", "0", "10", "--d-model", "100000", "-o", str(out), "--target", server.target]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "INVALID_ARGUMENT" in err and "d_model" in err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_fetch_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.npy")
    for argv, message in [
        (["fetch", "--d-model", "4", "-o", out], "START and STOP are required"),
        (["fetch", "1.5", "4", "--d-model", "4", "-o", out], "expected an integer position"),
        (["fetch", "0", "10", "--d-model", "4", "-o", str(tmp_path / "x.txt")], "'.txt'"),
        (["fetch", "0", "10", "--d-model", "4", "-o", str(tmp_path)], "is a directory"),
        (["fetch", "0", "10", "--d-model", "4", "-o", str(tmp_path / "no/x.npy")], "no"),
        (["fetch", "0", "10", "-o", out], "--d-model is required"),
        (["fetch", "0", "10", "--table", "whisper", "--layout", "split", "-o", out], "--layout"),
        (["fetch", "0", "10", "--param", "factor=2", "--d-model", "4", "-o", out], "factor"),
        (["fetch", "0", "10", "--table", "fairseq", "--param", "padding_idx", "-o", out], "NAME"),
        (["fetch", "0", "10", "--table", "nope", "-o", out], "--table"),
        (["fetch", "0", "10", "--d-model", "4", "--chunk-bytes", "1GB!", "-o", out], "256KiB"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize(
    ("argv", "spec"),
    [
        (["--table", "whisper", "--d-model", "64"], posenc.Spec("whisper", d_model=64)),
        (
            ["--table", "fairseq", "--d-model", "32", "--param", "padding_idx=3"],
            posenc.Spec("fairseq", d_model=32, padding_idx=3),
        ),
        (
            ["--table", "tensor2tensor", "--param", "d_model=33", "--param", "start_index=5"],
            posenc.Spec("tensor2tensor", d_model=33, start_index=5),
        ),
        (
            ["--table", "rotary", "--param", "head_dim=32", "--param", "layout=gptj"],
            posenc.Spec("rotary", head_dim=32, layout="gptj"),
        ),
        (
            [
                *("--table", "rotary", "--param", "head_dim=8", "--param", "scaling=longrope"),
                *("--param", "short_factor=1,2,3,4", "--param", "long_factor=1,1,1,1"),
                *("--param", "original_max_position_embeddings=64", "--param", "factor=2"),
                *("--param", "seq_len=128"),
            ],
            posenc.Spec(
                "rotary",
                head_dim=8,
                scaling="longrope",
                short_factor=[1.0, 2.0, 3.0, 4.0],
                long_factor=[1.0] * 4,
                original_max_position_embeddings=64,
                factor=2.0,
                seq_len=128,
            ),
        ),
    ],
)
def test_fetch_any_table_kind(
    server: RunningServer, tmp_path: Path, argv: list[str], spec: posenc.Spec
) -> None:
    out = tmp_path / "t.npy"
    assert main(["fetch", "0", "100", *argv, "-o", str(out), "--target", server.target]) == 0
    with posenc.Client(server.target) as client:
        expected = client.get_range(0, 100, spec)
    assert np.array_equal(np.load(out), expected)


def test_fetch_rope_config(server: RunningServer, tmp_path: Path) -> None:
    config = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "rope.npy"
    argv = ["fetch", "0", "64", "--rope-config", str(path), "--param", "layout=vllm"]
    assert main([*argv, "-o", str(out), "--target", server.target]) == 0
    with posenc.Client(server.target) as client:
        expected = client.get_range(0, 64, posenc.Spec.from_config(config, layout="vllm"))
    assert expected.shape == (64, 64)
    assert np.array_equal(np.load(out), expected)


def test_fetch_of_an_empty_range_writes_an_empty_table(
    server: RunningServer, tmp_path: Path
) -> None:
    out = tmp_path / "empty.npy"
    assert (
        main(["fetch", "7", "7", "--d-model", "12", "-o", str(out), "--target", server.target]) == 0
    )
    assert np.load(out).shape == (0, 12)


def test_fetch_unreachable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{free_port()}"
    argv = ["fetch", "0", "10", "--d-model", "4", "-o", str(tmp_path / "x.npy")]
    assert main([*argv, "--target", target, "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert f"no posenc server at {target} (connection refused): is it running?" in err
    assert "Traceback" not in err


def test_info(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--target", server.target]) == 0
    text = capsys.readouterr().out
    assert "max_d_model:" in text and "bfloat16" in text
    assert main(["info", "--json", "--target", server.target]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["limits"]["max_d_model"] == 65536
    assert set(info["cache"]) >= {"hits", "misses", "budget_bytes"}


def test_info_names_kinds_as_fetch_takes_them(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", "--target", server.target]) == 0
    text = capsys.readouterr().out
    kinds = text.split("table kinds:", 1)[1].split("(fetch", 1)[0].strip().split(", ")
    assert "whisper" in kinds and "rotary" in kinds
    selections = [["--table", kind] for kind in kinds]
    scalings = [line for line in text.splitlines() if "--param scaling=NAME" in line]
    assert len(scalings) == 1, text
    names = scalings[0].split(":", 1)[1].split("(", 1)[0].strip().split(", ")
    assert "yarn" in names
    selections += [["--table", "rotary", "--param", f"scaling={name}"] for name in names]
    out = str(tmp_path / "t.npy")
    for selection in selections:
        width = "d_model=8"
        if "rotary" in selection or "mrope" in selection:
            width = "head_dim=8"
        elif "rotary_axes" in selection:
            width = "axes_dim=2,2,4"
        elif any(kind.startswith("sincos_grid") for kind in selection):
            width = "embed_dim=8"
        argv = ["fetch", "0", "1", *selection, "--param", width, "-o", out]
        try:
            code = main([*argv, "--target", server.target])
        except SystemExit as exited:
            code = exited.code
        # Fetched, or refused by the server for parameters the kind needs (yarn's factor,
        # ...): never a usage error (2) about the name info printed.
        assert code in (0, 1), (selection, capsys.readouterr().err)
        capsys.readouterr()


def test_health_serving(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", server.target]) == 0
    assert capsys.readouterr().out == "SERVING\n"


def test_health_not_serving(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.not_serving()
    assert main(["health", "--target", server.target]) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"


def test_health_nothing_listening(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A probe reports what it sees now: nothing listening is UNREACHABLE from the first
    refused connection, neither retried nor waited out to the deadline (which would say
    DEADLINE_EXCEEDED). The deadline, generous here, only guards against a hang."""
    caplog.set_level(logging.INFO, logger="posenc")
    argv = ["health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "30"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == "UNREACHABLE\n"
    assert "UNAVAILABLE" in captured.err and "Traceback" not in captured.err
    assert "DEADLINE_EXCEEDED" not in captured.err and "attempts" not in captured.err
    assert not any("retrying" in record.message for record in caplog.records)


def test_health_of_several_targets(
    server_factory: Callable[..., RunningServer], capsys: pytest.CaptureFixture[str]
) -> None:
    up, dead = server_factory().target, f"127.0.0.1:{free_port()}"
    assert main(["health", "--target", up, "--target", dead]) == 1
    assert capsys.readouterr().out == f"{up}: SERVING\n{dead}: UNREACHABLE\n"


def test_health_http_takes_its_port_from_the_servers_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default URL is the server's own: its default metrics port and health path.
    monkeypatch.delenv("POSENC_METRICS_PORT", raising=False)
    assert _default_health_url() == (
        f"http://127.0.0.1:{config.DEFAULT_METRICS_PORT}{metrics.HEALTH_PATH}"
    )
    monkeypatch.setenv("POSENC_METRICS_PORT", "9100")
    assert _default_health_url() == "http://127.0.0.1:9100/healthz"
    # A port the server picks (0), metrics off (-1), or no number: a usage error, no probe.
    for value in ("0", "-1", "65536", "9464x", "1e3"):
        monkeypatch.setenv("POSENC_METRICS_PORT", value)
        assert main(["health", "--http"]) == 2
        assert "no port to probe" in capsys.readouterr().err


def test_health_http_refuses_what_it_would_not_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--http", "ftp://127.0.0.1/healthz"]) == 2
    assert main(["health", "--http", "http://127.0.0.1:1/healthz", "--target", "x:1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("posenc health:") == 2


def test_health_http_of_a_grpc_port_is_unreachable(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # HTTP/2 frames where an HTTP/1.x answer was expected: no traceback, no bytes echoed.
    assert main(["health", "--http", f"http://{server.target}/healthz"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "UNREACHABLE\n"
    assert "no HTTP/1.x answer" in captured.err and "Traceback" not in captured.err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_console_script_serve_and_health() -> None:
    port = free_port()
    server = subprocess.Popen(
        [BIN / "posenc", "serve", "--port", str(port), "--metrics-port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        for line in server.stderr:  # the server logs one JSON line once it listens
            if '"listening"' in line:
                assert json.loads(line)["port"] == port
                break
        health = subprocess.run(
            [BIN / "posenc", "health", "--target", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (health.returncode, health.stdout) == (0, "SERVING\n")
    finally:
        server.terminate()
        server.wait(30)


def serve_without(module: str, cli: str, argv: list[str]) -> str:
    """The standard error of ``{cli}.main(argv)`` in a new interpreter that cannot import
    ``module``, which must exit 2 naming the install of this checkout's server (make test
    installs from it: the command names its server/ directory, not the package index)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; "
        f"from {cli} import main; raise SystemExit(main({argv!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert f"'{Path(posenc.__file__).parents[2] / 'server'}'" in result.stderr, result.stderr
    return result.stderr


def test_serve_without_the_server_extra() -> None:
    # Simulates an install without posenc-server: there is no posenc_server to hand over to.
    stderr = serve_without("posenc_server", "posenc.cli", ["serve", "--port", "0"])
    assert "the server is not installed" in stderr
    assert "Traceback" not in stderr


def test_version() -> None:
    result = subprocess.run(
        [BIN / "posenc", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == f"posenc {posenc.__version__}"


@pytest.mark.slow
def test_fetch_shows_a_progress_bar_on_a_terminal_only(
    server: RunningServer, tmp_path: Path
) -> None:

    posenc = str(Path(sys.executable).parent / "posenc")
    argv = [posenc, "fetch", "0", "200000", "--d-model", "64", "--target", server.target]
    controller, terminal = pty.openpty()
    # A real terminal has a size; a fresh pty is 0 x 0.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen(
        [*argv, "-o", str(tmp_path / "tty.npy")], stderr=terminal, stdout=subprocess.DEVNULL
    ) as process:
        os.close(terminal)
        output = b""
        while True:
            try:
                data = os.read(controller, 4096)
            except OSError:  # the terminal closed: the process exited
                break
            if not data:
                break
            output += data
        assert process.wait(60) == 0
    os.close(controller)
    text = output.decode(errors="replace")
    assert "100%" in text and "row" in text, text
    assert "writing to disk" in text, text  # the file's pages go out before the bar ends
    piped = subprocess.run(
        [*argv, "-o", str(tmp_path / "pipe.npy")], capture_output=True, timeout=60
    )
    assert piped.returncode == 0
    assert b"100%" not in piped.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "tty.npy"), np.load(tmp_path / "pipe.npy"))


@pytest.mark.slow
def test_fetch_of_a_refused_range_says_why_and_creates_no_file(
    server: RunningServer, tmp_path: Path
) -> None:
    output = tmp_path / "never.npy"
    for start, stop, d_model, expected in [
        ("5", "1", "8", "range.stop"),
        ("0", str(10**8), "4096", "free"),  # 1.5 TiB: more than the disk holds
    ]:
        argv = [str(Path(sys.executable).parent / "posenc"), "fetch", start, stop]
        argv += ["--d-model", d_model, "-o", str(output), "--target", server.target]
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1
        assert expected in result.stderr and "Traceback" not in result.stderr
        assert list(tmp_path.iterdir()) == []


def test_an_unwritable_output_is_refused_before_anything_is_fetched(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with posenc.Client(server.target) as client:
        before = client.server_info().rows_computed
        for output in (tmp_path, tmp_path / "missing" / "t.npy", tmp_path / "t.csv"):
            argv = ["fetch", "0", "100000", "--d-model", "64", "-o", str(output)]
            with pytest.raises(SystemExit) as exited:
                main([*argv, "--target", server.target])
            assert exited.value.code == 2
            err = capsys.readouterr().err
            assert str(output) in err and ".partial" not in err, err
        assert client.server_info().rows_computed == before  # nothing was fetched
    assert [p.name for p in tmp_path.iterdir()] == []


def test_write_errors_name_the_users_file(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The directory is writable, but the hidden file the table is written to first cannot
    # be created: a directory of that name is in the way.
    out = tmp_path / "t.npy"
    (tmp_path / f".t.npy.{os.getpid()}.partial").mkdir()
    argv = ["fetch", "0", "10", "--d-model", "4", "-o", str(out), "--target", server.target]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"cannot write {out}" in err and "Traceback" not in err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_fetch_to_safetensors(server: RunningServer, tmp_path: Path, dtype: str) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    out = tmp_path / "table.safetensors"
    argv = ["fetch", "1e6", str(10**6 + 3000), "--table", "whisper", "--d-model", "64"]
    assert main([*argv, "--dtype", dtype, "-o", str(out), "--target", server.target]) == 0
    tensors = safetensors_torch.load_file(out)
    assert list(tensors) == ["table"]
    table = tensors["table"]
    assert table.dtype == getattr(torch, dtype) and tuple(table.shape) == (3000, 64)
    with posenc.Client(server.target) as client:
        expected = client.get_range(
            10**6, 10**6 + 3000, posenc.Spec("whisper", d_model=64), dtype=dtype
        )
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.itemsize]
    assert np.array_equal(table.view(bits).numpy(), expected.view(f"i{expected.itemsize}"))
    with open(out, "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    spec = json.loads(header["__metadata__"]["posenc.spec"])
    assert spec == {"kind": "whisper", "d_model": 64}


def test_positions_take_the_forms_sizes_take(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "t.npy"
    argv = ["fetch", "2**20", "1.5e6", "--d-model", "4", "-o", str(out), "--no-progress"]
    assert main([*argv, "--target", server.target]) == 0
    assert np.load(out).shape == (1_500_000 - 2**20, 4)


def test_serve_names_the_missing_module_and_the_matching_install_command() -> None:
    # `posenc serve` hands over to the server's own command, which says what it misses.
    stderr = serve_without("grpc_reflection", "posenc_server.cli", ["--port", "0"])
    assert "needs the module grpc_reflection" in stderr
    assert "not installed" in stderr and "pip install" in stderr


@pytest.mark.slow
def test_ml_dtypes_is_loaded_by_a_client_not_by_an_import_or_a_call(
    server: RunningServer,
) -> None:
    # Importing ml_dtypes takes most of a second: `import posenc` and the HTTP health probe
    # (compose runs `posenc health --http` every 10 s) do not pay it; a client loads it
    # when it is made, so that its first bfloat16 call does not.
    script = (
        "import sys, posenc, posenc.cli\n"
        "print('ml_dtypes' in sys.modules)\n"
        "with posenc.Client(sys.argv[1]) as client:\n"
        "    print('ml_dtypes' in sys.modules)\n"
        "    rows = client.get_range(0, 4, 8, dtype='bfloat16')\n"
        "    print(rows.dtype)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, server.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.splitlines()[-3:] == ["False", "True", "bfloat16"]


def posenc_cli(*args: str, **options: object) -> subprocess.CompletedProcess[str]:
    """The installed ``posenc`` command, in a subprocess (a guard timeout only)."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **options}
    return subprocess.run(
        [str(BIN / "posenc"), *args],
        text=True,
        timeout=120,
        **streams,  # type: ignore[call-overload]
    )


def test_a_hostile_rope_config_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"head_dim": -300, "rotary_dim": 55}))
    result = posenc_cli(
        "fetch",
        "0",
        "10",
        "--rope-config",
        str(config),
        "-o",
        str(tmp_path / "t.npy"),
        "--target",
        f"127.0.0.1:{free_port()}",
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "INVALID_ARGUMENT: config.head_dim" in result.stderr


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A file system of 1 MiB (a tmpfs mounted for the test; root only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_fetch_to_a_full_disk_is_a_one_line_error_and_leaves_nothing(
    server: RunningServer, small_disk: Path
) -> None:
    free = shutil.disk_usage(small_disk).free
    assert free % 1024 == 0
    # The rows fill the disk exactly: the file's header no longer fits.
    for output in ("table.npy", "table.safetensors"):
        result = posenc_cli(
            "fetch",
            "0",
            str(free // 1024),
            "--d-model",
            "256",
            "-o",
            str(small_disk / output),
            "--target",
            server.target,
        )
        assert result.returncode == 1, result
        assert result.stderr == (
            f"posenc fetch: cannot write {small_disk / output}: No space left on device\n"
        )
        assert list(small_disk.iterdir()) == []
        assert shutil.disk_usage(small_disk).free == free


def test_fetch_takes_the_longest_legal_file_name(server: RunningServer, tmp_path: Path) -> None:
    output = tmp_path / ("t" * 251 + ".npy")  # 255 bytes, the usual limit
    result = posenc_cli(
        "fetch", "0", "10", "--d-model", "8", "-o", str(output), "--target", server.target
    )
    assert result.returncode == 0, result.stderr
    with posenc.Client(server.target) as client:
        assert np.array_equal(np.load(output), client.get_range(0, 10, 8))
    assert [p.name for p in tmp_path.iterdir()] == [output.name]


# -- a newcomer's first hour ----------------------------------------------------------------


def test_info_into_a_closed_pipe_is_quiet_and_succeeds(server: RunningServer) -> None:
    """`posenc info | head -1`: the reader leaves before the output is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = posenc_cli("info", "--target", server.target, stdout=write)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (0, "")


def test_a_bad_flag_value_says_what_the_flag_takes_in_two_lines() -> None:
    result = posenc_cli("fetch", "0", "10", "--d-model", "abc", "-o", "t.npy")
    assert result.returncode == 2
    assert result.stderr == (
        "posenc fetch: error: argument --d-model: d_model must be an integer, got 'abc'\n"
        "See 'posenc fetch --help' for the usage.\n"
    )


def test_a_parameter_never_set_is_said_not_set(server: RunningServer, tmp_path: Path) -> None:
    result = posenc_cli(
        *("fetch", "0", "10", "--table", "sincos_grid_2d", "--param", "grid_height=0"),
        *("--param", "embed_dim=8", "-o", str(tmp_path / "t.npy"), "--target", server.target),
    )
    assert result.returncode == 1
    line = result.stderr
    assert "spec.sincos_grid_2d.grid_width: not set (" in line
    assert "give it with --param grid_width=VALUE" in line
    # A 0 the user gave is still reported as given.
    assert "spec.sincos_grid_2d.grid_height: must be between 1 and" in line
    assert line.count("got 0") == 1


@pytest.mark.parametrize(
    "target",
    ["ipv4:not-an-address", "tls"],
    ids=["bad-uri", "tls-to-plaintext"],
)
def test_no_grpc_core_log_line_reaches_the_terminal(
    server: RunningServer, target: str, tmp_path: Path
) -> None:
    args = ["--target", target]
    if target == "tls":  # a TLS client against a plaintext server: handshakes fail
        roots = Path(grpc.__file__).parent / "_cython" / "_credentials" / "roots.pem"
        args = ["--target", server.target, "--tls-ca", str(roots)]
    result = posenc_cli("info", *args, "--timeout", "1")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("posenc info: ")


def test_info_lists_each_kinds_parameters(server: RunningServer) -> None:
    result = posenc_cli("info", "--target", server.target)
    assert result.returncode == 0, result.stderr
    text = result.stdout.split("\nparameters:", 1)[1]
    kinds = {line.split(":")[0].strip() for line in text.splitlines()[1:] if line[2] != " "}
    assert {"sinusoidal", "rotary", "rotary.yarn", "mrope"} <= kinds
    head_dim = next(line for line in text.splitlines() if line.split()[:1] == ["head_dim"])
    assert "(required)" in head_dim
    assert any(line.split()[:3] == ["rope_theta", "=", "10000"] for line in text.splitlines())


@pytest.mark.slow  # a table of 2 GiB, and the retry budget after the server is gone
@pytest.mark.timeout(180)
def test_a_server_gone_mid_fetch_is_reported_as_the_server(
    spawn_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = spawn_server()
    output = tmp_path / "t.npy"
    fetch = subprocess.Popen(
        [
            *(str(BIN / "posenc"), "fetch", "0", str(1 << 19), "--d-model", "1024"),
            *("-o", str(output), "--target", server.target, "--no-progress"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Once rows are being written (more than the first chunk), stop the fetch, take its
        # server away, and let it go on.
        while written(fetch.pid) < 8 << 20:
            assert fetch.poll() is None, fetch.stderr.read() if fetch.stderr else ""
            time.sleep(0.02)
        fetch.send_signal(signal.SIGSTOP)
        server.kill()
        fetch.send_signal(signal.SIGCONT)
        _, err = fetch.communicate(timeout=120)
    finally:
        if fetch.poll() is None:
            fetch.kill()
    assert fetch.returncode == 1
    assert err.startswith("posenc fetch: UNAVAILABLE: "), err
    assert "cannot write" not in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def written(pid: int) -> int:
    """Bytes process ``pid`` has written so far (``wchar`` of /proc/PID/io)."""
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))


@pytest.mark.slow  # a table of 2 GiB
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_fetch_ended_by_a_signal_leaves_no_file(
    server: RunningServer, tmp_path: Path, signum: signal.Signals
) -> None:
    fetch = subprocess.Popen(
        [
            *(str(BIN / "posenc"), "fetch", "0", str(1 << 19), "--d-model", "1024"),
            *("-o", str(tmp_path / "t.npy"), "--target", server.target, "--no-progress"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while written(fetch.pid) < 8 << 20:  # rows are being written
            assert fetch.poll() is None, fetch.stderr.read() if fetch.stderr else ""
            time.sleep(0.02)
        fetch.send_signal(signum)
        _, err = fetch.communicate(timeout=120)
    finally:
        if fetch.poll() is None:
            fetch.kill()
    if signum == signal.SIGTERM:
        assert (fetch.returncode, err) == (128 + signum, "posenc fetch: stopped by SIGTERM\n")
    assert list(tmp_path.iterdir()) == []


def process_tree(pid: int) -> list[int]:
    """``pid`` and its children (a server's supervisor and its workers)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listing:
            children += [int(child) for child in listing.read().split()]
    return [pid, *children]


@pytest.mark.slow  # starts a server process
@pytest.mark.timeout(120)
def test_a_disk_filled_by_another_writer_mid_fetch_takes_nothing_from_it(
    spawn_server: Callable[..., ServerProcess], small_disk: Path, tmp_path: Path
) -> None:
    """The fetch reserves its file's space before the first row: another writer that fills
    the disk while rows are still on their way gets the rest, not the table's space."""
    server = spawn_server()
    free = shutil.disk_usage(small_disk).free
    output = small_disk / "t.npy"
    rows, width = free // 2 // 1024, 256  # half the disk
    fetch = subprocess.Popen(
        [
            *(str(BIN / "posenc"), "fetch", "0", str(rows), "--d-model", str(width)),
            *("-o", str(output), "--target", server.target, "--chunk-bytes", "16KiB"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    paused = []
    try:
        # Once the fetch has taken disk space (the first rows arrived), the server pauses:
        # most rows are still on their way (far more than any flow-control window).
        while shutil.disk_usage(small_disk).free == free:
            assert fetch.poll() is None, fetch.stderr.read() if fetch.stderr else ""
            time.sleep(0.001)
        for pid in process_tree(server.process.pid):
            os.kill(pid, signal.SIGSTOP)
            paused.append(pid)
        # A tmpfs allocates a reservation page by page: the other writer starts once the
        # fetch holds the whole table's space, or it would take pages the reservation has
        # yet to get, which is a race, not the behaviour under test.
        deadline = time.monotonic() + 30
        while free - shutil.disk_usage(small_disk).free < rows * width * 4:
            assert fetch.poll() is None, fetch.stderr.read() if fetch.stderr else ""
            assert time.monotonic() < deadline, "the fetch did not reserve its table's space"
            time.sleep(0.001)
        with (
            open(small_disk / "filler", "wb", buffering=0) as filler,
            pytest.raises(OSError) as full,
        ):
            while True:
                filler.write(b"\0" * 4096)
        assert "No space left" in str(full.value)
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    _, err = fetch.communicate(timeout=60)
    assert fetch.returncode == 0, err
    with posenc.Client(server.target) as client:
        assert np.array_equal(np.load(output), client.get_range(0, rows, width))


@pytest.mark.slow  # the default waits: 20 s for fetch, 10 s for info
def test_a_port_that_never_answers_fails_fetch_and_info_naming_it(tmp_path: Path) -> None:
    """A port that accepts connections and never answers (a hung process, another program):
    fetch, whose --timeout defaults to none (a table may take hours), info and plot give up
    after their waits, each in one line that names the address and the flag to wait
    longer, and no file is left behind."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel accepts; nobody ever reads
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        output = tmp_path / "never.npy"
        started = time.monotonic()
        commands = {
            "fetch": ["fetch", "0", "10", "--d-model", "8", "-o", str(output)],
            "info": ["info"],
            "plot": ["plot", "heatmap", "--timeout", "5", "-o", str(tmp_path / "never.png")],
        }
        running = {
            name: subprocess.Popen(
                [str(BIN / "posenc"), *argv, "--target", target],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, argv in commands.items()
        }
        answers = {name: process.communicate(timeout=100) for name, process in running.items()}
        elapsed = time.monotonic() - started
    for name, process in running.items():
        _, stderr = answers[name]
        assert process.returncode == 1, stderr
        flag = "--connect-timeout" if name == "fetch" else "--timeout"
        assert stderr.count("\n") == 1 and stderr.startswith(f"posenc {name}: "), stderr
        assert f"no answer from {target} within" in stderr and flag in stderr, stderr
    assert elapsed < 90 and list(tmp_path.iterdir()) == []


def test_a_parameter_given_as_0_is_refused_as_given(server: RunningServer, tmp_path: Path) -> None:
    result = posenc_cli(
        *("fetch", "0", "10", "--d-model", "8", "--base", "0"),
        *("-o", str(tmp_path / "t.npy"), "--target", server.target),
    )
    assert result.returncode == 1
    assert "spec.sinusoidal.base: must be" in result.stderr, result.stderr
    assert "not set" not in result.stderr and "got 0" in result.stderr


def test_a_table_larger_than_any_disk_is_said_in_its_unit(
    server: RunningServer, tmp_path: Path
) -> None:
    result = posenc_cli(  # 2**42 rows of 4 KiB: 16 PiB
        *("fetch", "0", "2**42", "--d-model", "1024", "-o", str(tmp_path / "t.npy")),
        *("--target", server.target),
    )
    assert result.returncode == 1
    assert "the table takes 16.0 PiB" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []
