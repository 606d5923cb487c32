"""Configuration from defaults, POSENC_* variables and flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posenc_server.app import run
from posenc_server.config import GIB, MIB, ServerConfig


def test_embedded_defaults_match_the_contract() -> None:
    config = ServerConfig.from_args([], environ={})
    assert config.address == "127.0.0.1:50051"
    assert config.max_d_model == 65536
    assert config.max_abs_position == 2**42
    assert config.max_positions == 1_048_576
    assert config.max_chunk_bytes == MIB
    assert config.max_stream_bytes == 16 * GIB
    assert config.cache_bytes == 512 * MIB
    # A unary result plus framing fits a default client's 4 MiB receive limit.
    assert config.max_unary_bytes + 1024 <= 4 * MIB
    # The largest accepted position list (10 bytes per packed int64) fits the receive limit.
    assert config.max_receive_message_bytes >= 1_048_576 * 10 + 100


def test_flags_beat_environment_which_beats_defaults() -> None:
    environ = {"POSENC_PORT": "6000", "POSENC_CACHE_BYTES": "2**20", "POSENC_HOST": "0.0.0.0"}
    config = ServerConfig.from_args(["--port", "7000", "--grace-seconds", "2.5"], environ)
    assert config.port == 7000
    assert config.cache_bytes == 2**20
    assert config.host == "0.0.0.0"
    assert config.grace_seconds == 2.5


def test_config_is_frozen() -> None:
    config = ServerConfig()
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {"POSENC_PORT": "eighty"}, "POSENC_PORT"),
        (["--port", "70000"], {}, "--port (POSENC_PORT)"),
        (["--max-chunk-bytes", str(8 * MIB)], {}, "--max-chunk-bytes"),
        (["--max-chunk-bytes", "1000"], {}, "--max-chunk-bytes"),
        (["--grace-seconds", "soon"], {}, "--grace-seconds"),
        (["--log-level", "LOUD"], {}, "--log-level"),
        ([], {"POSENC_CACHE_BYTES": "2**1000000000"}, "POSENC_CACHE_BYTES"),
        # Non-finite and out-of-range numbers, named by flag and variable.
        (["--max-connection-age-seconds", "inf"], {}, "--max-connection-age-seconds"),
        (["--max-connection-age-seconds", "nan"], {}, "--max-connection-age-seconds"),
        (["--max-connection-age-seconds", "1e12"], {}, "--max-connection-age-seconds"),
        (["--grace-seconds", "nan"], {}, "--grace-seconds"),
        ([], {"POSENC_GRACE_SECONDS": "-inf"}, "POSENC_GRACE_SECONDS"),
        (["--grace-seconds", "-1"], {}, "--grace-seconds"),
        (["--workers", "0"], {}, "--workers (POSENC_WORKERS)"),
        (["--cache-bytes", "-1"], {}, "--cache-bytes"),
        (["--cache-bytes", "1 furlong"], {}, "512MiB"),
        # gRPC takes these as C ints: 2**40 ended the start in a traceback.
        (["--max-connections", "2**40"], {}, "--max-connections (POSENC_MAX_CONNECTIONS)"),
        (["--max-unary-bytes", "2**40"], {}, "--max-unary-bytes (POSENC_MAX_UNARY_BYTES)"),
        (["--max-unary-bytes", "2**31"], {}, "--max-unary-bytes"),
        # No request arrives in a nanosecond: every call failed, health checks included.
        (["--read-timeout-seconds", "1e-9"], {}, "--read-timeout-seconds"),
        (["--read-timeout-seconds", "0"], {}, "--read-timeout-seconds"),
        # An empty host bound the unauthenticated metrics to every interface.
        (["--metrics-host", ""], {}, "--metrics-host (POSENC_METRICS_HOST)"),
        ([], {"POSENC_METRICS_HOST": " "}, "--metrics-host (POSENC_METRICS_HOST)"),
    ],
)
def test_invalid_values_are_refused_naming_the_setting(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig.from_args(argv, environ)


@pytest.mark.parametrize(
    ("text", "value"),
    [("512MiB", 512 * MIB), ("1GiB", GIB), ("64 KiB", 64 << 10), ("1mb", 10**6), ("2**20", MIB)],
)
def test_sizes_take_units(text: str, value: int) -> None:
    assert ServerConfig.from_args([], {"POSENC_CACHE_BYTES": text}).cache_bytes == value


def test_every_invalid_value_is_one_line_naming_flag_and_variable() -> None:
    with pytest.raises(ValueError) as caught:
        ServerConfig.from_args(["--max-connection-age-seconds", "inf"], {})
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError) as caught:
        ServerConfig.from_args(["--port", "-5", "--workers", "0"], {})
    message = str(caught.value)
    assert "--port (POSENC_PORT)" in message and "--workers (POSENC_WORKERS)" in message
    assert "got -5" in message


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ServerConfig.from_args(["--help"], {})
    text = " ".join(capsys.readouterr().out.split())
    assert "(default ;" not in text
    assert "(default none; env POSENC_TLS_CERT_FILE)" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-connections", "2**40"],
        ["--max-unary-bytes", "2**40"],
        ["--read-timeout-seconds", "1e-9"],
        ["--metrics-host", ""],
    ],
)
@pytest.mark.timeout(60)  # accepted, the server would serve until stopped
def test_serve_refuses_what_grpc_cannot_take_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``posenc serve`` says what is wrong and exits 2, before anything listens."""
    assert run([*argv, "--port", "0", "--metrics-port", "-1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("posenc-server: invalid configuration: " + argv[0])
    assert "Traceback" not in error and error.count("\n") == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_first_start_says_it_compiles_the_kernels_before_it_listens(tmp_path: Path) -> None:
    """A fresh clone's first `make run` compiles the kernels for a minute or more before it
    listens: it says so within seconds instead of printing nothing (an empty numba cache is
    a first start)."""
    serve = [sys.executable, "-m", "posenc_server", "--port", "0", "--metrics-port", "-1"]
    process = subprocess.Popen(
        [*serve, "--processes", "1"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")},
    )
    assert process.stderr is not None
    try:
        started = time.monotonic()
        first = json.loads(process.stderr.readline())
        waited = time.monotonic() - started
    finally:
        process.kill()
        process.wait(30)
    assert first["message"].startswith("preparing the kernels: compiling them takes"), first
    # Its imports take seconds on a loaded machine; the compilation takes a minute or more.
    assert waited < 40, waited
