# The gateway and binder image (compose/ runs `gateway serve` and `binder run` from it).
# No [local] extra: Triton, Redis and MongoDB are their own containers in production.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so that a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p gateway binder && touch gateway/__init__.py binder/__init__.py \
    && pip install . \
    && pip uninstall -y triton-gateway

COPY gateway ./gateway
COPY binder ./binder
RUN pip install --no-deps . \
    && useradd --system --uid 10001 --home-dir /app app \
    && mkdir -p /data/faiss && chown app /data/faiss

USER app
EXPOSE 8080 8090
CMD ["gateway", "serve"]
