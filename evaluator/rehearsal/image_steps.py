"""The image rehearsal's steps: the Dockerfile parsed (its instructions, ENV, locks, import line) and
each check as a `Step` (venv, locks, pip check, imports, the CUDA header compile), shared by the
x86_64 venv rehearsal and the emulated arm64 one (`python -m evaluator.rehearsal.image`: image.py)."""
from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
# what the generated CUDA wrapper includes (aoti_include/cuda.h pulls utils_cuda.h) and
# the half/bfloat16 headers generated kernels and c10 include
CUDA_HEADERS = ("torch/csrc/inductor/aoti_include/cuda.h", "torch/csrc/inductor/aoti_runtime/utils_cuda.h",
                "cuda_fp16.h", "cuda_bf16.h")
# pip's answer when no index here has the pin, or PyPI's placeholder sdist that only fetches the
# real wheel from NVIDIA's index (tensorrt-cu13-libs) and fails to build without it
NOT_SERVED = re.compile(r"No matching distribution found|Could not find a version that satisfies|pypi\.nvidia\.com")
DOCKER_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
ARCHES = ("x86_64", "aarch64")        # --arch: the default first


@dataclass
class Step:
    name: str
    ok: bool
    detail: str
    seconds: float | None = None    # wall time, where the step was timed (the emulated rehearsal's)

    def line(self) -> str:
        took = f" [{self.seconds:.1f} s]" if self.seconds is not None else ""
        return f"{'ok' if self.ok else 'FAILED':<7} {self.name}: {self.detail}{took}"


# ---- the Dockerfile, parsed --------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuations joined, comment lines dropped (also
    inside a continuation, as Docker reads them)."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") or (not s and not cur):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        kw, _, rest = (cur + s).partition(" ")
        out.append((kw.upper(), rest.strip()))
        cur = ""
    if cur:
        raise ValueError("the Dockerfile ends inside a line continuation")
    return out


SUBST = re.compile(r"\$(?:\{(?P<braced>\w+)(?:(?P<op>:[-+])(?P<word>[^}]*))?\}|(?P<bare>\w+))")


def expand(value: str, env: dict[str, str]) -> str:
    """Docker's substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alternative}; unset is empty."""
    def one(m: re.Match) -> str:
        val = env.get(m["braced"] or m["bare"], "")
        if m["op"] == ":-":
            return val or m["word"]
        if m["op"] == ":+":
            return m["word"] if val else ""
        return val
    return SUBST.sub(one, value)


def dockerfile_env(instrs: list[tuple[str, str]], args: dict[str, str] | None = None) -> dict[str, str]:
    """The ENV the image ends with: `ENV k=v k2="v 2"` and the legacy `ENV k v`, each value
    expanded against the ARGs given and the ENV set before it (as Docker does)."""
    env: dict[str, str] = {}
    scope = dict(args or {})
    for kw, rest in instrs:
        if kw == "ARG":
            name, _, default = shlex.split(rest)[0].partition("=")    # ARG NAME[=default]
            scope.setdefault(name, default)
        if kw != "ENV":
            continue
        tokens = shlex.split(rest, posix=True)
        pairs = ([t.partition("=")[::2] for t in tokens] if "=" in tokens[0]
                 else [(tokens[0], rest.partition(tokens[0])[2].strip())])
        for k, v in pairs:
            env[k] = expand(v, {**scope, **env})
    return env


def image_site_packages(instrs: list[tuple[str, str]]) -> str:
    """The official Python image's site-packages, for the Python version FROM names."""
    base = next(rest for kw, rest in instrs if kw == "FROM")
    m = re.search(r"python:(\d+\.\d+)", base)
    if not m:
        raise ValueError(f"FROM {base}: not an official python:X.Y image, its site-packages is unknown")
    return f"/usr/local/lib/python{m.group(1)}/site-packages"


def mapped_env(instrs, site_packages: str) -> dict[str, str]:
    """The Dockerfile's ENV with the image's site-packages prefix replaced by `site_packages`."""
    image_sp = image_site_packages(instrs)
    return {k: v.replace(image_sp, site_packages) for k, v in dockerfile_env(instrs).items()}


