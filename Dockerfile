# The gateway and binder image (compose/ and kubernetes/ run `gateway serve` and
# `binder run` from it). The server and binder extras, not [local]: Triton, Redis and
# MongoDB are their own containers in production. model_repo/, compose/ and nginx/ ship
# inside the package (gateway model-repo uses them).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY binder ./binder
COPY model_repo ./model_repo
COPY compose ./compose
COPY nginx ./nginx
RUN pip install '.[server,binder]' \
    && useradd --system --uid 10001 --home-dir /app app \
    && mkdir -p /app /data/faiss && chown app /app /data/faiss \
    && rm -rf /src

WORKDIR /app
USER app
EXPOSE 8080 8090
CMD ["gateway", "serve"]
