"""Every entry point the README and docs/ name answers `--help` with exit 0, and every option its
help lists says what it does and, where it takes a value and may be left out, its default.

The entry points are run as processes (a wrapper that mistakes --help for an argument fails
here), with the subcommands their help lists (`campaign run`, ...). An option "says its
default" when its text holds `default` (argparse's `(default: X)` or the project's own words,
e.g. `(default: not written)`) or `required` (an input some profiles require). A module or
script the documents name that is not in ENTRY_POINTS fails
`test_every_named_entry_point_is_walked` until it is added.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO

PY = "python"   # stands for this interpreter in ENTRY_POINTS
ENTRY_POINTS: list[tuple[str, ...]] = [
    (PY, "-m", "engine.build"), (PY, "-m", "engine.presets"), (PY, "-m", "engine.clip.bench"),
    (PY, "-m", "evaluator.demo"), (PY, "-m", "evaluator.demo", "prepare"), (PY, "-m", "evaluator.cohort"),
    (PY, "-m", "evaluator.reference"), (PY, "-m", "evaluator.agreement"), (PY, "-m", "evaluator.sweep"),
    (PY, "-m", "evaluator.provenance"), (PY, "-m", "evaluator.campaign"), (PY, "-m", "evaluator.cir_corpus"),
    (PY, "-m", "evaluator.score_retrieval"), (PY, "-m", "evaluator.ablate"), (PY, "-m", "evaluator.rehearse"),
    (PY, "-m", "evaluator.rehearsal.image"), (PY, "-m", "evaluator.contest.build_step"),
    (PY, "-m", "evaluator.cir.run"), (PY, "-m", "evaluator.cir.build"), (PY, "-m", "kernels.topk"),
    ("./build.sh",), ("scripts/run",), ("scripts/build.sh",), ("scripts/run.sh",), ("scripts/rehearse",),
    ("scripts/device_check.sh",), (PY, "scripts/device_check.py"), (PY, "scripts/device_aot.py"),
    (PY, "scripts/lock.py"), (PY, "scripts/mutate.py"), ("scripts/test.sh",), (PY, "scripts/device_probes.py"),
    (PY, "scripts/walk.py"),
]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _argv(cmd: tuple[str, ...]) -> list[str]:
    return [sys.executable if cmd[0] == PY else str(REPO / cmd[0]), *cmd[1:]]


def _env(cmd: tuple[str, ...], stubs: Path) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    if cmd == ("scripts/test.sh",):   # its --help must install and run nothing: a python3 that says so
        env["PATH"] = f"{stubs}{os.pathsep}{env.get('PATH', '')}"
    return env


def _help(cmd: tuple[str, ...], stubs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*_argv(cmd), "--help"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=_env(cmd, stubs))


def subcommands(text: str) -> list[str]:
    """The subcommands a help lists: `{a,b}` under positional arguments, each then on its own line."""
    block = re.search(r"^  \{([\w,-]+)\}\n((?: {4,}\S.*\n?)+)", text, re.M)
    if not block:
        return []
    listed = {ln.split()[0] for ln in block.group(2).splitlines() if re.match(r"^ {4}\S", ln)}
    return [s for s in block.group(1).split(",") if s in listed]


def optional_flags(text: str) -> dict[str, bool]:
    """{flag: may be left out} from the help's usage block (a flag in [ ] is optional)."""
    m = re.search(r"^usage: .*?(?=\n\n|\Z)", text, re.M | re.S)
    depth, out = 0, {}
    for tok in re.finditer(r"[\[\]]|(?<![\w-])(--?\w[\w-]*)", m.group(0) if m else ""):
        t = tok.group(0)
        if t in "[]":
            depth += 1 if t == "[" else -1
        else:
            out.setdefault(t, depth > 0)
    return out


def entries(text: str) -> list[tuple[str, str]]:
    """(header, help text) of every entry of argparse's option sections: `options:`, `positional
    arguments:` and any group whose first entry is a flag (not `environment:` and other epilogs)."""
    sections: list[tuple[str, list[list[str]]]] = []
    for ln in text.splitlines():
        if ln and not ln.startswith(" ") and ln.rstrip().endswith(":"):
            sections.append((ln.strip(), []))
        elif not ln.strip() or not sections:
            continue
        elif m := re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", ln):   # an entry: its header, its text if on the line
            sections[-1][1].append([m.group(1), m.group(2) or ""])
        elif sections[-1][1]:
            sections[-1][1][-1][1] += " " + ln.strip()
    out = []
    for title, items in sections:
        if title in ("options:", "positional arguments:") or (items and items[0][0].startswith("-")):
            out += [(h, " ".join(t.split())) for h, t in items]
    return out


