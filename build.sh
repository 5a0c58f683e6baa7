#!/bin/sh
# The submission's build step (untimed, but charged if it fails): the read-only checkpoint
# -> an artifact for the machine this runs on -> a one-image check through scripts/run.
# Its knobs are environment variables: ./build.sh --help lists them with their defaults.
#
# Idempotent: an artifact whose files are intact and whose manifest records the same
# checkpoint sha256, spec, backend and device is reused. Everything it needs is already in
# the image: this script never fetches anything.
# Exit status: 0 ready, 1 the build or the check failed, 2 a bad knob or a missing input.
set -eu

usage() {
    cat <<'EOF'
usage: ./build.sh            (no arguments: every knob is an environment variable)

The submission's build step: builds the artifact from the read-only checkpoint with
python -m engine.build for the machine it runs on, then runs one generated image through
scripts/run and checks the output. An intact, current artifact is reused.

environment (default):
  ENGINE_CHECKPOINT   the checkpoint file                  (/checkpoint/model.safetensors)
  ENGINE_MODEL        timm name, decides the spec          (what the checkpoint's safetensors metadata
                                                           records, as the kit's tiny checkpoints do;
                                                           else eva02_large_patch14_448.mim_m38m_ft_in22k_in1k)
  ENGINE_PRECISION    auto | fp32 | bf16 | fp16 | fp8      (auto: measured here, the fastest of the device's
                                                           native precisions that holds the guard's budget;
                                                           below fp32 guarded by an FP32 re-check of near-ties)
  ENGINE_BATCH_SIZE   auto or a static batch               (auto: the fastest of engine/presets.py's candidates)
  ENGINE_BACKEND      auto or a backend of engine/backends (auto: the fastest that builds here)
  ENGINE_DEVICE       auto | cuda | cpu                    (auto: cuda when torch sees a GPU)
  ENGINE_ARTIFACT     artifact dir, relative to this folder or absolute (artifacts/default; scripts/run reads it too)
  ENGINE_INPUT_SIZE   spec override: input size in px      (recorded by the checkpoint, else the model's)
  ENGINE_CROP_MODE    spec override: center | squash       (recorded by the checkpoint, else the model's)
  ENGINE_CROP_PCT     spec override: crop fraction         (recorded by the checkpoint, else the model's)
  ENGINE_MODEL_KWARGS spec override: timm kwargs as JSON   (recorded by the checkpoint, else none)
  FORCE=1             rebuild even when the artifact is current
  PYTHON              interpreter                          (python3)

exit status: 0 ready, 1 the build or the check failed, 2 a bad knob or a missing input
EOF
}

case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    "") ;;
    *) echo "build.sh: error: unknown argument '$1' (build.sh takes none: its knobs are environment variables; see ./build.sh --help)" >&2
       exit 2 ;;
esac

here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
cd "$here"
PY=${PYTHON:-python3}

log() { echo "build.sh: $*" >&2; }
usage_error() { echo "build.sh: error: $*" >&2; exit 2; }   # a knob or an input is wrong
failed() { echo "build.sh: error: $*" >&2; exit 1; }        # the build or the check failed

CHECKPOINT=${ENGINE_CHECKPOINT:-/checkpoint/model.safetensors}
PRECISION=${ENGINE_PRECISION:-auto}
BACKEND=${ENGINE_BACKEND:-auto}
ENGINE_BATCH_SIZE=${ENGINE_BATCH_SIZE:-auto}
DEVICE=${ENGINE_DEVICE:-auto}
ARTIFACT=${ENGINE_ARTIFACT:-artifacts/default}

# Offline, and every cache in a scratch folder: HOME may be unwritable here too.
: "${TMPDIR:=/tmp}"
export TMPDIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$TMPDIR/build-inductor}" \
       TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$TMPDIR/build-triton}" \
       XDG_CACHE_HOME="${XDG_CACHE_HOME:-$TMPDIR/build-cache}" \
       HF_HOME="${HF_HOME:-$TMPDIR/build-hf}" TORCH_HOME="${TORCH_HOME:-$TMPDIR/build-torch}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

command -v "$PY" >/dev/null 2>&1 || usage_error "no Python interpreter '$PY' (set PYTHON)"
[ -e "$CHECKPOINT" ] || usage_error "checkpoint not found: $CHECKPOINT (mount it there or set ENGINE_CHECKPOINT)"
[ -f "$CHECKPOINT" ] && [ -r "$CHECKPOINT" ] || usage_error "checkpoint is not a readable file: $CHECKPOINT"

# Every knob checked before anything runs: one line naming the variable.
case "$PRECISION" in auto|fp32|bf16|fp16|fp8) ;; *) usage_error "ENGINE_PRECISION must be auto, fp32, bf16, fp16 or fp8, got '$PRECISION'" ;; esac
case "$DEVICE" in auto|cuda|cpu) ;; *) usage_error "ENGINE_DEVICE must be auto, cuda or cpu, got '$DEVICE'" ;; esac
case "${ENGINE_BATCH_SIZE:-1}" in auto|*[!0-9]*|0*) [ "${ENGINE_BATCH_SIZE:-}" = auto ] \
    || usage_error "ENGINE_BATCH_SIZE must be a whole number >= 1 or auto, got '${ENGINE_BATCH_SIZE:-}'" ;; esac
case "${ENGINE_INPUT_SIZE:-1}" in *[!0-9]*|0*) usage_error "ENGINE_INPUT_SIZE must be a whole number >= 1, got '${ENGINE_INPUT_SIZE:-}'" ;; esac
case "${ENGINE_CROP_MODE:-center}" in center|squash) ;; *) usage_error "ENGINE_CROP_MODE must be center or squash, got '${ENGINE_CROP_MODE:-}'" ;; esac
case "${FORCE:-0}" in 0|1) ;; *) usage_error "FORCE must be 0 or 1, got '${FORCE:-}'" ;; esac

