"""The contest image rehearsed on ARM64 under emulation: `python -m evaluator.rehearsal.image --arch aarch64`.

The scored machine is ARM64; this runs what the Dockerfile assembles on an arm64 Debian bookworm
root executed by qemu-user through binfmt_misc, on any Linux machine (root needed: debootstrap,
chroot, mounts). Steps, each timed, one line each:
  host     debootstrap, qemu-aarch64-static, root, and binfmt_misc with an aarch64 entry (mounted and
           registered here when missing); a missing piece is one line naming it;
  root     `debootstrap --foreign --arch arm64` of bookworm with Python 3.11, pip, venv and g++ from
           Debian's packages, then its second stage run under emulation (cached: a rerun reuses it);
  wheels   every pin of the Dockerfile's locks whose markers hold on linux aarch64, downloaded on the
           host: `pip download --platform manylinux..._aarch64 --python-version 3.11 --only-binary=:all:
           --no-deps` (cached); a pin with no aarch64 wheel is fetched as its sdist (the image builds
           it there); a pin no index here serves is named and skipped;
  install  a venv in the root and every downloaded pin installed `--no-deps` inside it, under emulation;
  pip-check, imports[i], headers
           as in the x86_64 rehearsal, inside the root: `pip check`, the Dockerfile's import lines with
           its ENV, and the AOTInductor CUDA wrapper's headers compiled by the arm64 g++
           (`python -m evaluator.rehearsal.image --quick` of the copy of this repository in the root);
  checkpoint, build, run
           the tiny EVA-02 checkpoint fitted, `python -m engine.build` (eager, FP32, CPU) and
           `scripts/run` end to end on generated images, all inside the root;
  agree    the same artifact and images run by this host's scripts/run: the emulated ARM64 answers
           must equal the host's.

Everything it keeps lives in one folder of the user's cache (`--cache`), marked as this kit's.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from evaluator.rehearsal.image import (
    DOCKER_ARCH,
    NOT_SERVED,
    REPO,
    Step,
    expand,
    image_site_packages,
    import_checks,
    import_step,
    instructions,
    mapped_env,
    pip_check_step,
    pip_error,
    pip_locks,
)

ARCH = "aarch64"
DEBIAN_ARCH = "arm64"
SUITE = "bookworm"                       # the base image's Debian (FROM python:3.11-slim-bookworm)
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "python3-pip", "g++")
GLIBC = (2, 36)                          # bookworm's: the newest manylinux tag its wheels may carry
PYTHON = "3.11"
KIND = "arm64-rehearsal"                 # the cache folder's mark (engine.io.mark_owned)
QEMU = "qemu-aarch64-static"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
# inside the root: where the venv, the wheels, the repository copy and the work go
VENV, WHEELS, SUBMISSION, WORK = "/opt/venv", "/var/cache/wheels", "/submission", "/tmp/rehearsal"
TINY_COUNT = 8                           # generated images scripts/run classifies
STEP_TIMEOUT_S = 3 * 3600                # emulated pip and torch are slow, never unbounded
BASE_ENV = {"PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8", "OMP_WAIT_POLICY": "PASSIVE"}


class Refused(RuntimeError):
    """The host cannot run the rehearsal (a tool, root, binfmt_misc): one line says what."""


# ---- the plan (pure) ---------------------------------------------------------------------------

def marker_environment(arch: str = ARCH) -> dict[str, str]:
    """The marker environment of the image's Python (CPython 3.11) on linux `arch`."""
    return {"implementation_name": "cpython", "implementation_version": PYTHON + ".0", "os_name": "posix",
            "platform_machine": arch, "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": PYTHON + ".0",
            "python_version": PYTHON, "sys_platform": "linux", "extra": ""}


def arch_pins(locks: dict[str, str], arch: str = ARCH) -> list[tuple[str, str]]:
    """(lock, `name[extras]==version`) of every pin `pip install -r lock` installs on linux `arch`,
    in the locks' order: each pin's marker evaluated for that architecture, not this machine's."""
    env = marker_environment(arch)
    out = []
    for lock, text in locks.items():
        for line in lock_pins_text(text):
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                out.append((lock, f"{req.name}{extras}{req.specifier}"))
    return out


