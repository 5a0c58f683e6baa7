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
           the tiny EVA-02 checkpoint and its generated images made by this host into the root (the
           image never fits a checkpoint), then `python -m engine.build` (eager, FP32, CPU) and
           `scripts/run` end to end on them inside the root;
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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from evaluator.rehearsal.emulated_plan import (
    ARCH,
    DEBIAN_ARCH,
    MIRROR,
    NEOVERSE_V2_MIDR,
    PACKAGES,
    PYTHON,
    QEMU,
    STEP_TIMEOUT_S,
    SUBMISSION,
    SUITE,
    TINY_COUNT,
    VENV,
    WHEELS,
    WORK,
    Refused,
    arch_pins,
    debootstrap_commands,
    download_command,
    ensure_binfmt,
    host_refusal,
    in_root,
    install_commands,
    sdist_command,
)
from evaluator.rehearsal.image_steps import (
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


def arm64_sys(folder: Path, cpus: int) -> Path:
    """A stand-in for an arm64 kernel's /sys: the CPU list and each CPU's identification registers.

    torch's oneDNN (xbyak_aarch64) reads MIDR_EL1 from /sys/devices/system/cpu/cpuN/regs/identification
    when torch loads, and crashes the process (SIGSEGV) where the entry is missing, as under qemu-user
    on an x86_64 kernel. Every arm64 Linux kernel has it; here it names a Neoverse V2 (Grace's core).
    """
    cpu = folder / "devices" / "system" / "cpu"
    for i in range(cpus):
        ident = cpu / f"cpu{i}" / "regs" / "identification"
        ident.mkdir(parents=True, exist_ok=True)
        (ident / "midr_el1").write_text(f"0x{NEOVERSE_V2_MIDR:016x}\n")
        (ident / "revidr_el1").write_text(f"0x{0:016x}\n")
    for name in ("online", "possible", "present"):
        (cpu / name).write_text(f"0-{cpus - 1}\n")
    return folder


class Mounted:
    """/proc, /dev, /sys and the wheel folder mounted into the root for the steps inside it; unmounted
    (lazily, in reverse) however the steps end. Emulated, /sys is arm64_sys's stand-in, not this kernel's."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.points = ctx, []

    def __enter__(self) -> Mounted:
        root = self.ctx.root
        sys_dir = "/sys" if not emulated() else str(arm64_sys(self.ctx.cache / "sys", os.cpu_count() or 1))
        for src, dst, opts in (("proc", "proc", ["-t", "proc"]), ("/dev", "dev", ["--rbind"]),
                               (sys_dir, "sys", ["--rbind"]), (str(self.ctx.wheels), WHEELS.lstrip("/"), ["--bind"])):
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


def emulated() -> bool:
    return platform.machine() not in ("aarch64", "arm64")


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
            """The venv and the wheels must install; an sdist whose build needs NVIDIA's index (TensorRT's
            libraries) is skipped like an unserved pin, any other sdist failure fails the step only."""
            done, want = ctx.cache / "install.json", {"served": served, "sdists": sdists}
            if done.is_file() and json.loads(done.read_text()).get("pins") == want \
                    and (ctx.root / VENV.lstrip("/") / "bin" / "python").exists():
                prior = json.loads(done.read_text())
                skipped.extend(prior.get("skipped_sdists", []))
                wheels_in["ok"] = True
                return Step("install", True, f"cached: {VENV} in the root holds these {len(served) + len(sdists)} "
                                             f"pins (installed --no-deps in {prior.get('seconds', '?')} s)")
            done.unlink(missing_ok=True)
            t0 = time.monotonic()
            cmds = install_commands(served, sdists)
            built, failed, skipped0 = [], [], list(skipped)
            for cmd in cmds:
                r = sh(in_root(ctx.root, cmd))
                pin = cmd[-1] if cmd[-1] in sdists else None
                if r.returncode == 0:
                    built += [pin] if pin else []
                elif pin and NOT_SERVED.search(r.stderr + r.stdout):
                    skipped.append(re.split(r"[=\[]", pin)[0])
                    log(f"         skipped {pin}: its sdist's build needs NVIDIA's index ({pip_error(r.stderr)[:160]})")
                elif pin:
                    failed.append(f"{pin}: {pip_error(r.stderr) or tail(r)}")
                else:
                    return Step("install", False, f"{' '.join(cmd[:6])} ...: {pip_error(r.stderr) or tail(r)}")
            wheels_in["ok"] = True
            if not failed:
                done.write_text(json.dumps({"pins": want, "skipped_sdists": [p for p in skipped if p not in skipped0],
                                            "seconds": round(time.monotonic() - t0)}) + "\n")
            return Step("install", not failed, f"{len(served)} wheels + {len(built)} sdists installed --no-deps in {VENV} "
                                               f"inside the root" + (f" (built there: {', '.join(built)})" if built else "")
                        + (f"; sdist builds FAILED: {'; '.join(failed)}" if failed else ""))

        wheels_in = {}
        if not add(timed(install)) and not wheels_in:
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
                                 ok_detail=lambda out: out.splitlines()[-1].partition(": ")[2])))
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
    """The tiny checkpoint and its generated images, made by this host's Python into the root's work
    folder: fitting a checkpoint is no step of the image's (qemu took over 26 minutes at it without
    finishing), and both are byte-identical for a seed on either machine (tests/test_cohort.py), so
    the emulated steps are the ones the image runs: the build and scripts/run."""
    from evaluator.synthetic.cohort import make_cohort, make_tiny_checkpoint

    work = ctx.root / WORK.lstrip("/")
    if work.exists():
        shutil.rmtree(work)
    (work / "tmp").mkdir(parents=True)
    try:
        r = make_tiny_checkpoint(work / "tiny.safetensors", seed=0, renders=4)
        make_cohort(work / "cohort", TINY_COUNT, seed=0)
    except Exception as e:  # noqa: BLE001 - a step that fails says why in its line
        return Step("checkpoint", False, f"the tiny checkpoint could not be made here: {type(e).__name__}: {e}")
    made = {k: r[k] for k in ("model", "input_size") if k in r}
    return Step("checkpoint", True, f"tiny EVA-02 fitted on generated renders and {TINY_COUNT} generated images "
                                    f"written by this host into {WORK} in the root: {json.dumps(made)}")


def build_args() -> list[str]:
    from engine.backends import eager
    from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

    return ["--model", TINY_MODEL, "--input-size", str(TINY_INPUT), "--crop-mode", "squash", "--crop-pct", "1.0",
            "--model-kwargs", json.dumps(TINY_KWARGS), "--checkpoint", f"{WORK}/tiny.safetensors",
            "--out", f"{WORK}/artifact", "--backend", eager.NAME, "--precision", "fp32", "--batch-size", "4",
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
    return {"arch": ARCH, "emulated": emulated(), "ok": all(s.ok for s in steps),
            "host": {"machine": platform.machine(), "python": platform.python_version(), "kernel": platform.release()},
            "cache": str(cache), "total_s": round(sum(s.seconds or 0 for s in steps), 1),
            "steps": [{"name": s.name, "ok": s.ok, "seconds": s.seconds, "detail": s.detail} for s in steps]}
