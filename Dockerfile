# Raven (raven-tunnel): one image for both services. docs/image.md says how it is built and checked.
#
# Built by scripts/image.sh (podman, as root): it makes both bases from Debian packages (debootstrap
# bookworm: BUILD_IMAGE has python3-venv and binutils, BASE_IMAGE only what python3 needs at run time, no
# shell) and downloads the dependencies' wheels into build/image-wheels/, so this build needs neither a
# registry nor the network:
#   bash scripts/image.sh
# With bases of your own: any Debian-like image with python3 3.11 at /usr/bin/python3 (the build base also
# with the venv module and strip), and build/image-wheels/ filled as scripts/image.sh does:
#   podman build --network none --build-arg BASE_IMAGE=... --build-arg BUILD_IMAGE=... -t raven-tunnel:0.2.0 .
# Run: args ["gateway", "--config", "/etc/raven/gateway.yaml"] or ["agent", "--config", "/etc/raven/agent.yaml"].

ARG BASE_IMAGE=localhost/raven-base:bookworm
ARG BUILD_IMAGE=${BASE_IMAGE}

# ---------------------------------------------------------------- builder: a venv in /opt/raven
FROM ${BUILD_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

# The wheels of every dependency, and of pip, setuptools and wheel: scripts/image.sh downloads them with
# the host's pip (for CPython 3.11 on x86_64), so this build needs no network.
COPY build/image-wheels /wheels

# pip lives in a venv of its own (/opt/pip), Raven in one without pip (/opt/raven): only the latter
# reaches the runtime stage. setuptools and wheel build Raven's own wheel (no build isolation, no download).
RUN python3 -m venv /opt/pip \
    && /opt/pip/bin/pip install --no-index --find-links=/wheels --upgrade "pip>=23.1" "setuptools>=68" wheel \
    && python3 -m venv --without-pip /opt/raven

# The dependencies first (the list is pyproject.toml's, in the wheels folder): a change to Raven's code keeps
# this layer. Wheels only (no compiler here or anywhere); their shared objects lose their debug symbols
# (uvloop's alone carries 11 MB of them) and their Cython sources and C headers go: nothing at run time
# reads them.
RUN /opt/pip/bin/pip --python /opt/raven/bin/python install --no-index --find-links=/wheels \
        -r /wheels/requirements.txt \
    && find /opt/raven -name '*.so' -exec strip --strip-unneeded {} + \
    && find /opt/raven/lib \( -name '*.pyx' -o -name '*.pxd' -o -name '*.c' -o -name '*.h' \) -delete

# mypyc (mypy) compiles Raven's per-scrape modules (raven/build.py lists them). It type-checks them against
# the dependencies, so the build venv gets those too; only /opt/raven reaches the runtime stage.
RUN /opt/pip/bin/pip install --no-index --find-links=/wheels -r /wheels/requirements.txt "mypy>=1.10" \
        "types-PyYAML>=6.0"

# Then Raven itself (pyproject.toml names README.md as the long description), its compiled wheel built here
# with gcc and the Python headers of the build base; the runtime stage has no compiler.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY raven ./raven
COPY gateway ./gateway
COPY agent ./agent
# .pyc files are compiled here, so the read-only root file system never needs to hold new ones; not for the
# sources of compiled modules (only RAVEN_BUILD=pure reads those), nor is kubernetes_asyncio's changelog kept
# (its wheel puts it at the top of site-packages): together 0.9 MB. kubernetes_asyncio (thousands of generated
# API models, 22 MB of sources) is kept as its compiled files only, beside where its sources were (Python
# imports them without the sources; its tracebacks show no source lines): that room holds the backfill's
# zstandard and cramjam (docs/backfill.md) within 150 MB.
ARG DROP_COMPILED_PYC="import pathlib, raven.build as b; root = pathlib.Path(b.__file__).parents[1]; \
[p.unlink() for src in b.COMPILED for p in (root / src).parent.glob('__pycache__/' + pathlib.Path(src).stem + '.*.pyc')]"
RUN /opt/pip/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /tmp/dist . \
    && /opt/pip/bin/pip --python /opt/raven/bin/python install --no-deps --no-index /tmp/dist/*.whl \
    && find /opt/raven/lib -name '*__mypyc*.so' -o -path '*/raven/*.so' -o -path '*/gateway/*.so' \
        -o -path '*/agent/*.so' | xargs -r strip --strip-unneeded \
    && /opt/raven/bin/python -m compileall -q /opt/raven/lib \
    && /opt/raven/bin/python -I -c "$DROP_COMPILED_PYC" \
    && k8s=$(echo /opt/raven/lib/python3.*/site-packages/kubernetes_asyncio) \
    && /opt/raven/bin/python -m compileall -q -b "$k8s" \
    && find "$k8s" -name '*.py' -delete && find "$k8s" -name __pycache__ -prune -exec rm -rf {} + \
    && rm -f /opt/raven/lib/python3.*/site-packages/CHANGELOG.md \
    && /opt/raven/bin/raven --version | tee /dev/stderr | grep -q "compiled build"

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime

COPY --from=builder /opt/raven /opt/raven

ENV PATH=/opt/raven/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

LABEL org.opencontainers.image.title="raven-tunnel" \
      org.opencontainers.image.description="Cloud Prometheus scrapes edge Kubernetes nodes behind NAT by node name through tunnels" \
      org.opencontainers.image.licenses="Apache-2.0"

# 10262 tunnel (wss), 10263 front end (HTTP), 10265 gateway ops, 10266 agent ops.
EXPOSE 10262 10263 10265 10266

# A numeric non-root user (no passwd entry needed; Kubernetes runAsNonRoot can verify it).
USER 65532:65532
WORKDIR /tmp

# SIGTERM (the default stop signal) makes either service drain and exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["raven"]
CMD ["--help"]