def lock_pins_text(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def platform_tags(arch: str = ARCH, glibc: tuple[int, int] = GLIBC) -> list[str]:
    """The wheel platforms a bookworm `arch` machine installs: manylinux2014 and manylinux_2_17..2_36."""
    return [f"manylinux2014_{arch}"] + [f"manylinux_{glibc[0]}_{m}_{arch}" for m in range(17, glibc[1] + 1)]


def download_command(pins: list[str], dest: Path, arch: str = ARCH, python: str = sys.executable) -> list[str]:
    """The host's `pip download` of `pins`' wheels for linux `arch`, CPython 3.11, no dependencies."""
    plat = [a for t in platform_tags(arch) for a in ("--platform", t)]
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
            "--implementation", "cp", *plat, "-d", str(dest), *pins]


def sdist_command(pin: str, dest: Path, python: str = sys.executable) -> list[str]:
    """The host's `pip download` of `pin`'s source distribution (a pin with no wheel for the platform)."""
    return [python, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", str(dest), pin]


def debootstrap_commands(root: Path) -> list[list[str]]:
    """Debian's arm64 root in two stages: unpacked here (--foreign), configured under emulation."""
    return [["debootstrap", "--foreign", f"--arch={DEBIAN_ARCH}", "--variant=minbase",
             f"--include={','.join(PACKAGES)}", SUITE, str(root), MIRROR],
            ["chroot", str(root), "/debootstrap/debootstrap", "--second-stage"]]


def in_root(root: Path, argv: list[str], env: dict[str, str] | None = None, cwd: str = "/") -> list[str]:
    """`argv` run inside `root` (chroot) with exactly BASE_ENV + `env`, from `cwd`."""
    pairs = [f"{k}={v}" for k, v in {**BASE_ENV, **(env or {})}.items()]
    return ["chroot", str(root), "/usr/bin/env", "-i", *pairs, "/bin/sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]


def install_commands(served: list[str], sdists: list[str]) -> list[list[str]]:
    """Inside the root: the venv, then the wheels `--no-deps` from the local folder only, then each sdist
    (built there, as the image build does; its build requirements come from the index)."""
    pip = [f"{VENV}/bin/python", "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--disable-pip-version-check"]
    cmds = [["python3", "-m", "venv", "--clear", VENV]]
    if served:
        cmds.append([*pip, "--no-index", "--find-links", WHEELS, *served])
    cmds += [[*pip, "--find-links", WHEELS, pin] for pin in sdists]
    return cmds


def cache_dir(base: Path) -> Path:
    return base / "eva-engine" / KIND


# ---- the host ----------------------------------------------------------------------------------

def host_refusal(which=None, euid: int | None = None, machine: str | None = None) -> str | None:
    """Why this machine cannot build and enter an emulated arm64 root (one line), or None."""
    which = which or shutil.which       # looked up at call time
    machine = machine or platform.machine()
    euid = os.geteuid() if euid is None else euid
    if platform.system() != "Linux":
        return f"an emulated arm64 root needs Linux (binfmt_misc, chroot), not {platform.system()}"
    missing = [f"{tool} ({pkg})" for tool, pkg in (("debootstrap", "debootstrap"), ("chroot", "coreutils"),
                                                   ("mount", "mount"))
               if which(tool) is None]
    if machine not in ("aarch64", "arm64") and which(QEMU) is None:
        missing.append(f"{QEMU} (qemu-user-static)")
    if missing:
        return f"missing on this machine: {', '.join(missing)}; apt-get install them"
    if euid != 0:
        return "debootstrap, chroot and mount need root: run it as root (or in a root container)"
    return None


def ensure_binfmt(machine: str | None = None, binfmt: Path = BINFMT, run=subprocess.run) -> str | None:
    """binfmt_misc mounted and an aarch64 entry enabled (mounted and registered when missing); None when
    it is, else the one line that says what is missing. An arm64 host runs the root natively."""
    if (machine or platform.machine()) in ("aarch64", "arm64"):
        return None
    if not (binfmt / "register").exists():
        r = run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)], capture_output=True, text=True)
        if r.returncode != 0:
            return f"binfmt_misc is not mounted at {binfmt} and mounting it failed: {r.stderr.strip()[:200]}"
    if not _aarch64_entry(binfmt):
        if shutil.which("update-binfmts") is None:
            return f"no aarch64 entry in {binfmt} and no update-binfmts to register one (apt-get install binfmt-support)"
        r = run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True, text=True)
        if r.returncode != 0 or not _aarch64_entry(binfmt):
            return f"no aarch64 entry in {binfmt}: update-binfmts --enable qemu-aarch64 said " \
                   f"{(r.stderr or r.stdout).strip()[:200] or 'nothing'}"
    return None


