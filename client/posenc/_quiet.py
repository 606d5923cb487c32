"""Imported by ``posenc`` before anything else imports ``grpc``: gRPC's C core takes its log
level from ``GRPC_VERBOSITY`` once, when ``grpc`` is first imported.

Unset, the core writes a line to stderr for every failed TLS handshake of every connection
(a client of 8 connections retrying 7 times wrote dozens) before the SDK raises the one
error that says what went wrong and how to fix it. So ``grpc`` is imported here with ERROR
as the level, and the variable is put back as it was: whoever sets ``GRPC_VERBOSITY`` keeps
their choice, the process's children inherit nothing from posenc, and a program that
imported ``grpc`` before ``posenc`` keeps the core's default.
"""

from __future__ import annotations

import os

#: Whether the process chose gRPC's log level itself (before posenc was imported).
CHOSEN = bool(os.environ.get("GRPC_VERBOSITY"))

if not CHOSEN:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
    try:
        import grpc  # noqa: F401  (read here, once)
    finally:
        del os.environ["GRPC_VERBOSITY"]
