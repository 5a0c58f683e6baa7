"""Print a pinned lock of installed packages: the given roots and everything they pull, as installed.

    python scripts/lock.py torch torchvision ... > requirements/lock.txt

Run it in the environment the suite passed in (after `pip install` of the new versions):
it walks each root's requirements (extras and environment markers evaluated for this
machine) through the installed distributions and writes `name==version` for each, sorted.
The CUDA wheels torch and DALI pull (nvidia-*, cuda-*) and triton exist only on Linux:
they carry the `platform_system == "Linux"` marker torch itself gives them.
`--exclude LOCK` leaves out what another lock already pins (the dev and GPU locks).

    python scripts/lock.py --resolves requirements/lock.txt [--arch aarch64] [--glibc 2.36]

checks instead that every pin of a lock has a wheel for the image's other platform: a
`pip install --dry-run --no-deps --only-binary=:all:` for that architecture's manylinux tags up
to the base image's glibc (Debian bookworm: 2.36) and this Python, nothing downloaded but
metadata. Needs the index (PyPI); NVIDIA-only pins (gpu.txt's TensorRT libraries) fail it.

    python scripts/lock.py --metadata

reads from PyPI, for every pin of the locks the Dockerfile installs and for linux x86_64 and
aarch64, the Requires-Dist of the file pip would install there, writes them with the locks' sha256
to requirements/metadata.json, and checks that the pins meet every requirement on each
architecture (scripts/lock_metadata.py; tests/test_lock_metadata.py runs that check offline).
Run it after any change to a lock.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

LINUX_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def closure(roots: list[str]) -> dict[str, str]:
    """{normalised name: installed version} of `roots` and their installed requirements."""
    out: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    stack = [(Requirement(r).name, frozenset(Requirement(r).extras)) for r in roots]
    while stack:
        name, extras = stack.pop()
        if (norm(name), extras) in seen:
            continue
        seen.add((norm(name), extras))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(f"lock.py: error: {name} is not installed here")
        out[norm(name)] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            wanted = req.marker is None or any(
                req.marker.evaluate({**default_environment(), "extra": e}) for e in (extras or {""}))
            if wanted:
                stack.append((req.name, frozenset(req.extras)))
    return out


def resolves(lock: str, arch: str, glibc: str) -> int:
    """0 when pip finds a wheel of every pin of `lock` for linux `arch` (glibc <= `glibc`), this Python."""
    major, minor = map(int, glibc.split("."))
    tags = ["linux_" + arch, "manylinux2014_" + arch] + [f"manylinux_{major}_{m}_{arch}" for m in range(17, minor + 1)]
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--only-binary=:all:", "--quiet",
               "--python-version", py, "--implementation", "cp", "--target", target, "-r", lock]
        r = subprocess.run(cmd + [a for t in tags for a in ("--platform", t)], capture_output=True, text=True)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR: No matching distribution")]
    print(f"{lock}: {'resolves' if r.returncode == 0 else 'does NOT resolve'} for linux {arch} "
          f"(glibc <= {glibc}, Python {py})" + (f": {errors[0]}" if errors else ""),
          file=sys.stderr if r.returncode else sys.stdout)
    return r.returncode


def metadata() -> int:
    """Write requirements/metadata.json from the index; 0 when the locks meet every requirement on both arches."""
    import json

    import lock_metadata as lm  # scripts/ is this script's folder, first on sys.path

    locks = lm.read_locks()
    try:
        data = lm.fetch(locks, say=lambda line: print(line, file=sys.stderr))
    except (OSError, LookupError) as e:      # the index unreachable, a file unreadable
        print(f"lock.py: error: reading the index: {e}", file=sys.stderr)
        return 1
    Path(lm.REPO / lm.DATA).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    problems = lm.unmet(locks, data["requires"])
    for arch in lm.ARCHES:
        for line in problems.get(arch, []):
            print(f"{arch}: {line}", file=sys.stderr)
        partial = data["partial"][arch]
        print(f"{arch}: {len(data['requires'][arch])} pins, "
              f"{'requirements met' if arch not in problems else str(len(problems[arch])) + ' unmet'}"
              + (f"; incomplete metadata: {', '.join(sorted(partial))}" if partial else ""))
    print(f"wrote {lm.DATA}")
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python scripts/lock.py", description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="*", help="the packages to lock with their installed dependencies (default: none)")
    p.add_argument("--exclude", action="append", default=[],
                   help="a lock whose pins to leave out (repeatable; default: none)")
    p.add_argument("--resolves", metavar="LOCK",
                   help="check LOCK has a wheel of every pin for --arch instead (default: write a lock)")
    p.add_argument("--arch", default="aarch64", help="with --resolves (default aarch64, the scored machine's)")
    p.add_argument("--glibc", default="2.36",
                   help="with --resolves: the base image's glibc (default 2.36, bookworm's)")
    p.add_argument("--metadata", action="store_true",
                   help="fetch every Docker lock pin's requirements for both architectures into "
                        "requirements/metadata.json and check them (default: write a lock)")
    a = p.parse_args()
    if a.metadata:
        return metadata()
    if a.resolves:
        return 1 if resolves(a.resolves, a.arch, a.glibc) else 0
    if not a.roots:
        p.error("name the roots to lock (or --resolves LOCK)")
    skip = set()
    for lock in a.exclude:
        with open(lock) as f:
            skip |= {norm(ln.split("==")[0]) for ln in f if "==" in ln and not ln.startswith("#")}
    for name, version in sorted(closure(a.roots).items()):
        if name not in skip:
            marker = '; platform_system == "Linux"' if LINUX_ONLY.match(name) else ""
            print(f"{name}=={version}{marker}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
