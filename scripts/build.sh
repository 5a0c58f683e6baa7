#!/bin/sh
# CIR index build: scripts/build.sh --corpus DIR --index-dir DIR [options]
# (python -m evaluator.cir.build --help lists the options). Code and inputs are read-only.
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
. "$here/scripts/runtime_env.sh"
exec "${PYTHON:-python3}" -m evaluator.cir.build "$@"
