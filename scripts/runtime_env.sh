# Sourced by scripts/run, scripts/build.sh and scripts/run.sh (needs $here, the repo root).
# Every cache goes to TMPDIR (or nowhere): scored runs have a read-only root, an unwritable
# HOME and empty writable caches, and must never reach the network.
: "${TMPDIR:=/tmp}" ; export TMPDIR
export TORCHINDUCTOR_CACHE_DIR="$TMPDIR/inductor" TRITON_CACHE_DIR="$TMPDIR/triton" \
       XDG_CACHE_HOME="$TMPDIR/cache" HF_HOME="$TMPDIR/hf" TORCH_HOME="$TMPDIR/torch" \
       CUPY_CACHE_DIR="$TMPDIR/cupy" MPLCONFIGDIR="$TMPDIR/mpl" CUDA_CACHE_PATH="$TMPDIR/nv" \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
# Torch's OpenMP threads busy-wait between batches and starve the decoder threads
# sharing the cores: make them sleep instead.
: "${OMP_WAIT_POLICY:=PASSIVE}" ; export OMP_WAIT_POLICY
# numpy's OpenBLAS starts its threads as numpy loads, before any Python line can size them, and
# one it cannot start (an address-space or process limit) makes it raise SIGINT at itself: one
# thread, as engine.threads.library_env sets (OpenBLAS only serves numpy here). Set, it is kept.
: "${OPENBLAS_NUM_THREADS:=1}" ; export OPENBLAS_NUM_THREADS
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
