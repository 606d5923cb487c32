"""``posenc health``: the grpc.health.v1 status of each target, or the metrics port's
/healthz over HTTP; exits 0 when SERVING."""

from __future__ import annotations

import _ssl
import argparse
import http.client
import os
import sys
import urllib.request
from typing import Any, Final

from posenc.cli._shared import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    _add_client_arguments,
    _client,
    _Command,
    _targets,
)
from posenc.errors import PosencError

# The server's TLS settings (posenc_server.config): `posenc health` runs where the server
# runs (`podman exec`, a Kubernetes exec probe), with the server's environment, so a TLS
# server's probe speaks TLS without flags of its own.
_SERVER_CERT_ENV = "POSENC_TLS_CERT_FILE"


_SERVER_KEY_ENV = "POSENC_TLS_KEY_FILE"


_SERVER_CLIENT_CA_ENV = "POSENC_TLS_CLIENT_CA_FILE"


# And its metrics port (posenc_server.config), where /healthz answers (posenc_server.metrics).
_SERVER_METRICS_PORT_ENV = "POSENC_METRICS_PORT"


_DEFAULT_METRICS_PORT = 9464


_HEALTH_PATH = "/healthz"


# /healthz's body is one word; more is not read.
_HEALTH_BODY_BYTES = 64


COMMAND: Final = _Command(
    "check health: exit 0 when SERVING, 1 otherwise",
    "Print the grpc.health.v1 status; exit 0 when SERVING, 1 otherwise (NOT_SERVING, "
    "unreachable, timeout). With several --target, checks each one. Without TLS flags, when "
    f"${_SERVER_CERT_ENV} is set (the probe runs next to a TLS server, with its environment), "
    "it connects with TLS trusting that certificate, under the name it carries, and presents "
    f"it as its own when ${_SERVER_CLIENT_CA_ENV} is set (mutual TLS).",
)


def _certificate_name(path: str) -> str | None:
    """The first DNS name (else the common name) of the first certificate in ``path``."""
    try:
        # The standard library's own certificate decoder (what SSLSocket.getpeercert()
        # returns), which it exposes under this name only; no X.509 dependency needed.
        decoded = _ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):  # AttributeError: a Python without it
        return None
    for kind, value in decoded.get("subjectAltName", ()):
        if kind == "DNS":
            return str(value)
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _probe_tls_from_server_environment(args: argparse.Namespace) -> None:
    """Without TLS flags, next to a TLS server (``POSENC_TLS_CERT_FILE``): trust exactly the
    certificate the server serves, under the name it carries, and under mutual TLS
    (``POSENC_TLS_CLIENT_CA_FILE``) present that certificate and key as the client's."""
    cert = os.environ.get(_SERVER_CERT_ENV)
    if not cert or args.tls_ca or args.tls_cert:
        return
    args.tls_ca = cert
    if os.environ.get(_SERVER_CLIENT_CA_ENV):
        args.tls_cert, args.tls_key = cert, os.environ.get(_SERVER_KEY_ENV)
    if not args.tls_server_name:
        args.tls_server_name = _certificate_name(cert)


def run(args: argparse.Namespace) -> int:
    if args.http is not None:
        if args.target or args.service:
            print("posenc health: --http asks a URL: no --target or --service", file=sys.stderr)
            return EXIT_USAGE
        url = args.http or _default_health_url()
        if url is None:
            return EXIT_USAGE
        return _http_health(url, args.timeout)
    _probe_tls_from_server_environment(args)
    targets = _targets(args)
    healthy = True
    for target in targets:
        # A probe reports the present: no retries, and a short deadline.
        with _client(args, [target], max_retries=0) as client:
            try:
                status = client.health(args.service)
            except PosencError as error:
                status = "UNREACHABLE"
                print(f"posenc health: {target}: {error}", file=sys.stderr)
        healthy = healthy and status == "SERVING"
        print(status if len(targets) == 1 else f"{target}: {status}")
    return EXIT_OK if healthy else EXIT_FAILURE


def _default_health_url() -> str | None:
    """/healthz of ``$POSENC_METRICS_PORT`` (9464 unset) on 127.0.0.1, or None (said why)
    when that is not a port to probe: 0 (a port the server picks) or -1 (metrics off)."""
    value = os.environ.get(_SERVER_METRICS_PORT_ENV) or str(_DEFAULT_METRICS_PORT)
    if not value.isdecimal() or not 1 <= int(value) <= 65535:
        print(
            f"posenc health: {_SERVER_METRICS_PORT_ENV}={value[:32]!r} is no port to probe "
            "(/healthz needs the metrics port on, at a fixed port): give --http URL",
            file=sys.stderr,
        )
        return None
    return f"http://127.0.0.1:{int(value)}{_HEALTH_PATH}"


class _EveryStatus(urllib.request.HTTPErrorProcessor):
    """A probe reports the answer it got, whatever its status: no error is raised for a
    503 or a 404, and no redirect is followed (a redirect is an answer: ``HTTP 302``)."""

    def http_response(self, request: Any, response: Any) -> Any:
        return response

    https_response = http_response


# /healthz's answers (posenc_server.metrics); any other is printed as its HTTP status.
_HEALTH_WORDS = frozenset({"SERVING", "NOT_SERVING"})


def _http_health(url: str, timeout: float) -> int:
    """``posenc health --http``: GET ``url``; prints its status word (UNREACHABLE when there
    is no HTTP answer) and exits 0 on 200 SERVING alone."""
    if not url.startswith(("http://", "https://")):
        print(
            f"posenc health: --http takes an http:// or https:// URL: {url[:64]!r}", file=sys.stderr
        )
        return EXIT_USAGE
    # Straight to the URL: a proxy from the environment has no business with a local probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _EveryStatus())
    try:
        with opener.open(url, timeout=timeout) as response:
            code, body = response.status, response.read(_HEALTH_BODY_BYTES)
    except http.client.HTTPException as error:  # such as the gRPC port's HTTP/2 frames
        reason: object = f"no HTTP/1.x answer ({type(error).__name__})"  # not its bytes
    except (OSError, ValueError) as error:  # refused, timed out, a malformed URL
        reason = getattr(error, "reason", None) or error
    else:
        words = body.decode("ascii", "replace").split()
        status = words[0] if words and words[0] in _HEALTH_WORDS else f"HTTP {code}"
        print(status)
        return EXIT_OK if (code, status) == (200, "SERVING") else EXIT_FAILURE
    print(f"posenc health: {url}: {reason}", file=sys.stderr)
    print("UNREACHABLE")
    return EXIT_FAILURE


def add_arguments(health: argparse.ArgumentParser) -> None:
    """The ``health`` command's arguments."""
    health.add_argument("--service", default="", help='service name (default "": the server)')
    health.add_argument(
        "--http",
        nargs="?",
        const="",
        metavar="URL",
        help="ask the metrics port's /healthz over HTTP instead (200 SERVING, 503 NOT_SERVING), "
        "which answers whatever holds the gRPC port's connections (NOT_SERVING when they "
        "leave no room for a new call; /livez: SERVING all the same); URL defaults to "
        f"http://127.0.0.1:${_SERVER_METRICS_PORT_ENV}/healthz ({_DEFAULT_METRICS_PORT} when "
        "unset): the server's own metrics port where the probe runs beside it",
    )
    _add_client_arguments(health, timeout=2.0)
