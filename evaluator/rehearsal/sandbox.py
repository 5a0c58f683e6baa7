"""Run a command as an unprivileged user, offline, with limits: the rehearsal's sandbox.

setpriv drops to the user with no capabilities; unshare gives it no network and, when the
interpreter lives under a folder the user cannot traverse (pyenv under /root 0700), a
private mount namespace that binds back only what Python needs, so nothing on disk changes.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

def traversable(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def interpreter_mounts(uid: int, gid: int) -> list[tuple[str, str]]:
    """(blocked folder, needed path) pairs: the Python tree the user cannot reach (e.g. pyenv under /root 0700).

    They are fixed inside a private mount namespace: a tmpfs (0755) over the blocked folder
    with only the needed paths bound back, so nothing on disk changes mode.
    """
    need = {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
            os.path.dirname(os.path.realpath(sys.executable))}
    need |= {p for p in sys.path if p and os.path.exists(p) and not p.startswith(str(REPO))}
    need |= _mapped_library_dirs()  # e.g. libpython found through an rpath outside the prefix
    need = {os.path.realpath(p) for p in need} | need
    out = []
    for p in sorted(need):
        parts = Path(p).parts
        for i in range(2, len(parts)):
            a = str(Path(*parts[:i]))
            if not traversable(a, uid, gid):
                out.append((a, p))
                break
    # keep the top needed path per blocked folder
    out = [(a, p) for a, p in out if not any(a == a2 and p != p2 and p.startswith(p2 + "/") for a2, p2 in out)]
    return sorted(set(out))


def _mapped_library_dirs() -> set[str]:
    """Folders of the shared libraries this interpreter has mapped (from /proc/self/maps)."""
    out = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
                if path.startswith("/") and ".so" in path and os.path.exists(path):
                    out.add(os.path.dirname(path))
    except OSError as e:
        print(f"scripts/rehearse: cannot read /proc/self/maps ({e}); shared-library folders not checked", file=sys.stderr)
    return out


def user_command(cmd: list[str], env: dict[str, str], uid: int, gid: int, memory: int | None, nproc: int,
                 net: bool, mounts: list[tuple[str, str]], stage: Path) -> list[str]:
    """`cmd` wrapped: [unshare --net [--mount] [mount setup]] prlimit setpriv env -i ... cmd."""
    user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "env", "-i", *[f"{k}={v}" for k, v in env.items()], *cmd]
    lim = ["prlimit", f"--nproc={nproc}"] + ([f"--as={memory}"] if memory else []) + ["--"]
    inner = lim + user
    if not mounts:
        return (["unshare", "--net", "--"] if net else []) + inner
    lines = ["set -e"]
    for i, (_, p) in enumerate(mounts):  # stage the needed trees before the tmpfs hides them
        lines += [f"mkdir -p '{stage}/{i}'", f"mount --bind '{p}' '{stage}/{i}'"]
    for a in sorted({a for a, _ in mounts}):
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m,nosuid,nodev rehearse-hide '{a}'")
    for i, (_, p) in enumerate(mounts):
        lines += [f"mkdir -p '{p}'", f"mount --move '{stage}/{i}' '{p}'"]
    lines.append('exec "$@"')
    return ["unshare", *(["--net"] if net else []), "--mount", "--propagation", "private", "--",
            "sh", "-c", "\n".join(lines), "rehearse-ns", *inner]


def run_as_user(cmd: list[str], timeout: float) -> tuple[int, str, str, float]:
    """(rc, stdout, stderr, wall s); the whole process group is killed on timeout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nscripts/rehearse: killed after {timeout:.0f} s"
        return 124, out, err, time.perf_counter() - t0
    return proc.returncode, out, err, time.perf_counter() - t0
