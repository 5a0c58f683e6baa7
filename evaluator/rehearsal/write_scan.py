"""Where an unprivileged run could write, and what it did write: snapshots and `find` scans.

Used by the rehearsal (evaluator.rehearsal.rehearse): attribution is by owner, not only by mtime,
so other processes writing to /tmp at the same time are not blamed.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay", "devtmpfs",
            "vfat", "exfat"}


def snapshot(root: Path, exclude: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """{path: (mtime_ns, size, mode)} of everything under `root` except `exclude` subtrees."""
    out: dict[str, tuple] = {}
    if not os.path.lexists(root):
        return out
    skip = {str(e) for e in exclude}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
        for name in [".", *dirnames, *filenames]:
            p = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(p)
            out[p] = (st.st_mtime_ns, st.st_size, st.st_mode)
    return out


def diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    changes = [f"created {p}" for p in sorted(set(after) - set(before))]
    changes += [f"deleted {p}" for p in sorted(set(before) - set(after))]
    changes += [f"modified {p}" for p in sorted(set(before) & set(after)) if before[p] != after[p]]
    return changes


def writable_mounts() -> list[str]:
    """Mount points of local read-write filesystems (pseudo filesystems like /proc left out)."""
    out = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, fstype = left.split(), right.split()[0]
            point = re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if "rw" in fields[5].split(",") and fstype in LOCAL_FS:
                out.add(point)
    return sorted(out)


def _find(roots: list[str], prune: list[str], test: list[str]) -> list[tuple[str, str]]:
    """`find ROOTS -xdev (prune) -prune -o TEST -printf` -> [(type, path)]; unreadable corners are skipped."""
    if not roots:
        return []
    pr: list[str] = []
    for p in prune:
        pr += (["-o"] if pr else []) + ["-path", p]
    cmd = ["find", *roots, "-xdev", "(", *pr, ")", "-prune", "-o", "(", *test, ")", "-printf", r"%y %p\0"]
    r = subprocess.run(cmd, capture_output=True)  # exit 1 on a vanished temp file is fine: output still complete
    return [tuple(e.split(" ", 1)) for e in r.stdout.decode(errors="surrogateescape").split("\0") if e]


def writable_places(uid: int, gid: int, prune: list[str]) -> dict:
    """Folders the user may write into, world-writable files, and what the user owns already."""
    found = _find(writable_mounts(), prune,
                  ["-type", "d", "-perm", "-0002", "-o", "-type", "d", "-group", str(gid), "-perm", "-0020",
                   "-o", "-type", "f", "-perm", "-0002", "-o", "-user", str(uid)])
    dirs = sorted({p for t, p in found if t == "d"})
    top = [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]
    owned = {p: _stat(p) for t, p in found if _owner(p) == uid}
    wfiles = {p: _stat(p) for t, p in found if t == "f"}
    return {"dirs": top, "owned": owned, "world_files": wfiles}


def _stat(p: str) -> tuple | None:
    try:
        st = os.lstat(p)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_mode)


def _owner(p: str) -> int | None:
    try:
        return os.lstat(p).st_uid
    except OSError:
        return None


def writes_outside(places: dict, uid: int, prune: list[str]) -> list[str]:
    """Entries the user created or changed in the writable places found before the run."""
    bad = []
    for _, p in _find(places["dirs"], prune, ["-user", str(uid)]):
        if p not in places["owned"]:
            bad.append(f"created {p}")
        elif _stat(p) != places["owned"][p]:
            bad.append(f"modified {p}")
    bad += [f"modified {p}" for p, st in places["world_files"].items() if _stat(p) != st]
    return sorted(set(bad))
