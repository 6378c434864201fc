# syntax=docker/dockerfile:1
# lmops inference image: gunicorn serving the promoted model on port 5001.
#
#   CPU (default):  docker build -t lmops:dev .
#   NVIDIA GPU:     docker build --build-arg VARIANT=cuda -t lmops:dev-cuda .
#
# VARIANT selects the base image and the torch wheel index together. Python 3.11
# comes from uv (its version pins the CPython build), so both bases work alike.
# The model in production_service/model (from `make run` or `dvc pull`) is baked in
# when present; otherwise mount one at /app/production_service/model at run time,
# or set LMOPS_MODEL_URI (e.g. models:/lmops@champion) and MLFLOW_TRACKING_URI.

ARG VARIANT=cpu

FROM ghcr.io/astral-sh/uv:0.9.5 AS uv

FROM debian:12.12-slim AS base-cpu
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu128 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# --- build: a virtual environment from the lock file, then lmops itself ---------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_NO_CACHE=1
RUN uv venv --seed --python 3.11 /opt/venv
WORKDIR /src
# torch==2.13.0 in the lock resolves to the +cpu or +cu128 build: PIP_EXTRA_INDEX_URL
# (set by the base above) offers it and pip prefers the local-version wheel.
COPY requirements.lock ./
RUN /opt/venv/bin/pip install --no-cache-dir -r requirements.lock
COPY pyproject.toml README.md ./
COPY src/ src/
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps .

# --- runtime: the environment, the service, the model; non-root ------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HOST=0.0.0.0 \
    PORT=5001 \
    LMOPS_PROBE_PORT=5002 \
    LMOPS_MODEL_DIR=/app/production_service/model
RUN groupadd --system --gid 10001 lmops \
    && useradd --system --uid 10001 --gid lmops --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin lmops
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY params.yaml ./
COPY production_service/ production_service/
USER 10001:10001
EXPOSE 5001 5002
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('LMOPS_PROBE_PORT', '5002') + '/health', timeout=4)"]
CMD ["gunicorn", "--config", "production_service/gunicorn.conf.py"]