def _aarch64_entry(binfmt: Path) -> bool:
    """An enabled binfmt_misc entry for aarch64 ELF (machine 0xb7) with the fix-binary flag, so a chroot
    without the interpreter inside still runs."""
    for entry in binfmt.glob("*"):
        try:
            text = entry.read_text()
        except OSError:
            continue
        if text.startswith("enabled") and "0200b700" in text.replace(" ", "") and re.search(r"flags:.*F", text):
            return True
    return False


# ---- running -----------------------------------------------------------------------------------

@dataclass
class Ctx:
    cache: Path
    log: object

    @property
    def root(self) -> Path:
        return self.cache / "root"

    @property
    def wheels(self) -> Path:
        return self.cache / "wheels"


def timed(fn):
    """Run `fn()` -> Step and fill in its wall seconds."""
    t = time.monotonic()
    step = fn()
    step.seconds = round(time.monotonic() - t, 1)
    return step


def sh(cmd: list[str], timeout: float = STEP_TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def tail(r: subprocess.CompletedProcess, n: int = 300) -> str:
    text = (r.stderr.strip() or r.stdout.strip())
    return (text.splitlines() or ["(no output)"])[-1][:n]


def build_root(ctx: Ctx) -> Step:
    """The arm64 root, reused when a complete one is cached (root.json written after stage two)."""
    done = ctx.cache / "root.json"
    want = {"suite": SUITE, "arch": DEBIAN_ARCH, "packages": list(PACKAGES), "mirror": MIRROR}
    if done.is_file() and json.loads(done.read_text()).get("recipe") == want and (ctx.root / "usr/bin/g++").exists():
        return Step("root", True, f"cached {SUITE} {DEBIAN_ARCH} root at {ctx.root} "
                                  f"({json.loads(done.read_text()).get('python', '?')})")
    if ctx.root.exists():
        if mounts_under(ctx.root):
            return Step("root", False, f"{ctx.root} is incomplete and has mounts under it: unmount them first")
        shutil.rmtree(ctx.root)
    for i, cmd in enumerate(debootstrap_commands(ctx.root)):
        r = sh(cmd)
        if r.returncode != 0:
            log = ctx.root / "debootstrap" / "debootstrap.log"
            why = log.read_text().strip().splitlines()[-1] if log.is_file() else tail(r)
            return Step("root", False, f"debootstrap stage {i + 1}: {why}")
    r = sh(in_root(ctx.root, ["python3", "-c", "import sys, platform; print(platform.machine(), sys.version.split()[0])"]))
    if r.returncode != 0:
        return Step("root", False, f"python3 in the root: {tail(r)}")
    done.write_text(json.dumps({"recipe": want, "python": r.stdout.strip()}) + "\n")
    return Step("root", True, f"{SUITE} {DEBIAN_ARCH} root from {MIRROR} with {', '.join(PACKAGES)} "
                              f"({r.stdout.strip()}) at {ctx.root}")


def mounts_under(path: Path) -> list[str]:
    real = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    points = [ln.split()[1].replace("\\040", " ") for ln in lines if len(ln.split()) > 1]
    return [p for p in points if p == real or p.startswith(real + "/")]


def fetch_wheels(ctx: Ctx, pins: list[tuple[str, str]]) -> tuple[Step, list[str], list[str], list[str]]:
    """Download every pin for aarch64 (one pip call per lock; pin by pin when a lock fails as a whole).
    Returns (step, pins with a wheel, pins fetched as sdists, skipped pin names)."""
    ctx.wheels.mkdir(parents=True, exist_ok=True)
    served, sdists, skipped = [], [], []
    for lock in dict.fromkeys(lock for lock, _ in pins):
        group = [p for lk, p in pins if lk == lock]
        if sh(download_command(group, ctx.wheels)).returncode == 0:
            served += group
            continue
        for pin in group:
            r = sh(download_command([pin], ctx.wheels))
            if r.returncode == 0:
                served.append(pin)
                continue
            if not NOT_SERVED.search(r.stderr):
                return Step("wheels", False, f"{lock}: {pin}: {pip_error(r.stderr)}"), served, sdists, skipped
            s = sh(sdist_command(pin, ctx.wheels))
            if s.returncode == 0:
                sdists.append(pin)
                ctx.log(f"         {pin}: no aarch64 wheel; its sdist is built inside the root, as the image build does")
            else:
                skipped.append(re.split(r"[=\[]", pin)[0])
                ctx.log(f"         skipped {pin} ({lock}): neither an aarch64 wheel nor an sdist on the indexes "
                        f"configured here ({pip_error(s.stderr)[:160]})")
    size = sum(f.stat().st_size for f in ctx.wheels.iterdir() if f.is_file()) / 1e9
    return (Step("wheels", True, f"{len(served)} aarch64 wheels + {len(sdists)} sdists of {len(pins)} pins "
                                 f"({', '.join(dict.fromkeys(lk for lk, _ in pins))}) in {ctx.wheels}, {size:.1f} GB"
                 + (f"; skipped: {', '.join(skipped)}" if skipped else "")),
            served, sdists, skipped)


class Mounted:
    """/proc, /dev, /sys and the wheel folder mounted into the root for the steps inside it; unmounted
    (lazily, in reverse) however the steps end."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.points = ctx, []

    def __enter__(self) -> Mounted:
        root = self.ctx.root
        for src, dst, opts in (("proc", "proc", ["-t", "proc"]), ("/dev", "dev", ["--rbind"]),
                               ("/sys", "sys", ["--rbind"]), (str(self.ctx.wheels), WHEELS.lstrip("/"), ["--bind"])):
            target = root / dst
            target.mkdir(parents=True, exist_ok=True)
            if str(target) in mounts_under(target):
                continue
            r = sh(["mount", *opts, src, str(target)])
            if r.returncode != 0:
                self.__exit__()
                raise Refused(f"mount {src} on {target}: {tail(r)}")
            self.points.append(target)
        return self

    def __exit__(self, *exc) -> None:
        for target in reversed(self.points):
            sh(["umount", "-l", str(target)])
        self.points = []


def copy_repo(root: Path) -> int:
    """This checkout's files (tracked and untracked, not ignored: what COPY . lets through, roughly) into
    root/submission, replacing an older copy. Returns the file count."""
    dest = root / SUBMISSION.lstrip("/")
    if dest.exists():
        shutil.rmtree(dest)
    files = sh(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "-z"]).stdout
    names = [n for n in files.split("\0") if n and (REPO / n).is_file()]
    for n in names:
        (dest / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / n, dest / n)
    return len(names)


def inside(ctx: Ctx, name: str, argv: list[str], env: dict[str, str] | None = None, ok_detail=None,
           cwd: str = SUBMISSION) -> Step:
    """One command inside the root as a step: ok when it exits 0 (detail: `ok_detail(stdout)` or its last line)."""
    r = sh(in_root(ctx.root, argv, env, cwd))
    if r.returncode != 0:
        return Step(name, False, f"exit {r.returncode}: {tail(r)}")
    out = r.stdout.strip()
    return Step(name, True, ok_detail(out) if ok_detail else (out.splitlines() or ["ok"])[-1][:300])


def rehearse(cache: Path, dockerfile: Path, log=print) -> list[Step]:
    """Every step, in order; stops at the first failure a later step depends on."""
    ctx = Ctx(cache, log)
    steps: list[Step] = []

    def add(step: Step) -> bool:
        steps.append(step)
        log(step.line())
        return step.ok

    def host() -> Step:
        why = host_refusal() or ensure_binfmt()
        if why:
            raise Refused(why)
        q = sh([QEMU, "--version"]) if shutil.which(QEMU) else None
        return Step("host", True, f"{platform.machine()} host; {(q.stdout.splitlines() or ['?'])[0] if q else 'native'}"
                                  "; binfmt_misc has an aarch64 entry")

    if not add(timed(host)) or not add(timed(lambda: build_root(ctx))):
        return steps
    instrs = instructions(dockerfile.read_text())
    locks = {lock: (REPO / lock).read_text() for lock in pip_locks(instrs)}
    pins = arch_pins(locks)
    fetched = {}

    def wheels() -> Step:
        step, *fetched["lists"] = fetch_wheels(ctx, pins)
        return step

    if not add(timed(wheels)):
        return steps
    served, sdists, skipped = fetched["lists"]
    sp = f"{VENV}/lib/python{PYTHON}/site-packages"
    env = mapped_env(instrs, sp)
    assert image_site_packages(instrs).endswith(f"python{PYTHON}/site-packages"), "FROM changed its Python"
    with Mounted(ctx):
        def install() -> Step:
            for cmd in install_commands(served, sdists):
                r = sh(in_root(ctx.root, cmd))
                if r.returncode != 0:
                    return Step("install", False, f"{' '.join(cmd[:6])} ...: {pip_error(r.stderr) or tail(r)}")
            return Step("install", True, f"{len(served) + len(sdists)} pins installed --no-deps in {VENV} inside the root"
                                         + (f" ({len(sdists)} built from sdists: {', '.join(sdists)})" if sdists else ""))

        if not add(timed(install)):
            return steps
        n = copy_repo(ctx.root)
        log(f"         copied {n} files of this checkout to {SUBMISSION} in the root")

        def check() -> Step:
            r = sh(in_root(ctx.root, [f"{VENV}/bin/python", "-m", "pip", "check"]))
            return pip_check_step(r.stdout, skipped)

        add(timed(check))
        args = {"TARGETARCH": DOCKER_ARCH[ARCH]}
        for i, chk in enumerate(import_checks(instrs)):
            def one(i=i, chk=chk) -> Step:
                r = sh(in_root(ctx.root, [f"{VENV}/bin/python", "-c", expand(chk.code, args)], env))
                return import_step(f"imports[{i}]", chk, r)
            add(timed(one))
        add(timed(lambda: inside(ctx, "headers", ["python", "-m", "evaluator.rehearsal.image", "--quick"],
                                 ok_detail=lambda out: out.splitlines()[-1].removeprefix("ok").strip())))
        if not add(timed(lambda: tiny_checkpoint(ctx, env))):
            return steps
        if not add(timed(lambda: tiny_build(ctx, env))):
            return steps
        if add(timed(lambda: tiny_run(ctx, env))):
            add(timed(lambda: host_agrees(ctx)))
    return steps


def work_env(env: dict[str, str]) -> dict[str, str]:
    """The image's ENV with every cache in the rehearsal's work folder inside the root."""
    return {**env, "TMPDIR": f"{WORK}/tmp", "TORCHINDUCTOR_CACHE_DIR": f"{WORK}/tmp/inductor",
            "XDG_CACHE_HOME": f"{WORK}/tmp/cache", "PYTHONPATH": SUBMISSION}


def tiny_checkpoint(ctx: Ctx, env: dict[str, str]) -> Step:
    work = ctx.root / WORK.lstrip("/")
    if work.exists():
        shutil.rmtree(work)
    (work / "tmp").mkdir(parents=True)
    code = ("import json, sys; from pathlib import Path; "
            "from evaluator.synthetic.cohort import make_tiny_checkpoint, make_cohort; "
            f"r = make_tiny_checkpoint(Path('{WORK}/tiny.safetensors'), seed=0, renders=4); "
            f"make_cohort(Path('{WORK}/cohort'), {TINY_COUNT}, seed=0); "
            "print(json.dumps({k: r[k] for k in ('model', 'input_size') if k in r}))")
    return inside(ctx, "checkpoint", ["python", "-c", code], work_env(env),
                  ok_detail=lambda out: f"tiny EVA-02 fitted on generated renders and {TINY_COUNT} generated "
                                        f"images written, inside the root: {out.splitlines()[-1]}")


def build_args() -> list[str]:
    from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

    return ["--model", TINY_MODEL, "--input-size", str(TINY_INPUT), "--crop-mode", "squash", "--crop-pct", "1.0",
            "--model-kwargs", json.dumps(TINY_KWARGS), "--checkpoint", f"{WORK}/tiny.safetensors",
            "--out", f"{WORK}/artifact", "--backend", "eager", "--precision", "fp32", "--batch-size", "4",
            "--device", "cpu"]


def tiny_build(ctx: Ctx, env: dict[str, str]) -> Step:
    return inside(ctx, "build", ["python", "-m", "engine.build", *build_args()], work_env(env),
                  ok_detail=lambda out: f"engine.build eager fp32 on the CPU inside the root -> {WORK}/artifact")


def tiny_run(ctx: Ctx, env: dict[str, str]) -> Step:
    out = f"{WORK}/predictions.i32"
    step = inside(ctx, "run", ["scripts/run", f"{WORK}/cohort/manifest.tsv", f"{WORK}/cohort", out],
                  {**work_env(env), "ENGINE_ARTIFACT": f"{WORK}/artifact"})
    if not step.ok:
        return step
    preds = answers(ctx.root / out.lstrip("/"))
    rows = len((ctx.root / WORK.lstrip("/") / "cohort" / "manifest.tsv").read_text().splitlines())
    ok = len(preds) == rows and all(0 <= p <= 999 for p in preds)
    return Step("run", ok, f"scripts/run inside the root: {len(preds)} answers for {rows} rows {preds}")


def answers(path: Path) -> list[int]:
    import numpy as np

    return np.fromfile(path, dtype="<i4").tolist() if path.is_file() else []


def host_agrees(ctx: Ctx) -> Step:
    """This machine's scripts/run on the artifact and images the root made: the same answers, row by row."""
    work = ctx.root / WORK.lstrip("/")
    with tempfile.TemporaryDirectory(prefix="arm64-agree-") as tmp:
        out = Path(tmp) / "host.i32"
        env = {**os.environ, "ENGINE_ARTIFACT": str(work / "artifact"), "TMPDIR": tmp,
               "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
        r = sh([str(REPO / "scripts" / "run"), str(work / "cohort" / "manifest.tsv"), str(work / "cohort"), str(out)],
               env=env)
        if r.returncode != 0:
            return Step("agree", False, f"this host's scripts/run on the root's artifact: exit {r.returncode}: {tail(r)}")
        host, arm = answers(out), answers(work / "predictions.i32")
    same = sum(a == b for a, b in zip(host, arm))
    return Step("agree", host == arm, f"{same} of {len(arm)} answers equal to this {platform.machine()} host's on the "
                                      f"same artifact and images")


def record(steps: list[Step], cache: Path) -> dict:
    """The JSON the command writes: the verdict, each step with its seconds, and where it ran."""
    return {"arch": ARCH, "emulated": platform.machine() not in ("aarch64", "arm64"), "ok": all(s.ok for s in steps),
            "host": {"machine": platform.machine(), "python": platform.python_version(), "kernel": platform.release()},
            "cache": str(cache), "total_s": round(sum(s.seconds or 0 for s in steps), 1),
            "steps": [{"name": s.name, "ok": s.ok, "seconds": s.seconds, "detail": s.detail} for s in steps]}