def run_commands(run: str) -> list[tuple[list[str], str]]:
    """The simple commands of a RUN line with the operator that follows each (&&, ||, ...)."""
    lex = shlex.shlex(run, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out: list[tuple[list[str], str]] = [([], "")]
    for tok in lex:
        if tok in ("&&", "||", ";", "|"):
            out[-1] = (out[-1][0], tok)
            out.append(([], ""))
        elif tok not in ("(", ")"):
            out[-1][0].append(tok)
    return [c for c in out if c[0]]


@dataclass
class ImportCheck:
    code: str                 # the python -c program
    fallback: str | None      # the `|| echo` message: this import may fail at image build


def import_checks(instrs) -> list[ImportCheck]:
    """The `python -c "import ..."` programs of the Dockerfile's RUN lines, in order."""
    out = []
    for kw, rest in instrs:
        if kw != "RUN":
            continue
        cmds = run_commands(rest)
        for i, (cmd, op) in enumerate(cmds):
            if cmd[:2] == ["python", "-c"] and len(cmd) > 2 and cmd[2].lstrip().startswith("import "):
                nxt = cmds[i + 1][0] if i + 1 < len(cmds) else []
                fallback = " ".join(nxt[1:]) if op == "||" and nxt[:1] == ["echo"] else None
                out.append(ImportCheck(cmd[2], fallback))
    return out


def pip_locks(instrs) -> list[str]:
    """The lock files (repository-relative) the Dockerfile's pip installs read, in order."""
    out = []
    for kw, rest in instrs:
        if kw == "RUN":
            for cmd, _ in run_commands(rest):
                out += [cmd[i + 1].removeprefix("/submission/") for i, t in enumerate(cmd[:-1]) if t == "-r"]
    return out


# ---- the steps ---------------------------------------------------------------------------------

def missing_header(stderr: str) -> str | None:
    """The compiler's missing-header line ("FILE:LINE:COL: fatal error: X: No such file ..."), if any."""
    for line in stderr.splitlines():
        if "fatal error:" in line and "No such file" in line:
            return line.strip()
    return None


def compile_headers(site_packages: str, cuda_home: str, headers=CUDA_HEADERS, cxx: str = "g++") -> Step:
    """Compile (syntax only) each header as the AOTInductor CUDA wrapper does: torch's include
    dirs from `site_packages`, $CUDA_HOME/include, -DUSE_CUDA, Inductor's C++ standard."""
    torch_inc = Path(site_packages) / "torch" / "include"
    flags = ["-std=c++20", "-fsyntax-only", "-DUSE_CUDA", f"-I{torch_inc}",
             f"-I{torch_inc / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{Path(cuda_home) / 'include'}"]
    if not (Path(cuda_home) / "include").is_dir():
        return Step("headers", False, f"CUDA_HOME={cuda_home} has no include/ folder")
    if shutil.which(cxx) is None:
        return Step("headers", False, f"no {cxx} on PATH (the image installs it with apt-get)")
    for header in headers:
        # one translation unit per header: a failure names the header that pulls the missing one
        r = subprocess.run([cxx, *flags, "-x", "c++", "-"], input=f"#include <{header}>\n",
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            why = missing_header(r.stderr) or (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            return Step("headers", False, f"<{header}>: {why}")
    return Step("headers", True, f"{len(headers)} headers compile against CUDA_HOME={cuda_home} "
                                 f"({', '.join(Path(h).name for h in headers)})")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_site_packages(venv: Path) -> str:
    r = subprocess.run([str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def make_venv(venv: Path, python_version: str) -> Step:
    """A fresh venv of the image's Python (pythonX.Y on PATH, or this one when it is that version)."""
    exe = sys.executable if sysconfig.get_python_version() == python_version else f"python{python_version}"
    r = subprocess.run([exe, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True)
    if r.returncode != 0:
        return Step("venv", False, f"{exe} -m venv {venv}: {(r.stderr.strip() or r.stdout.strip())[-300:]}")
    return Step("venv", True, f"{venv} (python {python_version})")


def lock_pins(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def install_locks(venv: Path, locks: list[str], log=print) -> tuple[Step, list[str]]:
    """pip install --no-deps each lock; a lock that fails as a whole is installed pin by pin, and
    a pin no configured index serves is named and skipped (one line each). Returns the skipped."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-q"]
    skipped, count = [], 0
    for lock in locks:
        pins = lock_pins(REPO / lock)
        count += len(pins)
        if subprocess.run([*pip, "-r", str(REPO / lock)], capture_output=True, text=True).returncode == 0:
            continue
        for pin in pins:
            r = subprocess.run([*pip, pin], capture_output=True, text=True)
            if r.returncode == 0:
                continue
            if not NOT_SERVED.search(r.stderr):
                return Step("locks", False, f"{lock}: {pin}: {pip_error(r.stderr)}"), skipped
            name = re.split(r"[=;<> ]", pin)[0]
            skipped.append(name)
            log(f"skipped {name} ({lock}): {pin.split(';')[0]} is not installable from the indexes configured here (the image gets it "
                f"from NVIDIA's index)")
    return Step("locks", True, f"{count - len(skipped)} of {count} pins of {', '.join(locks)} installed --no-deps"
                + (f", {len(skipped)} skipped" if skipped else "")), skipped


def pip_error(stderr: str) -> str:
    """The line of pip's output that says what went wrong (its ERROR line, else its last line)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("ERROR:") or ln.startswith("error:")), lines[-1] if lines else "")


def pip_check(venv: Path, skipped: list[str]) -> Step:
    """`pip check`, less the 'X requires Y, which is not installed' lines of skipped pins."""
    r = subprocess.run([str(venv_python(venv)), "-m", "pip", "check"], capture_output=True, text=True)
    return pip_check_step(r.stdout, skipped)


def pip_check_step(stdout: str, skipped: list[str]) -> Step:
    """The pip-check step of `pip check`'s output, less the lines only the skipped pins explain."""
    norm = lambda s: re.sub(r"[-_.]+", "-", s.lower())  # noqa: E731
    gone = {norm(s) for s in skipped}
    lines = [ln for ln in stdout.splitlines() if ln.strip() and "No broken requirements" not in ln]
    rest = [ln for ln in lines
            if not (m := re.search(r"requires ([\w.\-]+), which is not installed", ln)) or norm(m[1]) not in gone]
    if rest:
        return Step("pip-check", False, "; ".join(rest[:5]) + (f" (+{len(rest) - 5} more)" if len(rest) > 5 else ""))
    return Step("pip-check", True, "no broken requirements" + (
        f" (besides {len(lines)} on the skipped pins)" if lines else ""))


def raised(stderr: str) -> str:
    """The exception line of a Python traceback ("XError: ..."), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", ln)]
    return (errors or lines or ["(no output)"])[-1]


def run_imports(venv: Path, checks: list[ImportCheck], env: dict[str, str], args: dict[str, str]) -> list[Step]:
    """Each import program of the Dockerfile in the venv, with the image's ENV; a program with a
    `|| echo` fallback that fails is reported with that message, as the image build does."""
    steps = []
    for i, check in enumerate(checks):
        code = expand(check.code, args)       # the shell expands ${TARGETARCH} inside the double quotes
        r = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=600)
        steps.append(import_step(f"imports[{i}]", check, r))
    return steps


def import_step(name: str, check: ImportCheck, r: subprocess.CompletedProcess) -> Step:
    """The step of one import program's finished process (its `|| echo` fallback honoured)."""
    if r.returncode == 0:
        return Step(name, True, r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "imported")
    if check.fallback is not None:
        return Step(name, True, f"{check.fallback} [{raised(r.stderr)[:200]}]")
    return Step(name, False, raised(r.stderr))


# ---- the rehearsal -----------------------------------------------------------------------------

def quick_env(dockerfile: Path, site_packages: str) -> dict[str, str]:
    return mapped_env(instructions(dockerfile.read_text()), site_packages)


def quick(dockerfile: Path = DOCKERFILE, site_packages: str | None = None) -> Step:
    """The header compile against an installed environment (default: this Python's site-packages),
    CUDA_HOME's layout read from the Dockerfile's ENV."""
    sp = site_packages or sysconfig.get_paths()["purelib"]
    env = quick_env(dockerfile, sp)
    if "CUDA_HOME" not in env:
        return Step("headers", False, f"{dockerfile} sets no CUDA_HOME")
    return compile_headers(sp, env["CUDA_HOME"])


def full(venv: Path, dockerfile: Path = DOCKERFILE, codegen: bool = False, reuse: bool = False,
         log=print) -> list[Step]:
    """Every step: venv, locks, pip check, ENV, imports, headers (and codegen when asked)."""
    instrs = instructions(dockerfile.read_text())
    version = re.search(r"python(\d+\.\d+)", image_site_packages(instrs))[1]
    steps = []
    if not (reuse and venv_python(venv).exists()):
        steps.append(make_venv(venv, version))
        log(steps[-1].line())
        if not steps[-1].ok:
            return steps
    installed, skipped = install_locks(venv, pip_locks(instrs), log)
    steps.append(installed)
    log(installed.line())
    if not installed.ok:
        return steps
    sp = venv_site_packages(venv)
    env = mapped_env(instrs, sp)
    args = {"TARGETARCH": DOCKER_ARCH.get(platform.machine(), platform.machine())}
    for step in (pip_check(venv, skipped),
                 Step("env", "CUDA_HOME" in env, f"{len(env)} variables, the image's {image_site_packages(instrs)} "
                                                 f"mapped to {sp}: CUDA_HOME={env.get('CUDA_HOME', '(unset)')}"),
                 *run_imports(venv, import_checks(instrs), env, args),
                 compile_headers(sp, env.get("CUDA_HOME", ""))):
        steps.append(step)
        log(step.line())
    if codegen:
        from evaluator.rehearsal import image_codegen
        steps.append(Step("codegen", *image_codegen.run_in(venv_python(venv), env)))
        log(steps[-1].line())
    return steps
