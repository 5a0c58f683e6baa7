#!/bin/sh
# One GPU check, <= 8 minutes on one H200, with only a bare CUDA + PyTorch image
# (torch, torchvision, timm, cupy; no DALI, no TensorRT: those paths skip and say so).
#   scripts/device_check.sh [OUTDIR]      (default: $OUT, else ./device_check_out)
# Writes OUTDIR/device_check.json (EVA-02-L/448 per backend and precision, agreement with
# the FP32 reference path, stage breakdown, fixed costs, GPU and versions) and
# OUTDIR/gpu_tests.txt (pytest -m gpu).
set -u
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
out=${1:-${OUT:-$here/device_check_out}}
mkdir -p "$out"
work=${TMPDIR:-/tmp}/device_check.$$
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$here" || exit 2
python3 -c "import nvidia.dali" 2>/dev/null || echo "DALI not installed: dali-gpu falls back to nvjpeg (torchvision)" | tee "$out/notes.txt"
python3 -c "import tensorrt" 2>/dev/null || echo "TensorRT not installed: no tensorrt backend measured" | tee -a "$out/notes.txt"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -40 > "$out/gpu_tests.txt"
echo "gpu tests: $(tail -1 "$out/gpu_tests.txt")"
timeout 330 python3 scripts/device_bench.py --out "$work" --json "$out/device_check.json" --budget-s 240 \
    --count "${DEVICE_COUNT:-2000}" --ref-count "${DEVICE_REF_COUNT:-1000}" ${DEVICE_CONFIGS:+--configs "$DEVICE_CONFIGS"}
rc=$?
cp "$work"/*.log "$out"/ 2>/dev/null
rm -rf "$work"
exit $rc
