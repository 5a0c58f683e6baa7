"""The quick tier is honest: `scripts/test.sh --quick` deselects the `abi`, `slow` and `gpu` marks,
and every test that starts one of the project's entry points as a whole process carries `abi`.

Checked on the source (ast): a test starts an entry point when it, a helper or fixture of its own
module it uses, calls `run_abi`, `script` or `killed_run`, or calls `subprocess.*` with a command
that names scripts/run, scripts/run.sh, scripts/build.sh, scripts/rehearse, scripts/device_check.*,
./build.sh or `python -m engine.* / evaluator.*`. The session's shared retrieval index and run
(`built_index`, `full_run`, `p2w_index`: built once through scripts/build.sh and run.sh, about
10 s each) are fixtures, not what a test starts; the dev tools (scripts/test.sh with stubbed
tools, scripts/static_check.py) are not entry points."""
from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICK = ("not abi", "not slow", "not gpu")
PROCESS_HELPERS = {"run_abi", "script", "killed_run"}      # conftest / cir_helpers: an entry point as a process
SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call"}
DEV_TOOLS = ("test.sh", "static_check.py", "mutate.py", "lock.py")
# an entry point named in a command, as ast.unparse writes it (single quotes) or inside a shell string
ENTRY_POINT = re.compile(
    r"'scripts'\s*/\s*(?!\s|'(?:" + "|".join(map(re.escape, DEV_TOOLS)) + r")')"   # REPO / 'scripts' / 'run', / name
    r"|\bscripts/(?:run|build\.sh|rehearse|device_check)"                         # scripts/run in a shell line
    r"|'build\.sh'|\./build\.sh"                                                   # the contest's ./build.sh
    r"|-m(?:',\s*'|\s+)(?:engine|evaluator)\.")                                    # python -m engine.build ...


def _test_files() -> list[Path]:
    return sorted((REPO / "tests").rglob("test_*.py"))


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_subprocess_call(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "subprocess"
            and f.attr in SUBPROCESS_CALLS)


