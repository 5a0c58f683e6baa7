#!/bin/sh
# CIR queries: scripts/run.sh --index-dir DIR --queries FILE.jsonl --output FILE.jsonl [options]
# (python -m evaluator.cir.run --help lists the options). Code and inputs are read-only.
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
. "$here/scripts/runtime_env.sh"
exec "${PYTHON:-python3}" -m evaluator.cir.run "$@"
