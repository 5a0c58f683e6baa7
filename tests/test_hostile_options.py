"""Hostile numbers on every option and numeric switch: refused where they are parsed, in one line.

Every parser of the project (a file that makes an ArgumentParser or adds arguments) is in PARSERS, with how to reach
it and the arguments it requires; a new one fails `test_every_parser_module_is_walked` until
it is added. The walk takes each parser's options from argparse itself (subcommands too) and
feeds every option that takes a value `nan`, `inf`, `-1`, `0`, `1e12` and `garbage`, in
process, through the module's own parse function (its checks after argparse included). Each
answer is either argparse's refusal (SystemExit 2, the error line naming the option, no
traceback) or a parse whose every float is finite; a numeric option never accepts `nan`,
`inf`, `1e12` or garbage, and none is a bare `type=int` / `type=float` (engine.cli.finite_float
and whole_number state the range and its unit). The numeric environment switches of
engine.settings and evaluator.settings are walked the same way through their readers. A few
whole-process checks close it: the refusal is one stderr line and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from engine import cli

HOSTILE = ("nan", "inf", "-1", "0", "1e12", "garbage")
NOT_NUMBERS = ("nan", "inf", "1e12", "garbage")   # never a value of a numeric option (no range reaches 1e12)
CHOICE_OPTIONS = ("--device", "--precision", "--decoder", "--backend")   # a word from a fixed set

F, D = "{file}", "{dir}"   # stand for an existing file and an existing folder

# file -> (module or script path, how its parser is reached, required arguments, per subcommand when it has them)
#   parse_args: module.parse_args(argv) builds, parses and checks; main: the parser main() builds (caught at its
#   parse_args); build_parser / parser: module.X() returns the parser. None: a helper that builds no parser.
PARSERS: dict[str, tuple | None] = {
    "engine/cli.py": None,
    "evaluator/cir/flags.py": None,
    "engine/tuning/command.py": ("engine.tuning.command", "parse_args",
                                {"": ["--model", "m", "--out", D, "--checkpoint", F]}),
    "engine/clip/bench.py": ("engine.clip.bench", "main", {"": ["--clip", D]}),
    "engine/presets/__main__.py": ("engine.presets.__main__", "main", {"": []}),
    "evaluator/cir/ablate.py": ("evaluator.cir.ablate", "parse_args",
                                {"": ["--index-dir", D, "--queries", F, "--labels", F]}),
    "evaluator/cir/build.py": ("evaluator.cir.build", "parse_args", {"": ["--corpus", D, "--index-dir", D]}),
    "evaluator/cir/run.py": ("evaluator.cir.run", "parse_args", {"": ["--index-dir", D, "--queries", F, "--output", F]}),
    "evaluator/cir/score.py": ("evaluator.cir.score", "main", {"": ["--results", F, "--labels", F]}),
    "evaluator/contest/agreement.py": ("evaluator.contest.agreement", "main",
                                       {"": ["--predictions", F, "--reference", F]}),
    "evaluator/contest/demo.py": ("evaluator.contest.demo", "parse_args", {"": ["prepare"]}),
    "evaluator/contest/reference.py": ("evaluator.contest.reference", "parse_args",
                                       {"": [F, D, F, "--checkpoint", F]}),
    "evaluator/contest/run.py": ("evaluator.contest.run", "parse_args", {"": [F, D, F]}),
    "evaluator/contest/selfcheck.py": ("evaluator.contest.selfcheck", "main",
                                       {"run": ["run", "--artifact", D], "recorded": ["recorded", F]}),
    "evaluator/contest/sweep.py": ("evaluator.contest.sweep", "parse_args",
                                   {"": ["--model", "m", "--checkpoint", F, "--manifest", F, "--image-root", D,
                                         "--reference", F]}),
    "evaluator/evidence/campaign.py": ("evaluator.evidence.campaign", "build_parser",
                                       {"run": ["run", "--workload", "eva02-imagenet1k", "--profile", "min", "--out", D],
                                        "verify": ["verify", D], "package": ["package", D, "--out", F],
                                        "render": ["render", F]}),
    "evaluator/rehearsal/image.py": ("evaluator.rehearsal.image", "main", {"": []}),
    "evaluator/rehearsal/image_codegen.py": ("evaluator.rehearsal.image_codegen", "main", {"": ["--cuda-home", D]}),
    "evaluator/rehearsal/provenance.py": ("evaluator.rehearsal.provenance", "main", {"": [D]}),
    "evaluator/rehearsal/rehearse.py": ("evaluator.rehearsal.rehearse", "parse_args", {"": []}),
    "evaluator/synthetic/cohort.py": ("evaluator.synthetic.cohort", "main", {"": ["--out", D]}),
    "evaluator/synthetic/cir_corpus.py": ("evaluator.synthetic.cir_corpus", "main", {"": ["--out", D]}),
    "kernels/topk.py": ("kernels.topk", "main", {"": []}),
    "scripts/device_check.py": ("scripts/device_check.py", "parser", {"": ["--out", D]}),
    "scripts/device_probes.py": ("scripts/device_probes.py", "main", {"": ["packages"]}),
    "scripts/device_aot.py": ("scripts/device_aot.py", "main",
                              {"driver": ["driver"], "cuda_home": ["cuda_home"], "build": ["build", "--phases", F]}),
    "scripts/lock.py": ("scripts/lock.py", "main", {"": []}),
    "scripts/mutate.py": ("scripts/mutate.py", "main", {"": []}),
    "scripts/walk.py": ("scripts/walk.py", "main", {"": ["--follow", "x"]}),
}
WALKED = [k for k, v in PARSERS.items() if v is not None]


def test_every_parser_module_is_walked():
    found = {str(p.relative_to(REPO)) for top in ("engine", "evaluator", "kernels", "scripts")
             for p in (REPO / top).rglob("*.py") if re.search(r"add_argument\(|ArgumentParser\(|add_flags\(", p.read_text())}
    assert found == set(PARSERS), {"not in PARSERS": sorted(found - set(PARSERS)),
                                   "gone": sorted(set(PARSERS) - found)}


# ---- reaching a parser ---------------------------------------------------------------------------------


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _module(target: str, monkeypatch):
    if not target.endswith(".py"):
        return importlib.import_module(target)
    monkeypatch.syspath_prepend(str(REPO / "scripts"))   # a script imports its neighbours
    name = "_walked_" + Path(target).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / target)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _parser(mod, how: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `mod` builds: returned by its builder, or caught where its main() parses."""
    if how in ("build_parser", "parser"):
        return getattr(mod, how)()

    def catch(self, args=None, namespace=None):
        raise _Caught(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        m.setattr(sys, "argv", ["prog"])
        try:
            getattr(mod, how)([]) if inspect.signature(getattr(mod, how)).parameters else getattr(mod, how)()
        except _Caught as c:
            return c.parser
    raise AssertionError(f"{mod.__name__}.{how} parsed nothing")


def _parse(mod, how: str, parser: argparse.ArgumentParser, argv: list[str]):
    """Parse `argv` as the command does: its own parse function (with its checks) where it has one."""
    if how == "parse_args":
        return mod.parse_args(argv)
    return parser.parse_args(argv)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _value_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def _floats(obj, where: str = "") -> list[tuple[str, float]]:
    """Every float in a parsed result (a Namespace, a dataclass, and what they hold)."""
    if isinstance(obj, float):
        return [(where, obj)]
    if isinstance(obj, argparse.Namespace) or dataclasses.is_dataclass(obj):
        return [f for k, v in vars(obj).items() for f in _floats(v, f"{where}.{k}")]
    if isinstance(obj, list | tuple):
        return [f for i, v in enumerate(obj) for f in _floats(v, f"{where}[{i}]")]
    if isinstance(obj, dict):
        return [f for k, v in obj.items() for f in _floats(v, f"{where}[{k!r}]")]
    return []


def _run(mod, how, parser, argv) -> tuple[object, int | None, str]:
    """(result, exit code or None, stderr) of one parse; anything but SystemExit propagates."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return _parse(mod, how, parser, argv), None, err.getvalue()
        except SystemExit as e:
            return None, e.code, err.getvalue()


def _takes_numbers(mod, how, parser, base: list[str], action: argparse.Action) -> bool:
    """Whether the option parses a plain number into an int or a float (a count that also takes a word)."""
    for value in ("1", "16", "0.5"):
        result, code, _ = _run(mod, how, parser, [*base, action.option_strings[-1], value])
        got = getattr(result, action.dest, None) if code is None else None
        if isinstance(got, int | float) and not isinstance(got, bool):
            return True
    return False


@pytest.fixture
def filled(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x\n")

    def fill(argv: list[str]) -> list[str]:
        return [str(tmp_path / "file") if a == F else str(tmp_path / "dir") if a == D else a for a in argv]
    return fill


@pytest.fixture
def clean_env(monkeypatch):
    """No switch of this shell changes a parser's defaults."""
    from engine import settings

    for name in list(os.environ):
        if name.startswith(("ENGINE_", "CIR_", "CLIP_", "CONTEST_", "REHEARSE_")):
            monkeypatch.delenv(name)
    settings.reload()
    yield
    settings.reload()


@pytest.mark.parametrize("path", WALKED)
def test_every_option_refuses_hostile_numbers_in_one_line(path, filled, clean_env, monkeypatch):
    target, how, commands = PARSERS[path]
    mod = _module(target, monkeypatch)
    top = _parser(mod, how, monkeypatch)
    subs = _subparsers(top)
    walked, problems = 0, []
    for command, required in commands.items():
        parser = subs[command] if command else top
        base = filled(required)
        _, code, err = _run(mod, how, top, base)
        assert code is None, f"{path}: the required arguments alone are refused: {err}"
        for action in _value_options(parser):
            opt = action.option_strings[-1]
            if action.type in (int, float):
                problems.append(f"{opt}: a bare type={action.type.__name__} (use engine.cli.finite_float/whole_number)")
            numeric = isinstance(action.type, cli.Ranged) or _takes_numbers(mod, how, top, base, action)
            for value in HOSTILE:
                walked += 1
                result, code, err = _run(mod, how, top, [*base, opt, value])
                if code is None:
                    bad = [(w, f) for w, f in _floats(result) if not math.isfinite(f)]
                    if bad:
                        problems.append(f"{opt} {value}: accepted as {bad}")
                    elif value in NOT_NUMBERS and (numeric or opt in CHOICE_OPTIONS and value == "garbage"):
                        problems.append(f"{opt} {value}: accepted")
                    continue
                lines = err.strip().splitlines()
                if code != 2 or "Traceback" in err or not lines or "error:" not in lines[-1]:
                    problems.append(f"{opt} {value}: exit {code}, stderr {err[-300:]!r}")
                elif isinstance(top, cli.ArgumentParser) and len(lines) != 1:
                    problems.append(f"{opt} {value}: {len(lines)} stderr lines, not one: {err!r}")
                elif opt not in lines[-1] and action.dest.replace("_", "-") not in lines[-1]:
                    problems.append(f"{opt} {value}: the refusal does not name the option: {lines[-1]}")
            if isinstance(action.type, cli.Ranged) and isinstance(parser.formatter_class, type) and issubclass(parser.formatter_class,
                                                                                   cli.HelpFormatter):
                if action.type.allowed not in " ".join(parser.format_help().split()):
                    problems.append(f"{opt}: --help does not state its range {action.type.allowed}")
    assert walked or path in ("engine/presets/__main__.py", "evaluator/rehearsal/image.py",
                              "evaluator/rehearsal/image_codegen.py", "scripts/lock.py"), f"{path}: no option walked"
    assert not problems, "\n".join([path, *problems])


def test_ranged_types_refuse_non_finite_and_out_of_range_and_name_the_unit():
    seconds = cli.finite_float(0.0, cli.MAX_DEADLINE_S, "s", lo_open=True)
    assert seconds("1e6") == 1e6 and seconds(" 2.5 ") == 2.5
    for text in ("nan", "-nan", "inf", "-inf", "0", "-1", "1e12", "garbage", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"\(0, 2592000\] s, got"):
            seconds(text)
    count = cli.whole_number(1, 64, "threads")
    assert count("64") == 64
    for text in ("0", "65", "1.5", "1e3", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"1\.\.64 threads"):
            count(text)
    assert cli.SEED("4294967295") == 2**32 - 1
    with pytest.raises(argparse.ArgumentTypeError):
        cli.SEED("-1")
    assert cli.device_name("cuda:1") == "cuda:1"
    with pytest.raises(argparse.ArgumentTypeError, match="cpu, cuda or cuda:N"):
        cli.device_name("abc")


# ---- environment switches ------------------------------------------------------------------------------


def _switch_readers() -> list[tuple[object, str, str]]:
    """(module, getter, variable) of every zero-argument getter of the settings modules that reads one switch."""
    import engine.settings
    import evaluator.settings

    out = []
    for mod in (engine.settings, evaluator.settings):
        for name, fn in vars(mod).items():
            if not inspect.isfunction(fn) or fn.__module__ != mod.__name__ or name.startswith("_"):
                continue
            if any(p.default is p.empty for p in inspect.signature(fn).parameters.values()):
                continue
            names = re.findall(r"\bread\(\"(\w+)\"", inspect.getsource(fn))
            if len(names) == 1:
                out.append((mod, name, names[0]))
    return out


def test_numeric_switches_refuse_non_finite_and_garbage(monkeypatch, clean_env):
    from engine import settings

    readers = _switch_readers()
    assert {"ENGINE_BUILD_DEADLINE_S", "ENGINE_T0", "CIR_TEXT_WEIGHT", "ENGINE_THREADS"} <= {v for _, _, v in readers}
    numeric, problems = [], []
    for mod, getter, var in readers:
        monkeypatch.setenv(var, "1")
        settings.reload()
        try:
            one = getattr(mod, getter)()
        except settings.SettingsError:
            one = None
        if isinstance(one, bool) or not isinstance(one, int | float):
            continue
        numeric.append(var)
        for value in HOSTILE:
            monkeypatch.setenv(var, value)
            settings.reload()
            try:
                got = getattr(mod, getter)()
            except settings.SettingsError as e:
                if var not in str(e) or "\n" in str(e):
                    problems.append(f"{var}={value}: {e!r}")
                continue
            if value in NOT_NUMBERS or not math.isfinite(got):
                problems.append(f"{var}={value}: accepted as {got!r}")
        monkeypatch.delenv(var)
    settings.reload()
    assert "ENGINE_BUILD_DEADLINE_S" in numeric and "CIR_TEXT_WEIGHT" in numeric and "ENGINE_T0" in numeric
    assert not problems, "\n".join(problems)


def test_the_build_knobs_refuse_hostile_values_naming_the_knob(tmp_path, clean_env):
    """./build.sh's knobs become engine.build flags, checked by its parser before anything is built."""
    from evaluator import settings as ev
    from evaluator.contest import build_step

    (tmp_path / "model.safetensors").write_bytes(b"x")
    problems = []
    for knob in ev.BUILD_FLAG_KNOBS:
        if knob == "ENGINE_MODEL":   # a timm name: any word is one until the model is made
            continue
        for value in HOSTILE:
            flags = build_step.engine_flags({"ENGINE_MODEL": "m", knob: value}, tmp_path / "model.safetensors",
                                            tmp_path / "art", "cpu")
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    build_step.check_knobs(flags)
            except build_step.Stop as e:
                if e.status != 2 or not str(e).startswith(f"{knob}:"):
                    problems.append(f"{knob}={value}: {e.status} {e}")
                continue
            problems.append(f"{knob}={value}: accepted")
    assert not problems, "\n".join(problems)


# ---- downstream of a valid but long deadline --------------------------------------------------------


def test_a_long_deadline_reaches_no_clock_as_an_overflow(monkeypatch, tmp_path):
    """A deadline of 1e6 s (valid) or more (an API caller) is cut before it becomes a timeout."""
    from engine.tuning import auto
    from engine.tuning.clock import BuildClock

    MAX_WAIT_S = 30 * 86400.0   # the longest deadline a build keeps (engine.cli.MAX_DEADLINE_S)

    for deadline in (1e6, 1e12, math.inf):
        c = BuildClock(deadline, {}, clock=lambda: 0.0)
        assert math.isfinite(c.left()) and c.left() <= MAX_WAIT_S and c.plan_line() and c.record()
    with pytest.raises(ValueError):
        BuildClock(math.nan, {})
    seen = []

    def fake_run(cmd, **kw):
        seen.append(kw["timeout"])
        return subprocess.CompletedProcess(cmd, 1, "", "no artifact\n")

    monkeypatch.setattr(auto.children, "run", fake_run)
    for timeout in (1e12, math.inf):
        _, info = auto._run_script(tmp_path, [], "pil", timeout)
        assert "exited 1" in info["why"]
    assert seen and all(math.isfinite(t) and t <= MAX_WAIT_S for t in seen), seen
    subprocess.run([sys.executable, "-c", "pass"], timeout=seen[0], check=True)   # a timeout subprocess can hold


# ---- whole processes -------------------------------------------------------------------------------------


def _process(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.abi
@pytest.mark.parametrize("argv, words", [
    (["scripts/run.sh", "--index-dir", "{dir}", "--queries", "{file}", "--output", "{out}", "--device", "abc"],
     "--device"),
    (["scripts/build.sh", "--corpus", "{dir}", "--index-dir", "{out}", "--precision", "abc"], "--precision"),
    (["scripts/build.sh", "--corpus", "{dir}", "--index-dir", "{out}", "--decoder", "abc"], "--decoder"),
    (["scripts/build.sh", "--corpus", "{dir}", "--index-dir", "{out}", "--dba-alpha", "nan"], "--dba-alpha"),
    (["-m", "evaluator.demo", "prepare", "--out", "{out}", "--seed", "-1"], "--seed"),
    (["-m", "engine.build", "--model", "m", "--out", "{out}", "--deadline-s", "inf"], "--deadline-s"),
    (["-m", "engine.build", "--model", "m", "--out", "{out}", "--guard-budget", "nan"], "--guard-budget"),
], ids=lambda v: " ".join(v[-2:]) if isinstance(v, list) else None)
def test_entry_points_refuse_hostile_values_in_one_line(argv, words, tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("{}\n")
    argv = [a.format(dir=tmp_path / "dir", file=tmp_path / "file", out=tmp_path / "out") for a in argv]
    argv = [sys.executable, *argv] if argv[0] == "-m" else [str(REPO / argv[0]), *argv[1:]]
    r = _process(argv, tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and "error:" in lines[0] and words in lines[0], lines
    assert not (tmp_path / "out").exists()   # refused before anything is written
