"""The emulated ARM64 rehearsal's plan and host checks (pure where it can be; evaluator/rehearsal/emulated.py
runs them): which pins the image installs on aarch64, the command lines that fetch and install them and build
the arm64 root, and whether this machine can run an arm64 root at all (tools, root, binfmt_misc)."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ARCH = "aarch64"
DEBIAN_ARCH = "arm64"
SUITE = "bookworm"                       # the base image's Debian (FROM python:3.11-slim-bookworm)
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "python3-pip", "g++")
GLIBC = (2, 36)                          # bookworm's: the newest manylinux tag its wheels may carry
PYTHON = "3.11"
KIND = "arm64-rehearsal"                 # the cache folder's mark (engine.io.mark_owned)
QEMU = "qemu-aarch64-static"
NEOVERSE_V2_MIDR = 0x410FD4F0              # MIDR_EL1 of Arm Neoverse V2 (implementer 0x41, part 0xd4f), Grace's core
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
