#!/bin/sh
# Install the locked test stack and run the whole suite (lint, static check, tests), CPU only.
# CI runs exactly this (.ci/run). GPU tests skip cleanly without CUDA. The full run ends with
# pytest's 25 slowest durations.
#
# --quick (first argument): the same install, lint and static check, then only the unit tier:
# pytest -m "not abi and not slow and not gpu" (no entry point started as a whole process, no
# long test). Any other arguments go to pytest in either mode.
#
# Python packages: requirements/lock.txt (the contest stack, the same lock the Dockerfile
# installs) + requirements/dev.txt (the test tools), then the project itself.
# System packages (headless Chromium, for the campaign report's rendering test) only when
# asked, INSTALL_SYSTEM_PACKAGES=1, or in CI (CI=true): apt-get as root, said on stderr.
# Otherwise that test skips and says why.
#
#   scripts/test.sh [PYTEST ARGS]    (default: the whole suite; e.g. -x tests/test_demo.py)
#   scripts/test.sh --help           this text; installs and runs nothing
set -eu
case "${1:-}" in
    -h|--help) sed -n '2,/^set -eu$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = --quick ]; then
    quick=1
    shift
fi
python3 -m pip install -q -r requirements/lock.txt -r requirements/scale.txt -r requirements/dev.txt -e '.[dev]'
if [ "${INSTALL_SYSTEM_PACKAGES:-0}" = 1 ] || [ "${CI:-}" = true ]; then
    if command -v chromium >/dev/null 2>&1; then
        :
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test.sh: installing the Debian package chromium with apt-get (INSTALL_SYSTEM_PACKAGES=1 or CI=true)" >&2
        (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
            || echo "test.sh: chromium could not be installed: its test will skip" >&2
    else
        echo "test.sh: chromium not installed and apt-get needs root here: its test will skip" >&2
    fi
elif ! command -v chromium >/dev/null 2>&1; then
    echo "test.sh: chromium not installed: its test will skip (INSTALL_SYSTEM_PACKAGES=1 installs it with apt-get)" >&2
fi
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # busy-waiting OpenMP threads starve 2-core machines
python3 -m ruff check .
python3 scripts/static_check.py  # names that do not resolve (imports, module attributes), also in tests that skip here
if [ "$quick" = 1 ]; then
    python3 -m pytest -q -m "not abi and not slow and not gpu" "$@"
else
    python3 -m pytest -q --durations=25 "$@"
fi
