#!/bin/sh
# One-shot GPU check, within one 600 s command on one H200 with only torch, torchvision,
# timm, cupy, numpy and pytest (DALI, TensorRT, open_clip, scikit-image are probed: the steps
# that need them say what they did without them). The most valuable facts come first: the
# driver and compute mode, the CUDA headers of the image's CUDA_HOME layout, an ABI figure
# (eager bf16) and its agreement while AOTInductor compiles in the background, the AOT build
# (phases timed) and its CUDA-graph ABI figure, then the measured search, the probes, the rest.
#
#   scripts/device_check.sh [OUTDIR] [OPTIONS]    (OUTDIR default: $OUT, else ./device_check_out)
#   scripts/device_check.sh --help                this text and the options with their defaults
#
# Writes only small plain files, each result as it lands (whole and fsynced: a kill, even
# SIGKILL, keeps every figure reached): OUTDIR/device_check.json after every step (`not_run`
# names the steps that never started), OUTDIR/results.jsonl (a line per result),
# OUTDIR/aot_phases.json (the AOT build's phases), OUTDIR/device_check.log (each child's
# output, tail-kept) and OUTDIR/gpu_tests.txt; work files go to a private folder under
# $TMPDIR, removed at the end and on SIGTERM/SIGINT. Without a GPU it writes a JSON saying so
# and exits 0 in seconds. Steps, their order and timeouts: scripts/device_check.py
# (docs/gpu-check.md). OPTIONS go to it.
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
