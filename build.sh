#!/bin/sh
# The submission's build step (untimed, but charged if it fails): the read-only checkpoint
# -> an artifact for the machine this runs on -> a one-image check through scripts/run.
# Its knobs are environment variables: ./build.sh --help lists them with their defaults.
# The work is python -m evaluator.contest.build_step's; this script takes no arguments, keeps
# the build offline with every cache in a scratch folder, and never fetches anything.
# Exit status: 0 ready, 1 the build or the check failed, 2 a bad knob or a missing input.
set -eu

case "${1:-}" in
    ""|-h|--help) ;;
    *) echo "build.sh: error: unknown argument '$1' (build.sh takes none: its knobs are environment variables; see ./build.sh --help)" >&2
       exit 2 ;;
esac

# relative knobs resolve beside build.sh; its Python is the repository's it links to (if a link)
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
repo=$(CDPATH= cd -- "$(dirname -- "$(readlink -f -- "$0" 2>/dev/null || echo "$0")")" && pwd)
cd "$here"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "build.sh: error: no Python interpreter '$PY' (set PYTHON)" >&2; exit 2; }

# Offline, and every cache in a scratch folder: HOME may be unwritable here too.
: "${TMPDIR:=/tmp}"
export TMPDIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$TMPDIR/build-inductor}" \
       TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$TMPDIR/build-triton}" \
       XDG_CACHE_HOME="${XDG_CACHE_HOME:-$TMPDIR/build-cache}" \
       HF_HOME="${HF_HOME:-$TMPDIR/build-hf}" TORCH_HOME="${TORCH_HOME:-$TMPDIR/build-torch}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

exec "$PY" -m evaluator.contest.build_step "$@"
