#!/bin/sh
# One-shot GPU check, within one ~10 minute window on one H200 with only torch, torchvision,
# timm, cupy, numpy and pytest (DALI, TensorRT, open_clip, scikit-image are probed first:
# the steps that need them say what they did without them).
#   scripts/device_check.sh [OUTDIR]      (default: $OUT, else ./device_check_out)
# Writes only small plain files: OUTDIR/device_check.json after every step (a stopped run
# still says what finished), OUTDIR/device_check.log (each step's output, tail-kept) and
# OUTDIR/gpu_tests.txt; work files go to a private folder under $TMPDIR, removed at the end
# and on SIGTERM/SIGINT. Without a GPU it writes a JSON saying so and exits 0 in seconds.
# Steps and their order: scripts/device_check.py. Extra arguments go to it.
set -u
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
out=${1:-${OUT:-$here/device_check_out}}
[ $# -gt 0 ] && shift
. "$here/scripts/runtime_env.sh"
export PYTHONUNBUFFERED=1
cd "$here" || exit 2
exec "${PYTHON:-python3}" scripts/device_check.py --out "$out" "$@"
