"""Imported by ``posenc`` before anything imports ``grpc``: gRPC's C core logs at the
level ``GRPC_VERBOSITY`` names, read once, when ``grpc`` is first imported.

Unset, the core writes a line to stderr for every failed TLS handshake of every connection
(a client of 8 connections retrying 7 times writes dozens) before the SDK raises the one
error that says what went wrong and how to fix it. So the SDK makes ERROR the default:
whoever sets ``GRPC_VERBOSITY`` keeps their own choice, and a program that imported
``grpc`` before ``posenc`` keeps the core's default.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
