#!/bin/sh
# One-shot GPU check, within one ~10 minute window on one H200 with only torch, torchvision,
# timm, cupy, numpy and pytest (DALI, TensorRT, open_clip, scikit-image are probed: the steps
# that need them say what they did without them). The most valuable facts come first: the
# driver and compute mode, an ABI figure (eager bf16) while AOTInductor compiles in the
# background with the image's CUDA_HOME layout, the measured search, then the rest.
#
#   scripts/device_check.sh [OUTDIR] [OPTIONS]    (OUTDIR default: $OUT, else ./device_check_out)
#   scripts/device_check.sh --help                this text and the options with their defaults
#
# Writes only small plain files: OUTDIR/device_check.json after every step (a stopped run
# still says what finished, and `not_run` names the steps that never started),
# OUTDIR/device_check.log (each child's output, tail-kept) and OUTDIR/gpu_tests.txt; work
# files go to a private folder under $TMPDIR, removed at the end and on SIGTERM/SIGINT.
# Without a GPU it writes a JSON saying so and exits 0 in seconds. Steps, their order and
# timeouts: scripts/device_check.py (docs/gpu-check.md). OPTIONS go to it.
set -u
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
case "${1:-}" in
  -h|--help)
    sed -n '2,/^set -u$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo
    exec "${PYTHON:-python3}" "$here/scripts/device_check.py" --help ;;
  ""|-*) out=${OUT:-$here/device_check_out} ;;      # no OUTDIR: options only
  *) out=$1; shift ;;
esac
. "$here/scripts/runtime_env.sh"
export PYTHONUNBUFFERED=1
cd "$here" || exit 2
exec "${PYTHON:-python3}" scripts/device_check.py --out "$out" "$@"
