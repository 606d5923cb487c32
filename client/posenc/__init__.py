"""posenc: exact sinusoidal positional-encoding tables from a gRPC service."""
