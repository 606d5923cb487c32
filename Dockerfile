# Slim, non-root image of the posenc server.
#
#   docker build -t posenc:1.0.0 .
#
# PYTHON_IMAGE picks the base: any image with python3 (>= 3.11) and its venv module, such as
# the default python:3.11-slim or a Debian rootfs with python3 and python3-venv. WHEELHOUSE
# names a directory of wheels, made visible to the build (`podman build -v DIR:/wheelhouse`),
# to install from instead of the package index: the build then needs no network.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG WHEELHOUSE=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# A virtualenv works on every base: Debian's own python3 refuses system-wide pip installs.
RUN python3 -m venv /opt/posenc
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY client ./client
COPY server ./server
# The SDK's distribution (the CLI, and posenc_protocol) and the server's, side by side. The
# installer is not needed at run time: it leaves the image with the build stage.
RUN /opt/posenc/bin/pip install ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} . ./server \
    && /opt/posenc/bin/pip uninstall --yes --quiet pip setuptools \
    && /opt/posenc/bin/posenc serve --help >/dev/null
# The engine's kernels, compiled now into a cache a new container copies at start
# (POSENC_KERNEL_CACHE_SEED): each server process then loads them in well under a second
# instead of compiling for some 20 s, on hosts with the CPU of the one that built the image.
RUN NUMBA_CACHE_DIR=/opt/posenc/kernel-cache /opt/posenc/bin/python -c \
    "from posenc_server import warmup; warmup.warm_up()"

FROM ${PYTHON_IMAGE}
# A fixed uid and gid, so that volumes, runAsUser and file ownership can name them.
RUN groupadd --system --gid 10001 posenc \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin posenc
COPY --from=build /opt/posenc /opt/posenc
# numba caches the engine's compiled kernels beside their source, which is read-only here:
# in /tmp instead (writable in the compose and Kubernetes setups), seeded at start with the
# kernels compiled when the image was built.
ENV PATH=/opt/posenc/bin:$PATH \
    POSENC_HOST=0.0.0.0 \
    POSENC_METRICS_HOST=0.0.0.0 \
    POSENC_PORT=50051 \
    PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    POSENC_KERNEL_CACHE_SEED=/opt/posenc/kernel-cache \
    PYTHONUNBUFFERED=1
USER 10001:10001
# gRPC, then Prometheus metrics (POSENC_METRICS_PORT).
EXPOSE 50051 9464
# /healthz on the metrics port (POSENC_METRICS_PORT), as the kubelet probes it: plain HTTP
# whatever the gRPC port's TLS, and answered while a client holds every connection the gRPC
# port allows (which would fail a gRPC health check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["posenc", "health", "--http"]
# SIGTERM drains: in-flight calls get POSENC_GRACE_SECONDS (30 s) to finish.
STOPSIGNAL SIGTERM
ENTRYPOINT ["posenc"]
CMD ["serve"]
