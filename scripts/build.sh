#!/bin/sh
# CIR index build: scripts/build.sh --corpus DIR --index-dir DIR [options]
# (python -m evaluator.cir_build --help lists the options). Every cache goes to TMPDIR:
# code and inputs are read-only, and nothing may reach the network.
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
: "${TMPDIR:=/tmp}" ; export TMPDIR
export TORCHINDUCTOR_CACHE_DIR="$TMPDIR/inductor" TRITON_CACHE_DIR="$TMPDIR/triton" \
       XDG_CACHE_HOME="$TMPDIR/cache" HF_HOME="$TMPDIR/hf" TORCH_HOME="$TMPDIR/torch" \
       CUPY_CACHE_DIR="$TMPDIR/cupy" MPLCONFIGDIR="$TMPDIR/mpl" \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
# Torch's OpenMP threads busy-wait between batches and starve the decoder threads
# sharing the cores: make them sleep instead (as scripts/run does).
: "${OMP_WAIT_POLICY:=PASSIVE}" ; export OMP_WAIT_POLICY
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m evaluator.cir_build "$@"
