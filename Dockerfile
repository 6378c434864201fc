# lmops images, two targets from one file:
#
#   runtime (default): gunicorn serving the promoted model on port 5001
#     CPU:         docker build -t lmops:dev .
#     NVIDIA GPU:  docker build --build-arg VARIANT=cuda -t lmops:dev-cuda .
#   pipeline: the `lmops` command and the pipeline's dependencies, for Kubeflow's steps
#     docker build --target pipeline -t lmops:dev-pipeline .
#
# The serving image carries the serving dependencies only, the exact pins of
# requirements-serve.lock (lmops[serve]: torch, tokenizers, safetensors, flask, gunicorn,
# prometheus-client, the skinny MLflow client), and of lmops only its runtime half
# (src/lmops/runtime and the shared leaves): no pipeline code. The pipeline image adds
# requirements.lock and all of lmops. Build arguments:
#   VARIANT      cpu | cuda: the base image and torch's build (+cpu or +cu128)
#   TORCH_INDEX  where torch's +cpu/+cu128 wheels are (VARIANT's folder below it);
#                empty: the pip configuration already offers them (a mirror)
#   PYTHON       managed: CPython 3.11 downloaded by uv, pinned by uv's version (a mirror
#                of those builds: --build-arg UV_PYTHON_INSTALL_MIRROR=...);
#                system: the base's own python3.11
# Behind a package mirror, give pip its configuration as build secrets, which never
# land in the image: --secret id=pip.conf,src=<pip.conf> [--secret id=ca.crt,src=<CA bundle>]
# (the ca.crt secret is at /run/secrets/ca.crt: name it as `cert` in that pip.conf).
# docs/deploy.md has the recipe; deploy/image_test.sh builds this way, offline.
#
# The model in production_service/model (from `make run` or `dvc pull`) is baked in
# when present; otherwise mount one at /app/production_service/model at run time,
# or set LMOPS_MODEL_URI (e.g. models:/lmops@champion) and MLFLOW_TRACKING_URI.

ARG VARIANT=cpu

FROM ghcr.io/astral-sh/uv:0.9.5 AS uv

FROM debian:12.12-slim AS base-cpu
ARG PYTHON=managed
# tcmalloc, preloaded in every process (as `lmops serve` preloads it: production_service/
# server.py, serving_env): torch's 64-byte-aligned allocations take glibc's slow path, a cost
# on every CPU step, eager ones included (benchmarks/README.md, "The allocator").
# g++, for inductor: the service's compiled decode (about 3x the eager single stream) and the
# pipeline's compiled training step, as vLLM's CPU image carries gcc for torch.compile. It
# compiles at the first start, then loads from inductor's cache under /tmp. A system Python
# needs its headers too (a managed one brings them); they must match the base's python3.11.
# hadolint ignore=DL3008
RUN headers=; if [ "$PYTHON" = system ]; then headers=libpython3.11-dev; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends libtcmalloc-minimal4=2.10-1 g++=4:12.2.0-3 \
       ${headers:+"$headers"} \
    && rm -rf /var/lib/apt/lists/*
ENV LD_PRELOAD=libtcmalloc_minimal.so.4

# No C++ compiler here, so no compiled CPU decode: LMOPS_COMPILE=0 decodes eagerly from the
# start instead of failing a compile at every engine start (the GPU decodes eagerly anyway).
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LMOPS_COMPILE=0

# --- build: a virtual environment from the serving lock, then lmops itself -------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS build
ARG VARIANT
ARG PYTHON=managed
ARG UV_PYTHON_INSTALL_MIRROR
ARG TORCH_INDEX=https://download.pytorch.org/whl
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# pip comes from the interpreter's own ensurepip: no index needed for it.
RUN uv venv --python-preference "only-$PYTHON" --python 3.11 /opt/venv \
    && /opt/venv/bin/python -m ensurepip --default-pip \
    && mkdir -p /opt/python
WORKDIR /src
# torch==2.13.0 in the lock resolves to the +cpu or +cu128 build (pip prefers the
# local-version wheel that TORCH_INDEX offers); pip check: the lock is complete.
# torch's test binaries and protoc go (about 130 MB; torch_shm_manager stays, torch needs
# it); its headers stay in the CPU build, which compiles, and go from the CUDA one. lmops itself
# comes without its dependencies: those of lmops[serve] are the lock's, the
# pipeline's stay out.
COPY requirements-serve.lock ./
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca.crt \
    flavour=cpu; if [ "$VARIANT" = cuda ]; then flavour=cu128; fi \
    && /opt/venv/bin/pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX/$flavour"} \
       -r requirements-serve.lock \
    && /opt/venv/bin/pip check
RUN torch=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch \
    && rm -rf "$torch/test" \
    && if [ "$VARIANT" = cuda ]; then rm -rf "$torch/include"; fi \
    && find "$torch/bin" -type f ! -name torch_shm_manager -delete
# The runtime half of lmops only; its `lmops` command (the pipeline's) goes with the rest.
COPY pyproject.toml README.md ./
COPY src/lmops/__init__.py src/lmops/errors.py src/lmops/atomic.py src/lmops/crash_points.py src/lmops/
COPY src/lmops/runtime/ src/lmops/runtime/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca.crt \
    /opt/venv/bin/pip install --no-deps . \
    && rm /opt/venv/bin/lmops

# --- pipeline: the serving environment plus the pipeline's pins and all of lmops ---
FROM build AS pipeline-build
COPY requirements.lock ./
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca.crt \
    flavour=cpu; if [ "$VARIANT" = cuda ]; then flavour=cu128; fi \
    && /opt/venv/bin/pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX/$flavour"} \
       -r requirements.lock \
    && /opt/venv/bin/pip check
COPY src/ src/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca.crt \
    /opt/venv/bin/pip install --no-deps .

# Each Kubeflow step runs `lmops <stage>` in a fresh workspace with the image's params.yaml;
# the train step runs kubeflow/trainjob.yaml's TrainJob (`lmops trainjob`).
# hadolint ignore=DL3006
FROM base-${VARIANT} AS pipeline
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 lmops \
    && useradd --system --uid 10001 --gid lmops --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin lmops
COPY --from=pipeline-build /opt/python /opt/python
COPY --from=pipeline-build /opt/venv /opt/venv
WORKDIR /app
COPY params.yaml dvc.yaml ./
COPY kubeflow/trainjob.yaml kubeflow/
USER 10001:10001
CMD ["lmops", "--help"]
ARG REVISION=unknown
LABEL org.opencontainers.image.revision=$REVISION

# --- runtime (the default target): the environment, the service, the model; non-root --
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
# /var/cache/lmops: where a compile cache shared across containers is mounted (compose's
# named volume, which starts as a copy of this directory and so is the service user's; the
# Kubernetes overlays' claim: docs/deploy.md, "The compile cache").
RUN groupadd --system --gid 10001 lmops \
    && useradd --system --uid 10001 --gid lmops --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin lmops \
    && install --directory --owner 10001 --group 10001 --mode 700 /var/cache/lmops
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY production_service/ production_service/
USER 10001:10001
EXPOSE 5001 5002
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('LMOPS_PROBE_PORT', '5002') + '/health', timeout=4)"]
CMD ["gunicorn", "--config", "production_service/gunicorn.conf.py"]
# Last, so that a new commit rebuilds nothing else (deploy/build_image.sh sets it).
ARG REVISION=unknown
LABEL org.opencontainers.image.revision=$REVISION