class _Module:
    """One test file: its module-level names (values as text), functions and marks."""

    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_text())
        self.consts: dict[str, str] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.class_of: dict[str, ast.ClassDef] = {}
        top = [n for node in self.tree.body for n in (node.body if isinstance(node, ast.If) else [node])]
        for node in top:        # module level, also under a top-level `if` (a file that is a script too)
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        self.consts[t.id] = ast.unparse(node.value)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for n in node.body:
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.functions[f"{node.name}.{n.name}"] = n
                        self.class_of[f"{node.name}.{n.name}"] = node
        self.module_marked = "pytest.mark.abi" in self.consts.get("pytestmark", "")

    def marked_abi(self, name: str) -> bool:
        fn, cls = self.functions[name], self.class_of.get(name)
        decorators = fn.decorator_list + (cls.decorator_list if cls else [])
        return self.module_marked or any("pytest.mark.abi" in ast.unparse(d) for d in decorators)

    def _spawns(self, fn: ast.FunctionDef) -> bool:
        return any(isinstance(n, ast.Call) and _is_subprocess_call(n) for n in ast.walk(fn))

    def _command_text(self, fn: ast.FunctionDef, call: ast.Call) -> str:
        """A process call as text, with the names it uses resolved: local assignments in `fn`,
        module-level values, and `fn`'s parametrize values when a name is a parameter."""
        local = {t.id: ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        parts, todo, seen = [ast.unparse(call)], [call], set()
        while todo:
            for name in {n.id for n in ast.walk(todo.pop()) if isinstance(n, ast.Name)} - seen:
                seen.add(name)
                if name in local:
                    parts.append(local[name])
                    todo.append(ast.parse(local[name], mode="eval"))
                if name in self.consts:
                    parts.append(self.consts[name])
                if name in params:
                    parts += map(ast.unparse, fn.decorator_list)
                    todo += fn.decorator_list
        return " ".join(parts)

    def _uses(self, fn: ast.FunctionDef) -> set[str]:
        """Functions of this module it calls, and its fixtures that are defined here."""
        called = {_call_name(n) for n in ast.walk(fn) if isinstance(n, ast.Call)}
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        return {n for n in called | params if n in self.functions}

    def why_process(self, name: str) -> str | None:
        """How this test, or a helper or fixture of this module it uses, starts an entry point
        as a process (None when it does not)."""
        seen, todo = set(), [name]
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            fn = self.functions[key]
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                callee = _call_name(call)
                if callee in PROCESS_HELPERS:
                    return f"{key} calls {callee}"
                wrapper = callee in self.functions and self._spawns(self.functions[callee])
                if _is_subprocess_call(call) or wrapper:
                    hit = ENTRY_POINT.search(self._command_text(fn, call))
                    if hit:
                        return f"{key} runs a process naming {hit.group(0)!r}"
            todo += self._uses(fn)
        return None

    def tests(self) -> list[str]:
        return [k for k in self.functions if k.split(".")[-1].startswith("test")]


def test_every_test_that_starts_an_entry_point_is_marked_abi():
    unmarked = []
    for path in _test_files():
        mod = _Module(path)
        for name in mod.tests():
            why = mod.why_process(name)
            if why and not mod.marked_abi(name):
                unmarked.append(f"{path.relative_to(REPO)}::{name} ({why})")
    assert not unmarked, ("tests that start an entry point as a process but run in the quick tier "
                          "(add @pytest.mark.abi, or pytestmark = pytest.mark.abi for the file):\n"
                          + "\n".join(unmarked))


def test_the_scan_sees_each_way_a_test_starts_an_entry_point(tmp_path):
    """The check above finds what it looks for: helpers, commands, local variables, fixtures, parameters."""
    src = '''
import subprocess, sys
import pytest
from conftest import REPO, run_abi
STEPS = [("run", "ENGINE_ARTIFACT=a scripts/run m r o")]

def _cli(*args):
    return subprocess.run([sys.executable, *args])

@pytest.fixture
def built(tmp_path):
    subprocess.run(["sh", str(REPO / "build.sh")])

def test_helper(): run_abi(1, 2, 3, 4)
def test_script(): subprocess.run([str(REPO / "scripts" / "run.sh")])
def test_variable():
    cmd = ["sudo", str(REPO / "scripts" / "run")]
    subprocess.run(cmd)
def test_wrapper(): _cli("-m", "evaluator.reference", "m")
def test_fixture(built): pass
@pytest.mark.parametrize("name, cmd", STEPS)
def test_param(name, cmd): subprocess.run(["sh", "-c", cmd])
@pytest.mark.abi
def test_marked(): run_abi(1, 2, 3, 4)
def test_git(): subprocess.run(["git", "status"])
def test_dev_tool(): subprocess.run([str(REPO / "scripts" / "static_check.py")])
def test_reads_a_script(): assert "exec" in (REPO / "scripts" / "run").read_text()
'''
    (tmp_path / "test_x.py").write_text(src)
    mod = _Module(tmp_path / "test_x.py")
    found = {n for n in mod.tests() if mod.why_process(n)}
    assert found == {"test_helper", "test_script", "test_variable", "test_wrapper", "test_fixture", "test_param",
                     "test_marked"}, found
    assert {n for n in found if mod.marked_abi(n)} == {"test_marked"}
    (tmp_path / "test_y.py").write_text("import pytest\npytestmark = [pytest.mark.abi]\n" + src)
    whole = _Module(tmp_path / "test_y.py")
    assert all(whole.marked_abi(n) for n in whole.tests())


def test_the_abi_marker_is_registered():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = {m.split(":")[0].strip() for m in markers}
    assert {"abi", "slow", "gpu"} <= names, markers


def _test_sh_pytest_args(tmp_path, *args: str) -> list[str]:
    """The arguments scripts/test.sh gives pytest, its tools stubbed (python3 records each argument)."""
    from test_dockerfile import _fake_tools

    tmp_path.mkdir()
    env, log = _fake_tools(tmp_path)
    (tmp_path / "bin" / "python3").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done >> "$LOG"\n'
                                              'printf "\\n" >> "$LOG"\n')
    r = subprocess.run(["/bin/sh", str(REPO / "scripts" / "test.sh"), *args], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = [line.split("\0")[:-1] for line in log.read_text().splitlines() if "\0" in line]
    assert calls[-1][:2] == ["-m", "pytest"], calls
    return calls[-1][2:]


def test_quick_runs_only_the_unit_tier_and_the_full_suite_everything(tmp_path):
    """--quick: pytest -m 'not abi and not slow and not gpu' plus the given arguments; without it the
    whole suite (no -m) with the 25 slowest durations, which is what CI runs."""
    quick = _test_sh_pytest_args(tmp_path / "q", "--quick", "-k", "nothing")
    assert quick == ["-q", "-m", " and ".join(QUICK), "-k", "nothing"], quick
    assert _test_sh_pytest_args(tmp_path / "f") == ["-q", "--durations=25"]
    assert _test_sh_pytest_args(tmp_path / "a", "-x", "tests/test_spec.py") == ["-q", "--durations=25", "-x",
                                                                                "tests/test_spec.py"]
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == "exec ./scripts/test.sh", ci       # CI: exactly the README's command, the whole suite
