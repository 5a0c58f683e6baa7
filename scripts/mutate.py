"""Mutation testing of the rule modules: plant one small bug at a time, run only the tests
that cover the module, and report the bugs the tests let through.

    python scripts/mutate.py [--module M ...] [--tests T ...] [--functions F ...]
                             [--out docs/mutation] [--timeout S] [--list] [--no-fork]

M is a key of TARGETS (`score`, `promotion`, ...), a dotted module or a file path. Without
--module every target runs in turn. --tests replaces the mapped test files; --functions
limits the mutated functions (`<module>` names module-level constants).

Operators (one mutant per site and change, applied to the source text so the diff is one
line): comparison flips (< <=, > >=, == !=, is / is not, in / not in), `and` / `or`,
`not` removed, int constants +1 / -1, float constants 0 <-> 1 or doubled, True <-> False,
+ <-> -, * <-> /, min <-> max, any <-> all, `return X` -> `return not X` (a test) or
`return None`, a call / augmented or attribute assignment / raise / continue / break
replaced by `pass`, and a non-constant slice bound +1 / -1. Lines carrying
`# pragma: no mutate` are skipped.

Each mutant is written into one temporary copy of the repository (the files git tracks
and the untracked ones it does not ignore), and `pytest -x -q TESTS` runs there with a
per-mutant timeout: a failing or timed-out run kills the mutant. By default a worker
process imports the heavy third-party modules once and forks a fresh child per mutant
(--no-fork starts a new interpreter each time). The tests must pass on the unmutated copy
first. Mutants listed in EQUIVALENT_FILE (file, function, operator, before, after, reason)
change no behaviour; the report counts them apart. The report: OUT/mutation.json and
OUT/mutation.md, the score per module (killed / non-equivalent mutants) and each
surviving mutant's location and diff. Exit status 0 when every module reaches --min-score,
1 otherwise, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import ast
import copy
import difflib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = "docs/mutation/equivalent.json"
PRELOAD = ("numpy", "torch", "PIL.Image", "pytest")  # imported once by the fork worker; never project code
PRAGMA = "pragma: no mutate"


@dataclass(frozen=True)
class Target:
    """One core module, the tests that cover it, and the functions to mutate (empty: all)."""

    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    what: str = ""
    planted: tuple[tuple[str, str], ...] = ()  # (source text, replacement): known realistic bugs, run too
    operators: tuple[str, ...] = ()  # only these operators (empty: all)


TARGETS = {
    "score": Target("evaluator/cir/score.py", ("tests/test_score_retrieval.py",),
                    ("average_precision_at_k", "recall_at_k", "reward", "check_results", "_ranking_problem",
                     "_query_metrics", "score", "score_file", "_row", "read_results", "<module>"),
                    "the CIRCO / CIRR scorer and the reward"),
    "promotion": Target("evaluator/evidence/disclosure.py", ("tests/test_promotion_rules.py",),
                        ("summary", "_device_kind", "promotion_reasons", "data_reasons", "quality_label",
                         "<module>"),
                        "the campaign statistics and promotion rules",
                        (('f.git_before.get("sha") != f.git_after.get("sha")',
                          'f.git_before.get("sha") != f.git_before.get("sha")'),
                         ("diff_keys(f.fingerprint_before, f.fingerprint_after)",
                          "diff_keys(f.fingerprint_before, f.fingerprint_before)"),
                         ("if len(backends) > 1:", "if len(backends) > 2:"))),
    "gate": Target("evaluator/evidence/workloads/eva02.py", ("tests/test_promotion_rules.py",),
                   ("threshold", "check_predictions", "gate_reason", "aggregate_reasons", "<module>"),
                   "the campaign's per-run and aggregate contest gate"),
    "agreement": Target("evaluator/contest/agreement.py", ("tests/test_agreement.py", "tests/test_agreement_rules.py"),
                        (),
                        "the contest gate and the agreement tool",
                        (("rows = res.all_rows.rows", "rows = res.all_rows.matches"),)),
    "manifest": Target("evaluator/contest/manifest.py", ("tests/test_manifest.py", "tests/test_input_rules.py"), (),
                       "the manifest reader",
                       (("blank.append(no)", "pass"),)),
    "resolve": Target("engine/io.py", ("tests/test_manifest.py", "tests/test_input_rules.py"),
                      ("read_regular", "resolve_relative", "resolve_inside"), "input path resolution"),
    "guard": Target("engine/classify/guard.py", ("tests/test_guard.py", "tests/test_margin_guard_rules.py"), (), "the margin guard and its statistics",
                    (("if self._rows:", "if len(self._rows) == self.batch:"),  # the last, partial call dropped
                     ("round(self.rechecked / self.images, 6)", "round(self.changed / self.images, 6)"))),
    "output": Target("evaluator/contest/output.py", ("tests/test_output_rules.py",), (), "the output reservation"),
}


# ---------------------------------------------------------------- mutants


@dataclass
class Mutant:
    file: str
    line: int
    function: str
    operator: str
    before: str  # the changed source segment
    after: str   # what replaces it
    start: int = field(repr=False, default=0)  # byte offsets of the segment in the file
    end: int = field(repr=False, default=0)
    status: str = ""  # killed | survived | timeout | equivalent | invalid
    reason: str = ""  # equivalent: why
    seconds: float = 0.0
    diff: str = ""

    def key(self) -> tuple:
        return (self.file, self.function, self.operator, self.before, self.after)


OPERATORS = ("compare", "operand", "boolean", "not", "arithmetic", "constant", "builtin", "argument", "slice",
             "return", "delete")
CMP_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
BIN_FLIP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}
NAME_SWAP = {"min": "max", "max": "min", "any": "all", "all": "any"}
BOOLISH = (ast.Compare, ast.BoolOp)


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _variable(node: ast.AST) -> bool:
    """An expression that is not a literal (a name, attribute, call, subscript, ...)."""
    return not isinstance(node, (ast.Constant, ast.JoinedStr, ast.List, ast.Tuple, ast.Dict, ast.Set,
                                 ast.Lambda, ast.Starred))


def _differ(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) != ast.dump(b)


def _expr(node: ast.AST) -> str:
    return f"({ast.unparse(node)})"


class _Sites(ast.NodeVisitor):
    """Collects (node, operator, replacement text, is_statement) for every mutation site."""

    def __init__(self, functions: tuple[str, ...]):
        self.functions = functions
        self.stack: list[str] = []
        self.sites: list[tuple[ast.AST, str, str, bool, str]] = []

    def _on(self) -> bool:
        name = self.stack[-1] if self.stack else "<module>"
        return not self.functions or name in self.functions

    def _add(self, node, op, text, stmt=False):
        if self._on():
            self.sites.append((node, op, text, stmt, self.stack[-1] if self.stack else "<module>"))

    def _function(self, node):
        for d in node.decorator_list:
            self.visit(d)
        self.stack.append(node.name)
        # defaults are evaluated in the enclosing scope, but mutating them belongs to the function
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and _is_str(body[0].value):
            body = body[1:]  # the docstring
        for stmt in body:
            self.visit(stmt)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self.stack.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.stack.pop()

    def visit_JoinedStr(self, node):  # f-strings: messages, not rules
        return

    def visit_AnnAssign(self, node):  # the annotation is not code that runs
        if node.value is not None:
            self.visit(node.value)

    def visit_Compare(self, node):
        for i, op in enumerate(node.ops):
            if type(op) in CMP_FLIP:
                new = copy.deepcopy(node)
                new.ops[i] = CMP_FLIP[type(op)]()
                self._add(node, "compare", _expr(new))
        left, right = node.left, node.comparators[0]
        if len(node.ops) == 1 and _variable(left) and _variable(right) and _differ(left, right):
            self._add(right, "operand", _expr(left))  # a value compared with itself
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self._add(node, "boolean", _expr(new))
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            self._add(node, "not", _expr(node.operand))
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if type(node.op) in BIN_FLIP and not (_is_str(node.left) or _is_str(node.right)):
            new = copy.deepcopy(node)
            new.op = BIN_FLIP[type(node.op)]()
            self._add(node, "arithmetic", _expr(new))
        self.generic_visit(node)

    def visit_Constant(self, node):
        v = node.value
        if isinstance(v, bool):
            self._add(node, "constant", repr(not v))
        elif isinstance(v, int):
            self._add(node, "constant", f"({v + 1})")
            if v != 0:
                self._add(node, "constant", f"({v - 1})")
        elif isinstance(v, float):
            self._add(node, "constant", "1.0" if v == 0 else "0.0" if v == 1 else f"({v * 2!r})")

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in NAME_SWAP:
            self._add(node.func, "builtin", NAME_SWAP[node.func.id])
        args = [a for a in node.args if not isinstance(a, ast.Starred)]
        typecheck = isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass")
        if len(args) >= 2 and not typecheck and _variable(args[0]) and _variable(args[1]) and _differ(args[0], args[1]):
            self._add(args[1], "argument", _expr(args[0]))  # the first argument passed twice
        if isinstance(node.func, ast.Name) and node.func.id == "range":
            for a in args[:2]:  # start and stop off by one
                if _variable(a):
                    self._add(a, "argument", f"({ast.unparse(a)} + 1)")
                    self._add(a, "argument", f"({ast.unparse(a)} - 1)")
        self.generic_visit(node)

    def visit_Slice(self, node):
        for bound in (node.lower, node.upper):
            if bound is not None and not isinstance(bound, ast.Constant):
                self._add(bound, "slice", f"({ast.unparse(bound)} + 1)")
                self._add(bound, "slice", f"({ast.unparse(bound)} - 1)")
        self.generic_visit(node)

    def visit_Return(self, node):
        v = node.value
        if v is not None and not (isinstance(v, ast.Constant) and v.value is None):
            boolish = isinstance(v, BOOLISH) or (isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not))
            self._add(v, "return", f"(not {_expr(v)})" if boolish else "None")
        self.generic_visit(node)

    def _delete(self, node):
        if self.stack:  # statements inside functions only
            self._add(node, "delete", "pass", stmt=True)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Call):
            self._delete(node)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._delete(node)
        self.generic_visit(node)

    def visit_Assign(self, node):
        if any(isinstance(t, (ast.Subscript, ast.Attribute)) for t in node.targets):
            self._delete(node)
        self.generic_visit(node)

    def visit_Raise(self, node):
        self._delete(node)
        self.generic_visit(node)

    def visit_Continue(self, node):
        self._delete(node)

    def visit_Break(self, node):
        self._delete(node)


def _offsets(data: bytes) -> list[int]:
    starts, pos = [0], 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def planted_mutants(path: Path, rel: str, planted: tuple[tuple[str, str], ...]) -> list[Mutant]:
    """The planted bugs whose source text occurs exactly once in the file; the others are
    returned with status 'stale' (the code moved on: review the entry)."""
    data = path.read_bytes()
    starts = _offsets(data)
    out = []
    for before, after in planted:
        b = before.encode()
        at = data.find(b)
        m = Mutant(rel, 0, "", "planted", before, after)
        if at < 0 or data.find(b, at + 1) >= 0:
            m.status = "stale"
            m.reason = "the text is not in the file" if at < 0 else "the text occurs more than once"
        else:
            m.start, m.end = at, at + len(b)
            m.line = next(i for i, s in enumerate(starts) if s > at)
            m.diff = _diff(data, apply(data, m), rel)
        out.append(m)
    return out


def mutants_of(path: Path, rel: str, functions: tuple[str, ...] = (),
               operators: tuple[str, ...] = ()) -> list[Mutant]:
    """Every mutant of one file (compiled to check it is valid Python; invalid ones are dropped)."""
    data = path.read_bytes()
    tree = ast.parse(data)
    lines = data.splitlines()
    starts = _offsets(data)
    sites = _Sites(functions)
    sites.visit(tree)
    out, seen = [], set()
    for node, op, text, _stmt, func in sites.sites:
        if operators and op not in operators:
            continue
        line = lines[node.lineno - 1].decode("utf-8", "replace")
        if PRAGMA in line:
            continue
        start = starts[node.lineno - 1] + node.col_offset  # col_offset counts UTF-8 bytes
        end = starts[node.end_lineno - 1] + node.end_col_offset
        before = data[start:end].decode("utf-8")
        if (start, end, text) in seen or before == text:
            continue
        seen.add((start, end, text))
        m = Mutant(rel, node.lineno, func, op, " ".join(before.split()), text, start, end)
        try:
            compile(apply(data, m), rel, "exec")
        except SyntaxError:
            continue
        m.diff = _diff(data, apply(data, m), rel)
        out.append(m)
    return out


def apply(data: bytes, m: Mutant) -> bytes:
    return data[:m.start] + m.after.encode() + data[m.end:]


def _diff(a: bytes, b: bytes, rel: str) -> str:
    lines = difflib.unified_diff(a.decode().splitlines(), b.decode().splitlines(), f"a/{rel}", f"b/{rel}",
                                 n=0, lineterm="")
    return "\n".join(list(lines)[2:])


def load_equivalent(path: Path) -> list[dict]:
    """The reviewed equivalent mutants: [{file, line, function, operator, before, after, reason}]."""
    return json.loads(path.read_text()) if path.is_file() else []


def mark_equivalent(mutants: list[Mutant], equivalent: list[dict]) -> None:
    """Match by (file, function, operator, before, after); `line` only breaks ties, since lines move."""
    for e in equivalent:
        key = (e["file"], e["function"], e["operator"], e["before"], e["after"])
        hits = [m for m in mutants if m.key() == key]
        if len(hits) > 1:
            hits = [m for m in hits if m.line == e.get("line")] or hits[:1]
        for m in hits:
            m.status, m.reason = "equivalent", e["reason"]


# ---------------------------------------------------------------- running tests


def copy_repo(dest: Path) -> None:
    """The files git tracks plus the untracked ones it does not ignore, as the repository holds them."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src, dst = REPO / name, dest / name
        if not (src.is_file() or src.is_symlink()):
            continue  # deleted in the work tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)


