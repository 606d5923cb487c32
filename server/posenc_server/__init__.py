"""posenc server: computes, caches and streams positional-encoding tables over gRPC."""
