# syntax=docker/dockerfile:1
# The contest environment: EVA-02 ImageNet-1k speed contest (the CIR benchmark runs in it too).
#
#   docker buildx build --platform linux/arm64,linux/amd64 -t eva-engine:submission .
#
# The scored machine is ARM64 with one NVIDIA Hopper GPU, offline, non-root, read-only root
# filesystem: everything slow to fetch is fetched here, at image build time. build.sh (the
# untimed build step) and /submission/run (the timed run) never download anything.

# Base: a plain multi-arch Python 3.11 image (Debian bookworm; its tag is an index of
# linux/amd64 and linux/arm64 among others) with PyPI's CUDA wheels of torch, which exist
# for aarch64 as for x86_64 and carry their own CUDA 13 runtime (cuBLAS, cuDNN, NCCL, ...;
# the driver comes from the host through the NVIDIA container toolkit). Why not NGC's
# PyTorch image: it ships NVIDIA's own torch build (25.10: torch 2.9 on Python 3.12) and a
# pip constraint file pinning it, so the image would run a stack the tests never ran, and
# installing the tested one over it can fail to resolve. Here the image installs exactly
# requirements/lock.txt, the lock scripts/test.sh (CI) installs and the suite passed on.
# Pin it by digest for a reproducible build: take the *index* digest (not one platform's, or
# the other architecture no longer resolves) from
#   docker buildx imagetools inspect python:3.11-slim-bookworm      # "Digest: sha256:..."
# and write  FROM python:3.11-slim-bookworm@sha256:<that digest>
FROM python:3.11-slim-bookworm

ARG TARGETARCH

# g++: build.sh's AOTInductor build compiles the model's C++ wrapper (CPU and CUDA alike).
# Nothing else comes from Debian; versions follow the base image's bookworm release.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# The driver's compute libraries mounted by the container toolkit (NGC images set these;
# a plain base must), and Inductor's CUDA headers: those of the CUDA 13 wheels torch pulls.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_HOME=/usr/local/lib/python3.11/site-packages/nvidia/cu13

# The locked stack, nothing else: --no-deps installs exactly the pins of the locks (no
# resolver choices, so nothing can differ from what CI installed), pip check proves them
# complete. lock.txt: the contest stack (torch, torchvision, DALI, timm, open_clip, ...);
# gpu.txt: CuPy and Torch-TensorRT with its TensorRT (NVIDIA's index serves TensorRT's
# libraries). --no-cache-dir: pip's wheel cache would only bloat the layer.
COPY requirements/ /submission/requirements/
RUN python -m pip install --no-cache-dir --no-deps -r /submission/requirements/lock.txt \
    && python -m pip install --no-cache-dir --no-deps --extra-index-url https://pypi.nvidia.com \
           -r /submission/requirements/gpu.txt \
    && python -m pip check

# Fail the image build, not the scored run, when a piece is missing on this architecture:
# /bin/sh (the ABI entry point is a sh script), the C++ compiler, torch, timm, safetensors,
# DALI, open_clip (the CIR benchmark's CLIP), scikit-image (the guard's calibration photos),
# CuPy. Torch-TensorRT is reported (installed, pip check says; its import may want a GPU,
# which an image build lacks; no default backend needs it).
RUN /bin/sh -c 'true' && g++ --version >/dev/null \
    && python -c "import sys, torch, torchvision, timm, safetensors, open_clip, tqdm, skimage, cupy, \
nvidia.dali as dali; \
print('arch', '${TARGETARCH}', 'python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'torchvision', torchvision.__version__, 'timm', timm.__version__, \
'open_clip', open_clip.__version__, 'dali', dali.__version__, 'cupy', cupy.__version__)" \
    && (python -c "import torch_tensorrt; print('torch_tensorrt', torch_tensorrt.__version__)" \
        || echo "torch_tensorrt: installed, does not import at image build (no GPU here)")

# The unprivileged user of the build step and the run (numeric, so any runtime --user
# check sees a non-root UID without reading /etc/passwd). No home: nothing may write there.
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
               --shell /usr/sbin/nologin app

# Every cache in TMPDIR (the run's only writable place besides its output), and offline.
# scripts/run sets these again from the TMPDIR it is given; they are here for anything
# started another way (build.sh, a debugging shell).
ENV TMPDIR=/tmp \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    TRITON_CACHE_DIR=/tmp/triton \
    XDG_CACHE_HOME=/tmp/cache \
    HF_HOME=/tmp/hf \
    TORCH_HOME=/tmp/torch \
    CUPY_CACHE_DIR=/tmp/cupy \
    MPLCONFIGDIR=/tmp/mpl \
    CUDA_CACHE_PATH=/tmp/nv \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ENGINE_CHECKPOINT=/checkpoint/model.safetensors \
    ENGINE_ARTIFACT=/submission/artifacts/default

# The source (what .dockerignore lets through: no .git, no artifacts, no weights, no data).
COPY --chown=0:0 . /submission

# Root-owned and world-readable, writable by nobody but the build step's artifact folder.
# /submission/run is a two-line sh wrapper, not a symlink: scripts/run finds the repo root
# from its own path, which a symlink would change to /. Bytecode is compiled now because
# the read-only root keeps Python from caching it at run time.
RUN chmod -R u=rwX,go=rX /submission \
    && chmod 0755 /submission/scripts/run /submission/build.sh \
    && printf '#!/bin/sh\nexec /submission/scripts/run "$@"\n' > /submission/run \
    && chmod 0755 /submission/run \
    && mkdir -p /submission/artifacts \
    && chown 10001:10001 /submission/artifacts \
    && python -m compileall -q /submission/engine /submission/evaluator /submission/kernels

WORKDIR /submission

# No entrypoint of the base's: the ABI calls /submission/run directly.
ENTRYPOINT []
CMD ["/submission/run"]

# Last: everything after this line, and every container, runs without root.
USER 10001:10001