# A checkpoint that records its spec (the kit's tiny ones do, in their safetensors metadata)
# gives every spec knob the user left unset; otherwise the contest's model is the default.
if [ -z "${ENGINE_MODEL:-}" ]; then
    recorded=$("$PY" -m evaluator.contest.selfcheck recorded "$CHECKPOINT") \
        || usage_error "cannot read the checkpoint's metadata: $CHECKPOINT (see above)"
    if [ -n "$recorded" ]; then
        for knob in ENGINE_MODEL ENGINE_INPUT_SIZE ENGINE_CROP_MODE ENGINE_CROP_PCT ENGINE_MODEL_KWARGS; do
            if eval "[ -z \"\${$knob:-}\" ]"; then   # not set by the user: take the recorded value
                line=$(printf '%s\n' "$recorded" | grep "^$knob=" || true)
                [ -n "$line" ] && eval "$line"
            fi
        done
        log "the checkpoint records its spec: $(printf '%s' "$recorded" | tr '\n' ' ') (set ENGINE_MODEL to override)"
    fi
fi
MODEL=${ENGINE_MODEL:-eva02_large_patch14_448.mim_m38m_ft_in22k_in1k}

# The artifact must be built for the device the run uses: a CPU artifact on the GPU
# machine would pass every check and then be scored at CPU speed.
if [ "$DEVICE" = auto ]; then
    if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        DEVICE=cuda
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        usage_error "nvidia-smi lists a GPU but torch.cuda cannot use it (driver/container mismatch?); set ENGINE_DEVICE=cpu to build for the CPU anyway"
    else
        DEVICE=cpu
    fi
fi

# The engine.build flags, one per knob (positional parameters: safe for JSON with spaces).
set -- --model "$MODEL" --checkpoint "$CHECKPOINT" --out "$ARTIFACT" --device "$DEVICE" \
       --precision "$PRECISION" --backend "$BACKEND" --batch-size "$ENGINE_BATCH_SIZE"
[ -n "${ENGINE_INPUT_SIZE:-}" ] && set -- "$@" --input-size "$ENGINE_INPUT_SIZE"
[ -n "${ENGINE_CROP_MODE:-}" ] && set -- "$@" --crop-mode "$ENGINE_CROP_MODE"
[ -n "${ENGINE_CROP_PCT:-}" ] && set -- "$@" --crop-pct "$ENGINE_CROP_PCT"
[ -n "${ENGINE_MODEL_KWARGS:-}" ] && set -- "$@" --model-kwargs "$ENGINE_MODEL_KWARGS"

log "model $MODEL, checkpoint $CHECKPOINT, backend $BACKEND on $DEVICE, precision $PRECISION, batch $ENGINE_BATCH_SIZE -> $ARTIFACT"
# the stack the artifact is built with (its manifest records it; a run on another torch refuses it)
stack=$("$PY" -c 'import importlib.metadata as md, torch
def v(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return "absent"
print("torch", v("torch"), "(CUDA %s)" % torch.version.cuda, "torchvision", v("torchvision"), "timm", v("timm"),
      "DALI", v("nvidia-dali-cuda130"))' 2>/dev/null) || stack="unknown (torch does not import)"
log "stack: $stack"
reuse=no
if [ "${FORCE:-0}" != 1 ]; then
    # exit 0 = intact and current, 1 = stale (reasons on stderr), 2 = bad flags or unreadable input
    rc=0
    why=$("$PY" -m evaluator.contest.selfcheck current -- "$@" 2>&1 >/dev/null) || rc=$?
    case $rc in
        0) reuse=yes ;;
        1) printf '%s\n' "$why" | sed 's/^python -m evaluator.contest.selfcheck: /build.sh: /' >&2 ;;
        *) # a knob the build refuses: its one line, with the flag named as the knob
           usage_error "$(printf '%s\n' "$why" | tail -n 1 | sed -e 's/^.*error: //' -e 's/ (see python -m engine.build --help)//' \
               -e 's/argument --backend/ENGINE_BACKEND/' -e 's/argument --model-kwargs/ENGINE_MODEL_KWARGS/' \
               -e 's/argument --crop-pct/ENGINE_CROP_PCT/' -e 's/argument --batch-size/ENGINE_BATCH_SIZE/' \
               -e 's/argument --input-size/ENGINE_INPUT_SIZE/' -e 's/argument --model/ENGINE_MODEL/')" ;;
    esac
fi
if [ "$reuse" = yes ]; then
    log "reusing artifact $ARTIFACT (files intact; checkpoint sha256, spec, backend and device match; FORCE=1 rebuilds)"
else
    log "building $ARTIFACT (untimed preparation)"
    t0=$(date +%s)
    rc=0
    "$PY" -m engine.build "$@" >&2 || rc=$?
    case $rc in
        0) ;;
        2) usage_error "python -m engine.build refused the knobs (see above; a checkpoint of another model needs ENGINE_MODEL, ENGINE_INPUT_SIZE and ENGINE_MODEL_KWARGS: ./build.sh --help)" ;;
        *) failed "python -m engine.build failed with exit $rc (see above)" ;;
    esac
    log "built in $(( $(date +%s) - t0 )) s"
fi

# Load the artifact and run one generated image through the contest entry point.
"$PY" -m evaluator.contest.selfcheck run --artifact "$ARTIFACT" >&2 \
    || failed "the artifact at $ARTIFACT does not run through scripts/run (see above)"
log "OK: $ARTIFACT is ready for scripts/run (ENGINE_ARTIFACT=$ARTIFACT)"