def _env(root: Path) -> dict:
    # the copy's packages before the installed ones; no bytecode: a same-size mutant in the same
    # second would otherwise run from a stale .pyc
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), PYTHONDONTWRITEBYTECODE="1", OMP_WAIT_POLICY="PASSIVE")


def _pytest_args(tests: list[str]) -> list[str]:
    return ["-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]


class Runner:
    """Runs the tests in the copy: one fresh interpreter per call, or (fork) a worker that
    imported PRELOAD once and forks a child per call."""

    def __init__(self, root: Path, fork: bool):
        self.root, self.fork, self.worker = root, fork, None
        self.log = root.parent / f"{root.name}.pytest.log"  # the last run's output (outside the copy)
        if fork:
            self._start()

    def _start(self) -> None:
        self.worker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                       cwd=self.root, env=_env(self.root), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self.worker.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"mutation worker did not start: {ready!r}")

    def run(self, tests: list[str], timeout: float) -> tuple[str, float]:
        """('pass' | 'fail' | 'timeout', seconds)."""
        t0 = time.perf_counter()
        if self.worker is not None:
            for _attempt in (1, 2):
                try:
                    self.worker.stdin.write(json.dumps({"tests": tests, "timeout": timeout, "log": str(self.log)})
                                            + "\n")
                    self.worker.stdin.flush()
                    outcome = self.worker.stdout.readline().strip()
                except BrokenPipeError:
                    outcome = ""
                if outcome:
                    return outcome, time.perf_counter() - t0
                # the worker itself died (not the tests): never count that as a kill
                print(f"mutate: the worker exited ({self.worker.poll()}); starting a new one", file=sys.stderr)
                self.worker.kill()
                self.worker.wait()
                self._start()
            print("mutate: the mutant kills the worker itself (a signal to the parent?): counted as killed",
                  file=sys.stderr)
            return "fail", time.perf_counter() - t0
        cmd = [sys.executable, "-m", "pytest", *_pytest_args(tests)]
        with open(self.log, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=self.root, env=_env(self.root), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", time.perf_counter() - t0
        return ("pass" if rc == 0 else "fail"), time.perf_counter() - t0

    def tail(self, lines: int = 15) -> str:
        """The end of the last run's pytest output."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        self.log.unlink(missing_ok=True)
        if self.worker is not None:
            self.worker.stdin.close()
            self.worker.wait(timeout=30)


def worker() -> int:
    """--worker: import PRELOAD, then for each request line fork a child that runs pytest."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            print(f"mutate: worker: {name} not importable; the children import what they need", file=sys.stderr)
    print("ready", flush=True)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a mutant's os.kill(parent, 1) must not end the worker
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # child: its own process group, so a timeout kills what the tests started too
            os.setsid()
            signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the tests' own processes get the default back
            log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests pipe is the worker's alone
            import pytest

            try:
                rc = pytest.main(_pytest_args(req["tests"]))
            except BaseException:  # noqa: BLE001 - any escape is a failed run
                rc = 1
            os._exit(int(rc))
        deadline = time.monotonic() + req["timeout"]
        outcome = None
        while outcome is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                outcome = "pass" if os.waitstatus_to_exitcode(status) == 0 else "fail"
            elif time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    print(f"mutate: worker: child {pid} already gone", file=sys.stderr)
                os.waitpid(pid, 0)
                outcome = "timeout"
            else:
                select.select([], [], [], 0.05)
        print(outcome, flush=True)
    return 0


# ---------------------------------------------------------------- one module


def resolve_target(name: str) -> tuple[str, Target]:
    """A TARGETS key, a dotted module or a path -> (key, Target); ValueError if unknown."""
    if name in TARGETS:
        return name, TARGETS[name]
    path = name if name.endswith(".py") else name.replace(".", "/") + ".py"
    for key, t in TARGETS.items():
        if t.path == path:
            return key, t
    if (REPO / path).is_file():
        return Path(path).stem, Target(path, ())
    raise ValueError(f"--module {name}: not a target ({', '.join(TARGETS)}), module or file")


def carry_killed(mutants: list[Mutant], previous: dict) -> int:
    """Incremental run: mutants an earlier report of this module found killed (same file, function,
    operator and text) keep that status unrun; survivors and new mutants run. Returns the count."""
    killed: dict[tuple, list[str]] = {}
    for m in previous.get("results", []):
        if m["status"] in ("killed", "timeout"):
            key = tuple(m[k] for k in ("file", "function", "operator", "before", "after"))
            why = m.get("reason", "")
            killed.setdefault(key, []).append(why if why.startswith("carried from") else
                                              f"carried from the run of {previous.get('run', 'an earlier run')}")
    carried = 0
    for m in mutants:
        if m.status == "" and killed.get(m.key()):
            m.status, m.reason = "killed", killed[m.key()].pop()
            carried += 1
    return carried


def mutate_module(key: str, target: Target, root: Path, runner: Runner, timeout: float,
                  equivalent: list[dict], log=print, previous: dict | None = None) -> dict:
    """Run every mutant of one target in the copy at root (with `previous`, the module's earlier
    report: only its survivors and new mutants); the module's report dict."""
    src = root / target.path
    original = src.read_bytes()
    mutants = mutants_of(src, target.path, target.functions, target.operators)
    mutants += planted_mutants(src, target.path, target.planted)
    mark_equivalent(mutants, equivalent)
    carried = carry_killed(mutants, previous) if previous else 0
    baseline, base_s = runner.run(list(target.tests), max(timeout, 600))
    if baseline != "pass":
        log(f"mutate: {key}: the tests fail on the unmutated code ({baseline}):\n{runner.tail()}")
        return {"key": key, "file": target.path, "error": f"the tests fail on the unmutated code ({baseline})",
                "tests": list(target.tests), "output": runner.tail()}
    limit = max(timeout, 3 * base_s + 10)
    log(f"mutate: {key}: {len(mutants)} mutants of {target.path} ({carried} killed before, not rerun), tests "
        f"{' '.join(target.tests)} (baseline {base_s:.1f} s, per-mutant timeout {limit:.0f} s)")
    t0 = time.perf_counter()
    try:
        for i, m in enumerate(mutants, 1):
            if m.status in ("equivalent", "stale", "killed"):
                continue
            src.write_bytes(apply(original, m))
            outcome, m.seconds = runner.run(list(target.tests), limit)
            m.status = {"pass": "survived", "fail": "killed", "timeout": "timeout"}[outcome]
            if i % 20 == 0:
                log(f"mutate: {key}: {i}/{len(mutants)} run, {time.perf_counter() - t0:.0f} s")
            if m.status == "survived":
                log(f"mutate: {key}: [{i}/{len(mutants)}] SURVIVED {m.file}:{m.line} {m.operator}: "
                    f"{m.before} -> {m.after}")
    finally:
        src.write_bytes(original)
    prev = previous or {}
    counts = {s: sum(m.status == s for m in mutants) for s in ("killed", "timeout", "survived", "equivalent",
                                                                "stale")}
    scored = counts["killed"] + counts["timeout"] + counts["survived"]
    return {"key": key, "file": target.path, "what": target.what, "tests": list(target.tests),
            "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "functions": list(target.functions), "mutants": len(mutants), **counts, "carried": carried,
            # the module's last full run (an incremental run keeps its date and time)
            "full_run": prev.get("full_run") or prev.get("run"), "full_seconds": prev.get("full_seconds") or
            prev.get("seconds"),
            "score": (counts["killed"] + counts["timeout"]) / scored if scored else None,
            "seconds": round(time.perf_counter() - t0 + base_s, 1), "baseline_s": round(base_s, 1),
            "results": [{k: v for k, v in asdict(m).items() if k not in ("start", "end")} for m in mutants]}


# ---------------------------------------------------------------- report


def markdown(report: dict) -> str:
    rows = ["| module | what | tests run | mutants | killed | survived | equivalent | score | full run | last run |",
            "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in report["modules"]:
        tests = ", ".join(f"`{Path(t).name}`" for t in r.get("tests", []))
        if "error" in r:
            rows.append(f"| `{r['file']}` | {r.get('what', '')} | {tests} | error: {r['error']} | | | | | | |")
            continue
        score = f"{100 * r['score']:.1f} %" if r["score"] is not None else "n/a"
        killed = f"{r['killed'] + r['timeout']}" + (f" ({r['carried']} carried)" if r.get("carried") else "")
        full = (f"{r['full_run']} ({r['full_seconds']:.0f} s)" if r.get("full_seconds") else
                f"{r.get('run', '')} ({r['seconds']:.0f} s)")
        rows.append(f"| `{r['file']}` | {r['what']} | {tests} | {r['mutants']} | {killed} | "
                    f"{r['survived']} | {r['equivalent']} | {score} | {full} | {r.get('run', '')} ({r['seconds']:.0f} s) |")
    out = ["# Mutation report", "", f"Command: `{report['command']}`", "",
           "Score = killed / (mutants - equivalent - stale planted); a timed-out mutant counts as killed; "
           "`carried`: killed in an earlier run of the module and not rerun (`--survivors`).", "", *rows, ""]
    for r in report["modules"]:
        planted = [m for m in r.get("results", []) if m["operator"] == "planted"]
        if planted:
            out += [f"Planted bugs in `{r['file']}`:", ""]
            out += [f"- {m['status']}: `{m['before']}` -> `{m['after']}`" + (f" ({m['reason']})" if m["reason"] else "")
                    for m in planted]
            out.append("")
    for r in report["modules"]:
        survivors = [m for m in r.get("results", []) if m["status"] == "survived"]
        if survivors:
            out += [f"## Survivors in `{r['file']}`", ""]
            for m in survivors:
                out += [f"- line {m['line']} in `{m['function']}`, {m['operator']}:", "", "```diff", m["diff"],
                        "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))   # engine.cli, from this tree
    from engine.cli import MAX_DEADLINE_S, HelpFormatter, finite_float

    parser = argparse.ArgumentParser(prog="scripts/mutate.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--module", action="append", help="a TARGETS key, dotted module or path (repeatable); "
                        "default: every target")
    parser.add_argument("--tests", nargs="+", help="test files to run instead of the mapped ones (default: the mapped ones)")
    parser.add_argument("--functions", nargs="+", help="mutate only these functions ('<module>': top level) (default: every function)")
    parser.add_argument("--operators", nargs="+", choices=OPERATORS, help="only these operators (default: every operator)")
    parser.add_argument("--out", type=Path, default=None, help="write mutation.json and mutation.md here (default: not written)")
    parser.add_argument("--timeout", type=finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True), default=60.0,
                        help="per-mutant limit in seconds (at least 3x the unmutated run + 10 s)")
    parser.add_argument("--equivalent", type=Path, default=REPO / EQUIVALENT_FILE, help="reviewed equivalent mutants")
    parser.add_argument("--min-score", type=finite_float(0.0, 1.0), default=0.9, help="exit 1 when a module scores below this")
    parser.add_argument("--survivors", action="store_true",
                        help="incremental: with --out, rerun only the mutants OUT/mutation.json did not record as "
                             "killed (survivors, new code); the killed ones are carried")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit without running tests")
    parser.add_argument("--no-fork", action="store_true", help="a fresh interpreter per mutant")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    try:
        chosen = [resolve_target(m) for m in (args.module or list(TARGETS))]
        equivalent = load_equivalent(args.equivalent)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    chosen = [(k, Target(t.path, tuple(args.tests or t.tests), tuple(args.functions or t.functions), t.what,
                         t.planted, tuple(args.operators or t.operators))) for k, t in chosen]
    for key, t in chosen:
        if not (REPO / t.path).is_file():
            parser.error(f"--module {key}: {t.path} does not exist")
        if not t.tests:
            parser.error(f"--module {key}: no tests mapped; name them with --tests")
    if args.list:
        for key, t in chosen:
            for m in mutants_of(REPO / t.path, t.path, t.functions, t.operators):
                print(f"{key}\t{m.file}:{m.line}\t{m.function}\t{m.operator}\t{m.before} -> {m.after}")
        return 0
    report = {"command": " ".join(["python scripts/mutate.py", *(argv if argv is not None else sys.argv[1:])]),
              "modules": []}
    previous = {}
    if args.survivors:
        if args.out is None or not (args.out / "mutation.json").is_file():
            parser.error("--survivors needs --out DIR holding an earlier mutation.json")
        previous = {r["key"]: r for r in json.loads((args.out / "mutation.json").read_text())["modules"]}
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        runner = Runner(root, fork=not args.no_fork and hasattr(os, "fork"))
        try:
            for key, t in chosen:
                report["modules"].append(mutate_module(key, t, root, runner, args.timeout, equivalent,
                                                       log=lambda s: print(s, file=sys.stderr, flush=True),
                                                       previous=previous.get(key)))
        finally:
            runner.close()
    text = markdown(report)
    print(text)
    if args.out is not None:  # modules run before and not rerun now stay in the report
        args.out.mkdir(parents=True, exist_ok=True)
        old = args.out / "mutation.json"
        if old.is_file():
            rerun = {r["key"] for r in report["modules"]}
            kept = [r for r in json.loads(old.read_text())["modules"] if r["key"] not in rerun]
            report["modules"] = kept + report["modules"]
            report["command"] = "python scripts/mutate.py (modules merged from several runs; see each module)"
        text = markdown(report)
        (args.out / "mutation.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "mutation.md").write_text(text + "\n")
    low = [r["key"] for r in report["modules"] if "error" in r or (r["score"] is not None
                                                                   and r["score"] < args.min_score)]
    if low:
        print(f"mutate: below {args.min_score:.0%} or failing: {', '.join(low)}", file=sys.stderr)
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
