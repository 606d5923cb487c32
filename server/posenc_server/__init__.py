"""posenc server: computes, caches and streams positional-encoding tables over gRPC.

gRPC's C core takes its log level from ``GRPC_VERBOSITY`` once, when ``grpc`` is first
imported, and unset it writes a line of its own to stderr for every failed TLS handshake
of every client (a plaintext client retrying wrote dozens): the server's log is one JSON
object a line, and a client's mistake is the client's to report. So ``grpc`` is imported
here with ERROR as the level, and the variable is put back as it was: whoever sets it keeps
their choice, and the server's children inherit nothing from this.
"""

from __future__ import annotations

import os

if not os.environ.get("GRPC_VERBOSITY"):
    os.environ["GRPC_VERBOSITY"] = "ERROR"
    try:
        import grpc  # noqa: F401  (the level is read here, once)
    finally:
        del os.environ["GRPC_VERBOSITY"]
