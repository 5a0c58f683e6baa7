"""Print a pinned lock of installed packages: the given roots and everything they pull, as installed.

    python scripts/lock.py torch torchvision ... > requirements/lock.txt

Run it in the environment the suite passed in (after `pip install` of the new versions):
it walks each root's requirements (extras and environment markers evaluated for this
machine) through the installed distributions and writes `name==version` for each, sorted.
The CUDA wheels torch and DALI pull (nvidia-*, cuda-*) and triton exist only on Linux:
they carry the `platform_system == "Linux"` marker torch itself gives them.
`--exclude LOCK` leaves out what another lock already pins (the dev and GPU locks).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys

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


def main() -> int:
    p = argparse.ArgumentParser(prog="python scripts/lock.py", description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="+")
    p.add_argument("--exclude", action="append", default=[], help="a lock whose pins to leave out")
    a = p.parse_args()
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
