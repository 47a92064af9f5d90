# syntax=docker/dockerfile:1
# The image the Helm chart (helm/splitserve) runs: `splitserve` on PATH, non-root user 10001.
#
#   CPU (control plane, sim and CPU workers):  docker build -t splitserve:0.1.0 .
#   GPU workers (CUDA torch + NIXL):           docker build --build-arg VARIANT=cuda -t splitserve:0.1.0-cuda .
#
# torch is installed first, pinned, from the PyTorch index of the variant: the default PyPI torch
# wheel is a multi-GB CUDA build that a CPU image must not carry (and must not be swapped later).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_CUDA=https://download.pytorch.org/whl/cu130
ARG NIXL_VERSION=1.5.1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/splitserve/bin:$PATH
RUN python -m venv /opt/splitserve
# A C compiler for the native modules (router/_chain.c, the block-key recipe; router/_kv_cost.c, the
# kv_cache_aware placement core; router/_owner_map.c, the KV index's owner masks with its prefix
# walk and speculative entries; router/_prefix_pins.c, kv_cache_aware's implicit sessions;
# transfer/_spin.c, the KV-transfer listeners' bounded busy-poll); build stage only.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# nixl's meta package would resolve its own torch; the plain wheels work with the pinned one.
RUN set -eu; \
    case "$VARIANT" in \
      cpu)  pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_CPU" ;; \
      cuda) pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_CUDA"; \
            pip install --no-deps "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}" ;; \
      *)    echo "VARIANT must be cpu or cuda, found '$VARIANT'" >&2; exit 1 ;; \
    esac
WORKDIR /src
COPY pyproject.toml README.md splitserve_cli.py ./
COPY protocol/ protocol/
COPY router/ router/
COPY coordinator/ coordinator/
COPY fleet/ fleet/
COPY http1/ http1/
COPY worker/ worker/
COPY transfer/ transfer/
# The pinned torch already satisfies the project's torch range, so pip keeps it.
COPY setup.py ./
RUN pip install . && python -c "import torch, splitserve_cli, router.block_keys as bk, \
    router.policy_kv as pk, router.kv_owners as kq, router.prefix_pins as pp, transfer.zmq_io as tz; \
    assert bk.NATIVE, 'router/_chain.c did not build'; assert pk.NATIVE, 'router/_kv_cost.c did not build'; \
    assert kq.NATIVE, 'router/_owner_map.c did not build'; assert pp.NATIVE, 'router/_prefix_pins.c did not build'; \
    assert tz.SPIN_NATIVE, 'transfer/_spin.c did not build'; \
    print('torch', torch.__version__)"

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG VARIANT=cpu
# RDMA user-space libraries for NIXL/UCX on InfiniBand or RoCE (GPU image only). Unpinned on
# purpose: they track the base image's Debian release, which the base tag pins.
# hadolint ignore=DL3008
RUN set -eu; \
    if [ "$VARIANT" = "cuda" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends libibverbs1 librdmacm1 ibverbs-providers; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 splitserve; \
    useradd --system --uid 10001 --gid 10001 --home-dir /home/splitserve --create-home \
      --shell /usr/sbin/nologin splitserve
COPY --from=build /opt/splitserve /opt/splitserve
ENV PATH=/opt/splitserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/splitserve
WORKDIR /home/splitserve
USER 10001:10001
# fleet, coordinator, worker HTTP, KV events, KV replay, KV transfer (the chart's defaults).
EXPOSE 8000 8001 8100 5557 5558 5600
ENTRYPOINT ["splitserve"]
CMD ["--help"]
