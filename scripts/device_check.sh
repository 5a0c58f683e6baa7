#!/bin/sh
# One-shot GPU check, <= 6 minutes on one H200 with only torch, torchvision, timm, cupy,
# numpy and pytest (no DALI, TensorRT or open_clip: those steps say so and are skipped).
#   scripts/device_check.sh [OUTDIR]      (default: $OUT, else ./device_check_out)
# Writes OUTDIR/device_check.json after every step, OUTDIR/gpu_tests.txt and
# OUTDIR/logs.tar.gz; without a GPU it writes a JSON saying so and exits 0 in seconds.
# Steps and their order: scripts/device_check.py. Extra arguments go to it.
set -u
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
out=${1:-${OUT:-$here/device_check_out}}
[ $# -gt 0 ] && shift
. "$here/scripts/runtime_env.sh"
export PYTHONUNBUFFERED=1
cd "$here" || exit 2
exec "${PYTHON:-python3}" scripts/device_check.py --out "$out" "$@"
