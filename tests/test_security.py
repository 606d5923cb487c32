"""TLS, mutual TLS and bearer tokens, with certificates the test makes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme
from conftest import Spawn, token_file

import posenc
from posenc.cli import main
from posenc_server.app import RunningServer

POSENC = str(Path(sys.executable).parent / "posenc")


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


def pem_files(authority: trustme.CA, directory: Path) -> dict[str, Path]:
    server = authority.issue_cert("127.0.0.1", "localhost")
    client = authority.issue_cert("client.posenc.test")
    files = {
        "ca": directory / "ca.pem",
        "server_cert": directory / "server.pem",
        "server_key": directory / "server.key",
        "client_cert": directory / "client.pem",
        "client_key": directory / "client.key",
    }
    authority.cert_pem.write_to_path(str(files["ca"]))
    server.private_key_pem.write_to_path(str(files["server_key"]))
    server.cert_chain_pems[0].write_to_path(str(files["server_cert"]))
    client.private_key_pem.write_to_path(str(files["client_key"]))
    client.cert_chain_pems[0].write_to_path(str(files["client_cert"]))
    return files


def credentials(files: dict[str, Path], *, client_cert: bool) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        files["ca"].read_bytes(),
        files["client_key"].read_bytes() if client_cert else None,
        files["client_cert"].read_bytes() if client_cert else None,
    )


def test_tls_serves_encrypted_and_refuses_plaintext(
    server_factory: Callable[..., RunningServer], authority: trustme.CA, tmp_path: Path
) -> None:
    files = pem_files(authority, tmp_path)
    server = server_factory(
        tls_cert_file=str(files["server_cert"]), tls_key_file=str(files["server_key"])
    )
    with posenc.Client(server.target, credentials=credentials(files, client_cert=False)) as client:
        np.testing.assert_allclose(client.get_range(1, 2, 2), [[np.sin(1), np.cos(1)]], 1e-6)
    with (
        posenc.Client(server.target, max_retries=0, timeout=5) as plaintext,
        pytest.raises(posenc.UnavailableError),
    ):
        plaintext.get_range(0, 1, 2)


def test_mutual_tls_requires_a_client_certificate(
    server_factory: Callable[..., RunningServer], authority: trustme.CA, tmp_path: Path
) -> None:
    files = pem_files(authority, tmp_path)
    server = server_factory(
        tls_cert_file=str(files["server_cert"]),
        tls_key_file=str(files["server_key"]),
        tls_client_ca_file=str(files["ca"]),
    )
    with posenc.Client(server.target, credentials=credentials(files, client_cert=True)) as client:
        assert client.get_range(0, 3, 8).shape == (3, 8)
    anonymous = credentials(files, client_cert=False)
    with (
        posenc.Client(server.target, credentials=anonymous, max_retries=0, timeout=5) as client,
        pytest.raises(posenc.UnavailableError),
    ):
        client.get_range(0, 3, 8)


def test_bearer_token_is_required_except_for_health(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    server = server_factory(auth_token_file=str(token_file(tmp_path, "s3cret-token\n")))
    # Local credentials: plaintext to this machine, where gRPC sends call credentials.
    local = grpc.local_channel_credentials()
    with posenc.Client(server.target, token="s3cret-token", credentials=local) as client:
        assert client.get_range(0, 2, 4).shape == (2, 4)
        assert client.server_info().version == "1.0.0"
        assert [len(rows) for _, rows in client.iter_range(0, 10, 4)] == [10]
    for token in (None, "wrong", "s3cret-token-but-longer"):
        with posenc.Client(server.target, token=token, credentials=local, max_retries=0) as client:
            with pytest.raises(posenc.UnauthenticatedError):
                client.get_range(0, 2, 4)
            with pytest.raises(posenc.UnauthenticatedError):
                list(client.iter_range(0, 10, 4))
            # Probes carry no token: health stays open.
            assert client.health() == "SERVING"


@pytest.mark.slow
def test_cli_sends_token_and_tls_settings(
    spawn_server: Spawn, authority: trustme.CA, tmp_path: Path
) -> None:
    files = pem_files(authority, tmp_path)
    tokens = token_file(tmp_path, "cli-token")
    process = spawn_server(
        0,
        *("--tls-cert-file", str(files["server_cert"]), "--tls-key-file", str(files["server_key"])),
        *("--tls-client-ca-file", str(files["ca"]), "--auth-token-file", str(tokens)),
    )
    tls = ["--tls-ca", str(files["ca"]), "--tls-cert", str(files["client_cert"])]
    tls += ["--tls-key", str(files["client_key"])]
    base = [POSENC, "info", "--target", process.target, *tls]
    ok = subprocess.run([*base, "--token-file", str(tokens)], capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    health = subprocess.run(
        [POSENC, "health", "--target", process.target, *tls], capture_output=True, timeout=30
    )
    assert health.returncode == 0, health.stderr


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_health_probe_speaks_tls_from_the_servers_environment(
    server_factory: Callable[..., RunningServer],
    authority: trustme.CA,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    mutual: bool,
) -> None:
    # The probe runs next to the server with its environment (the image's HEALTHCHECK):
    # POSENC_TLS_* alone make it connect with TLS, to a certificate issued for another name
    # than the probe's target.
    issued = authority.issue_cert("posenc.internal")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    environment = {"POSENC_TLS_CERT_FILE": str(cert), "POSENC_TLS_KEY_FILE": str(key)}
    if mutual:
        ca = tmp_path / "ca.pem"
        authority.cert_pem.write_to_path(str(ca))
        environment["POSENC_TLS_CLIENT_CA_FILE"] = str(ca)
    server = server_factory(
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        tls_client_ca_file=environment.get("POSENC_TLS_CLIENT_CA_FILE", ""),
    )
    probe = ["health", "--target", server.target, "--timeout", "3"]
    assert main(probe) == 1  # plaintext against TLS
    capsys.readouterr()
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main(probe) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == "SERVING"
    # Explicit flags win over the environment: a CA that did not issue the certificate fails.
    stranger = tmp_path / "stranger.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    assert main([*probe, "--tls-ca", str(stranger)]) == 1
    if mutual:
        # Without the client CA setting the probe presents no certificate: refused.
        monkeypatch.delenv("POSENC_TLS_CLIENT_CA_FILE")
        assert main(probe) == 1


# A fresh program that imports posenc first, as a user's does, makes one call and prints
# the error it gets: what a user sees of a mistake, stderr included.
_ONE_CALL = """
import sys
import posenc, grpc
target, ca, name = sys.argv[1], sys.argv[2], sys.argv[3]
options = [("grpc.ssl_target_name_override", name)] if name else None
credentials = grpc.ssl_channel_credentials(open(ca, "rb").read()) if ca else None
try:
    with posenc.Client(target, credentials=credentials, options=options, timeout=30) as client:
        client.get_range(0, 1, 2)
