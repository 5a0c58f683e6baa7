#!/bin/sh
# Install the test dependencies and run the whole suite (lint + tests), CPU only.
# CI runs exactly this (.ci/run). GPU tests skip cleanly without CUDA.
set -eu
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[dev]'
# headless Chromium renders the campaign report in a test (Debian package; root only)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: its test will skip" >&2
fi
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # busy-waiting OpenMP threads starve 2-core machines
python3 -m ruff check .
python3 -m pytest -q "$@"
