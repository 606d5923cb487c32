"""Configuration from defaults, POSENC_* variables and flags."""

from __future__ import annotations

import re

import pytest

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
        (["--port", "70000"], {}, "port"),
        (["--max-chunk-bytes", str(8 * MIB)], {}, "max_chunk_bytes"),
        (["--max-chunk-bytes", "1000"], {}, "max_chunk_bytes"),
        (["--grace-seconds", "soon"], {}, "--grace-seconds"),
        (["--log-level", "LOUD"], {}, "log_level"),
        ([], {"POSENC_CACHE_BYTES": "2**1000000000"}, "POSENC_CACHE_BYTES"),
    ],
)
def test_invalid_values_are_refused_naming_the_setting(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig.from_args(argv, environ)