except posenc.PosencError as error:
    print(error)
"""


def _one_call(target: str, ca: Path | None = None, name: str = "") -> tuple[str, str]:
    """The error a program's one call to ``target`` gets (with TLS trusting ``ca``, under
    ``name``), and what the program wrote to stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _ONE_CALL, target, str(ca or ""), name],
        capture_output=True,
        text=True,
        timeout=120,
        env={key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"},
    )
    return done.stdout.strip(), done.stderr


def test_tls_and_address_mistakes_say_the_fix_in_one_line(
    server_factory: Callable[..., RunningServer], authority: trustme.CA, tmp_path: Path
) -> None:
    """A client that speaks TLS to a plaintext server, trusts the wrong CA, expects another
    name, calls a TLS server in plaintext, calls an HTTP/1 port (the metrics port) or a unix
    socket that is not there gets one error naming the target and the fix; the mistakes
    that trying again cannot mend fail at the first attempt; gRPC's core writes nothing."""
    files = pem_files(authority, tmp_path)
    tls = server_factory(
        tls_cert_file=str(files["server_cert"]), tls_key_file=str(files["server_key"])
    )
    plaintext = server_factory()
    stranger = tmp_path / "stranger.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    http = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    at_once = {
        "does not speak TLS": _one_call(plaintext.target, files["ca"]),
        "--tls-server-name": _one_call(tls.target, files["ca"], "wrong.example"),
        "--tls-ca)": _one_call(tls.target, stranger),
        "not with gRPC": _one_call(f"127.0.0.1:{http.server_port}"),
    }
    http.shutdown()
    for fix, (error, stderr) in at_once.items():
        assert fix in error and "attempts)" not in error, error
        assert stderr == "", stderr
    missing = f"unix:{tmp_path / 'nothing.sock'}"
    retried = {
        "a TLS server, called without TLS": _one_call(tls.target),
        f"no posenc server at {missing} (no socket there): is it running?": _one_call(missing),
    }
    for fix, (error, stderr) in retried.items():
        assert fix in error and "(after 7 attempts)" in error, error
        assert stderr == "", stderr
    for error, _ in (*at_once.values(), *retried.values()):
        assert len(error.splitlines()) == 1 and error.startswith("UNAVAILABLE: "), error
    assert tls.target in at_once["--tls-ca)"][0]


def test_a_number_for_a_target_says_what_a_target_is() -> None:
    with pytest.raises(TypeError, match=r"got the number 12345: .*Client\('127.0.0.1:12345'\)"):
        posenc.Client(12345)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="target must be 'host:port'"):
        posenc.Client(None)  # type: ignore[arg-type]


def test_clients_tls_mistakes_leave_the_servers_log_one_json_object_a_line(
    spawn_server: Spawn, authority: trustme.CA, tmp_path: Path
) -> None:
    """A plaintext client retrying against a TLS server adds no line of gRPC's core to the
    server's log, which stays JSON; a client expecting another name adds at most the core's
    ERROR line, once (no INFO or WARNING line a handshake)."""
    files = pem_files(authority, tmp_path)
    server = spawn_server(
        0, "--tls-cert-file", str(files["server_cert"]), "--tls-key-file", str(files["server_key"])
    )
    _one_call(server.target)  # plaintext, retried
    with posenc.Client(server.target, credentials=credentials(files, client_cert=False)) as ok:
        assert ok.health() == "SERVING"  # the server took the attempts, and serves on
    lines = [line for line in server.log_lines if line.strip()]
    assert all(line.startswith("{") for line in lines), "".join(lines)
    _one_call(server.target, files["ca"], "wrong.example")
    time.sleep(1)  # the server's stderr, read by a thread of the fixture's
    core = [line for line in server.log_lines if line.strip() and not line.startswith("{")]
    # At most one a connection the client opened (posenc.Client's default is 8).
    assert len(core) <= 8 and all(line.startswith("E") for line in core), core