def problems(text: str) -> list[str]:
    """An option without text, or one that takes a value, may be left out and says no default."""
    optional, found = optional_flags(text), []
    for head, what in entries(text):
        flags = re.findall(r"(?<![\w-])--?\w[\w-]*", head)
        takes_value = bool(flags) and bool(re.search(r"-[\w-]+[ =](?:[A-Z{]|\w+:)", head))
        if not what:
            found.append(f"{head}: no text")
        elif takes_value and optional.get(flags[-1], True) and not re.search(r"default|required", what, re.I):
            found.append(f"{head}: says no default ({what[:70]})")
    return found


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Every entry point's --help and its subcommands', four at a time."""
    stubs = tmp_path_factory.mktemp("stubs")
    marker = stubs / "python3-was-called"
    (stubs / "python3").write_text(f"#!/bin/sh\necho \"$@\" >> '{marker}'\nexit 3\n")
    (stubs / "python3").chmod(0o755)
    with ThreadPoolExecutor(4) as pool:
        out = dict(zip(ENTRY_POINTS, pool.map(lambda c: _help(c, stubs), ENTRY_POINTS)))
        subs = [(*c, s) for c, r in out.items() for s in subcommands(r.stdout) if (*c, s) not in out]
        out |= dict(zip(subs, pool.map(lambda c: _help(c, stubs), subs)))
    out[("python3 stub calls",)] = marker.read_text() if marker.exists() else ""
    return out


@pytest.mark.parametrize("cmd", ENTRY_POINTS, ids=" ".join)
def test_help_exits_0_and_every_option_says_what_it_does_and_its_default(helps, cmd):
    walked = [c for c in helps if c[:len(cmd)] == cmd and (c == cmd or len(c) == len(cmd) + 1)]
    for c in walked:
        r = helps[c]
        assert r.returncode == 0, (" ".join(c), r.stderr[-2000:])
        assert r.stdout.strip() and "Traceback" not in r.stderr, (" ".join(c), r.stderr[-2000:])
        assert not problems(r.stdout), (" ".join(c), problems(r.stdout))
    if cmd == ("scripts/test.sh",):
        assert helps[("python3 stub calls",)] == "", "scripts/test.sh --help ran python3"
        assert "scripts/test.sh --help" in helps[cmd].stdout


def test_subcommands_are_walked(helps):
    assert {("campaign", s) for s in ("run", "verify", "package", "render")} <= \
        {(c[2].split(".")[-1], c[3]) for c in helps if len(c) == 4 and c[:3] == (PY, "-m", "evaluator.campaign")}


def test_every_named_entry_point_is_walked():
    named = set()
    for doc in DOCS:
        text = doc.read_text()
        named |= {(PY, "-m", m) for m in re.findall(r"python3? -m ((?:engine|evaluator|kernels)[\w.]*\w)", text)}
        for s in re.findall(r"(?<![\w./-])((?:\./)?scripts/[\w.]+\w|\./build\.sh)", text):
            s = s.removeprefix("./") if s.startswith("./scripts/") else s
            named.add((PY, s) if s.endswith(".py") else (s,))
    walked = {c[:3] if c[0] == PY and c[1] == "-m" else c[:2] if c[0] == PY else c[:1] for c in ENTRY_POINTS}
    assert named <= walked, sorted(named - walked)


def test_the_checks_catch_an_option_without_text_or_default():
    text = ("usage: prog [-h] --out OUT [--seed SEED] [--json JSON] [--fast]\n\noptions:\n"
            "  -h, --help   show this help message and exit\n  --out OUT\n"
            "  --seed SEED  the seed (default: 0)\n  --json JSON  also write JSON here\n"
            "  --fast       go fast\n\nenvironment:\n  X_VAR  what it is\n")
    assert problems(text) == ["--out OUT: no text", "--json JSON: says no default (also write JSON here)"]
    assert subcommands("positional arguments:\n  {run,verify}\n    run   runs\n    verify  checks\n") == \
        ["run", "verify"]
    assert subcommands("positional arguments:\n  {run,prepare}  run: measure; prepare: write\n") == []
