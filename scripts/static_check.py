"""Fail on names that do not resolve: imports of project modules and names, attributes of modules,
undefined names, also inside unannotated functions (all tests).

    python3 scripts/static_check.py [PATH ...]   (default: engine evaluator kernels scripts/*.py tests)

Runs mypy with the settings of [tool.mypy] in pyproject.toml, with no cache (nothing is written),
and fails only on those findings: mypy's other findings (types the code does not annotate) are
not part of the check. Prints the offending lines; exit 1 on findings, 2 when mypy cannot run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREE = ["engine", "evaluator", "kernels", *sorted(f"scripts/{p.name}" for p in (REPO / "scripts").glob("*.py")),
        "tests"]
CODES = {"name-defined", "import-not-found"}
ERROR = re.compile(r"^\S+:\d+: error: (?P<message>.*)  \[(?P<code>[a-z-]+)\]$")


def is_finding(line: str) -> bool:
    """A mypy output line the check fails on (attr-defined only for modules, not for objects)."""
    m = ERROR.match(line)
    return bool(m) and (m["code"] in CODES or (m["code"] == "attr-defined" and m["message"].startswith("Module ")))


def main(argv: list[str]) -> int:
    paths = [str(Path(p).resolve()) for p in argv] or TREE
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir", os.devnull,
           "--show-error-codes", "--no-pretty", "--no-error-summary", "--hide-error-context", *paths]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)  # cwd: the project modules are read here
    if r.returncode not in (0, 1):
        print(f"static_check: mypy failed (exit {r.returncode}):\n{r.stdout}{r.stderr}", file=sys.stderr)
        return 2
    findings = [ln for ln in r.stdout.splitlines() if is_finding(ln)]
    for ln in findings:
        print(ln)
    if findings:
        print(f"static_check: {len(findings)} name(s) that do not resolve", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
