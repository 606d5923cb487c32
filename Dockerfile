# Slim, non-root image of the posenc server. Build: docker build -t posenc:1.0.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[server]'

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin posenc
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'posenc[server]' \
    && rm -rf /wheels
USER 10001
ENV POSENC_HOST=0.0.0.0 \
    POSENC_METRICS_HOST=0.0.0.0 \
    POSENC_PORT=50051 \
    PYTHONUNBUFFERED=1
EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["posenc", "health", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["posenc"]
CMD ["serve"]
