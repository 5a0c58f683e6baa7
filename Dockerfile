# syntax=docker/dockerfile:1
# The contest environment: EVA-02 ImageNet-1k speed contest (the CIR benchmark runs in it too).
#
#   docker buildx build --platform linux/arm64,linux/amd64 -t eva-engine:submission .
#
# The scored machine is ARM64 with one NVIDIA Hopper GPU, offline, non-root, read-only root
# filesystem: everything slow to fetch is fetched here, at image build time. build.sh (the
# untimed build step) and /submission/run (the timed run) never download anything.

# Base: NGC's PyTorch image. Its tag is a multi-arch index (linux/arm64 sbsa + linux/amd64)
# that ships CUDA, cuDNN, NCCL, PyTorch, TensorRT + Torch-TensorRT and DALI built for both.
# 25.10 is the first NGC release on CUDA 13 (the project's DALI wheel is the cuda130 one).
# Pin it by digest for a reproducible build: take the *index* digest (not one platform's, or
# the other architecture no longer resolves) from
#   docker buildx imagetools inspect nvcr.io/nvidia/pytorch:25.10-py3      # "Digest: sha256:..."
# and write  FROM nvcr.io/nvidia/pytorch:25.10-py3@sha256:<that digest>
# When moving to a newer torch, move to the NGC release that ships it (release notes list it).
FROM nvcr.io/nvidia/pytorch:25.10-py3

ARG TARGETARCH

# The Python packages the base lacks, pinned to the versions the project tests with: the
# classification stack (timm, safetensors) and the retrieval stack (open_clip and what it
# pulls: ftfy, regex; tqdm for progress bars). --no-cache-dir: pip's wheel cache would only
# bloat the layer. pip leaves the base's torch, torchvision, numpy and pillow alone (none of
# these asks for a particular version of them; NGC also pins them through its pip
# constraint file).
RUN python -m pip install --no-cache-dir \
        timm==1.0.31 \
        safetensors==0.8.0 \
        huggingface_hub==2.4.0 \
        open_clip_torch==3.3.0 \
        ftfy==6.3.1 \
        regex==2026.5.9 \
        tqdm==4.70.1

# DALI is part of the NGC image; should a release lack it on one architecture, install the
# CUDA 13 wheel (pinned) here rather than ever at run time.
RUN python -c "import nvidia.dali" 2>/dev/null \
    || python -m pip install --no-cache-dir nvidia-dali-cuda130==2.4.0

# Fail the image build, not the scored run, when a piece is missing on this architecture:
# /bin/sh (the ABI entry point is a sh script), torch, timm, safetensors, DALI, open_clip
# (the CIR benchmark's CLIP). TensorRT is reported (the current backends do not need it).
RUN /bin/sh -c 'true' \
    && python -c "import sys, torch, timm, safetensors, open_clip, tqdm, nvidia.dali as dali; \
print('arch', '${TARGETARCH}', 'python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'timm', timm.__version__, 'open_clip', open_clip.__version__, \
'dali', dali.__version__)" \
    && (python -c "import tensorrt; print('tensorrt', tensorrt.__version__)" || echo "tensorrt: not in this image")

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

# NGC's entrypoint prints a banner and runs checks on every start: on the clock, and on stdout.
ENTRYPOINT []
CMD ["/submission/run"]

# Last: everything after this line, and every container, runs without root.
USER 10001:10001
