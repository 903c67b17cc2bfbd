# syntax=docker/dockerfile:1
#
# Raven (raven-tunnel): one image for both services.
#   docker build -t raven-tunnel:0.1.0 .
#   docker run --rm raven-tunnel:0.1.0 --help
#   gateway: args ["gateway", "--config", "/etc/raven/gateway.yaml"]   agent: ["agent", "--config", "/etc/raven/agent.yaml"]
# Needs BuildKit (the default builder since Docker 23) for the bind mount in the runtime stage.

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- builder: wheels only
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# Only what the package build needs (pyproject.toml names README.md as the long description).
COPY pyproject.toml README.md ./
COPY raven ./raven
COPY gateway ./gateway
COPY agent ./agent

# The project's wheel plus a wheel of every runtime dependency (not the [dev] extra). All of them
# ship manylinux wheels for CPython 3.11, so no compiler is needed.
RUN pip wheel --wheel-dir /wheels .

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

# Install from the builder's wheels only (no index: exactly what was built), without copying the wheels
# into a layer. pip compiles the .pyc files at install time, so a read-only root file system is fine.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels raven-tunnel \
    && raven --help >/dev/null

LABEL org.opencontainers.image.title="raven-tunnel" \
      org.opencontainers.image.description="Cloud Prometheus scrapes edge Kubernetes nodes behind NAT by node name through tunnels" \
      org.opencontainers.image.licenses="Apache-2.0"

# 10262 tunnel (wss), 10263 front end (HTTP), 10265 gateway ops, 10266 agent ops.
EXPOSE 10262 10263 10265 10266

# A numeric non-root user (no passwd entry needed; Kubernetes runAsNonRoot can verify it).
USER 65532:65532
WORKDIR /tmp

# SIGTERM (the default stop signal) makes either service drain and exit 0.
ENTRYPOINT ["raven"]
CMD ["--help"]
