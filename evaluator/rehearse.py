"""Rehearse the scored environment without Docker: the ABI as an unprivileged user, offline,
with read-only code and artifact, and fail on any write outside TMPDIR and the output folder,
on a wrong output, or on compilation at run time.

    scripts/rehearse [--prepared DIR | --count N --backend aot|eager] [--artifact DIR] [--reference R]
                     [--uid 65534] [--memory auto|none|16G] [--nproc N] [--run-cmd SH] [--keep]

Needs root (to drop to the user, unshare the network and set permissions); exits 2 otherwise.
Prints one JSON summary on stdout; exit 0 PASS, 1 FAIL (reasons on stderr), 2 cannot rehearse.

Write detection. The run's user can only create or change files where permissions let it:
world-writable folders (/tmp, /var/tmp, /dev/shm, ...), folders it or its group owns, and
world-writable files. Before the run one `find` pass over each writable local filesystem
lists exactly those places (about 1 s with a warm cache), and records what the user owns
already. After the run they are scanned again for entries owned by the user that are new or
changed, and the world-writable files are re-stat'ed. Attribution by owner, not only by
mtime (`find -newer MARKER`), keeps other processes writing to /tmp at the same time from
being blamed. The rehearsal's own folder (code, artifact and input copies, all root-owned
0755/0644) is compared as a (path, mtime, size, mode) snapshot, and HOME (/nonexistent)
must still not exist. Not covered: deleting another user's file in a non-sticky
world-writable folder, and writes through ACLs.

Compilation rule. scripts/run points TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
CUPY_CACHE_DIR into TMPDIR: those must stay empty or absent. Any other compiled-code file
(.so .o .c .cpp .cu .h .cubin .ptx .fatbin ...) under TMPDIR must be byte-identical (size and
CRC-32) to an entry of a .pt2 package of the artifact: `AOTIModelPackageLoader` unpacks the
package's `model/data/aotinductor/model/*` (wrapper .so with the weights inside, its .cpp
sources and metadata) into a fresh `$TMPDIR/aotinductor_XXXXXX/` (mkdtemp, 0700) and dlopens
the .so. Its destructor removes the folder (std::filesystem::remove_all); in scripts/run that
happens when evaluator.run.main returns, before the fast `os._exit`, but a killed run (or a
loader kept alive past main) leaves it behind. Either way it is extraction, not compilation;
it needs TMPDIR space about the size of the package, on a filesystem that allows exec.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOME = "/nonexistent"
COMPILE_CACHES = ("inductor", "triton", "cupy")  # the names scripts/run gives them under TMPDIR
COMPILED = {".so", ".o", ".a", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp", ".cubin", ".ptx", ".fatbin",
            ".ttir", ".ttgir", ".llir"}
LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay", "devtmpfs",
            "vfat", "exfat"}
PASS_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "ENGINE_DECODER",
            "ENGINE_READERS", "ENGINE_ARTIFACT_VERIFY", "ENGINE_FAST_EXIT", "OMP_NUM_THREADS")


class Setup(RuntimeError):
    """The rehearsal itself cannot be set up (exit 2), as opposed to the run failing it (exit 1)."""


def parse_size(text: str) -> int | None:
    """'16G' / '512M' / '1073741824' -> bytes; 'none' -> None."""
    if text.lower() in ("none", "0", "off"):
        return None
    m = re.fullmatch(r"(\d+)([KMGT]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16G, 512M, none)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2).upper()]


# ---------------------------------------------------------------- copies with safe permissions

def _set_modes(root: Path) -> None:
    """root-owned, folders 0755, files 0644 (0755 when executable): readable, never writable, by the run."""
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        os.chown(p, 0, 0)
        if p.is_dir():
            os.chmod(p, 0o755)
        else:
            os.chmod(p, 0o755 if p.stat().st_mode & stat.S_IXUSR else 0o644)


def source_files(repo: Path) -> list[str]:
    """The files a source archive of `repo` would hold: git's tracked + untracked-not-ignored, else a walk."""
    if (repo / ".git").exists() and shutil.which("git"):
        r = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True)
        return sorted({f for f in r.stdout.decode().split("\0") if f and (repo / f).is_file()})
    skip = {".git", "__pycache__", "artifacts", "demo", ".pytest_cache", ".ruff_cache", ".benchmarks", "build"}
    return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")
                  if p.is_file() and not skip & set(p.relative_to(repo).parts))


def copy_repo(repo: Path, dest: Path) -> int:
    files = source_files(repo)
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, dest / f, follow_symlinks=False)
    _set_modes(dest)
    return len(files)


def copy_cohort(manifest: Path, image_root: Path, dest: Path) -> int:
    """The manifest and the files it names (nothing else: no answers travel with the input)."""
    from evaluator.manifest import read_manifest

    rows = read_manifest(manifest)
    dest.mkdir(parents=True)
    shutil.copy2(manifest, dest / "manifest.tsv")
    for r in rows:
        src = image_root / r.path
        if src.is_file():  # a missing file stays missing: the run must cope with it
            (dest / r.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / r.path)
    _set_modes(dest)
    return len(rows)


# ---------------------------------------------------------------- snapshots and scans

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


# ---------------------------------------------------------------- compilation at run time

def aoti_entries(artifact: Path) -> dict[str, tuple[int, int]]:
    """{archive member name: (size, crc32)} of every .pt2 package in the artifact."""
    out = {}
    for pkg in artifact.rglob("*.pt2"):
        with zipfile.ZipFile(pkg) as z:
            out.update({i.filename: (i.file_size, i.CRC) for i in z.infolist() if not i.is_dir()})
    return out


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def compiled_at_run_time(tmp: Path, entries: dict[str, tuple[int, int]]) -> tuple[list[str], list[str]]:
    """(files that show compilation, files that are AOTI package extraction) under TMPDIR."""
    bad, extracted = [], []
    for c in COMPILE_CACHES:
        if (tmp / c).exists():
            bad += [f"{p} (compile cache)" for p in (tmp / c).rglob("*") if p.is_file()]
    for p in tmp.rglob("*"):
        if not p.is_file() or p.suffix not in COMPILED or any(p.is_relative_to(tmp / c) for c in COMPILE_CACHES):
            continue
        rel = p.relative_to(tmp).as_posix()
        match = [n for n in entries if rel.endswith("/" + n)]
        if match and entries[match[0]] == (p.stat().st_size, _crc32(p)):
            extracted.append(str(p))
        else:
            bad.append(f"{p} (compiled-code file, not an entry of the artifact's .pt2)")
    return bad, extracted


# ---------------------------------------------------------------- the unprivileged, offline process

def _traversable(path: str, uid: int, gid: int) -> bool:
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
            if not _traversable(a, uid, gid):
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
        print(f"[rehearse] cannot read /proc/self/maps ({e}); shared-library folders not checked", file=sys.stderr)
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
        err += f"\n[rehearse] killed after {timeout:.0f} s"
        return 124, out, err, time.perf_counter() - t0
    return proc.returncode, out, err, time.perf_counter() - t0


# ---------------------------------------------------------------- the rehearsal

def prepare_inputs(a: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, Path]:
    """(manifest, image_root, artifact, reference) from --prepared or a fresh evaluator.demo prepare."""
    src = a.prepared
    if src is None:
        src = work / "prepared"
        print(f"[rehearse] preparing a generated cohort in {src} (evaluator.demo prepare)", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "evaluator.demo", "prepare", "--out", str(src), "--count",
                            str(a.count), "--backend", a.backend], cwd=REPO, stdout=subprocess.DEVNULL)
        if r.returncode:
            raise Setup(f"evaluator.demo prepare failed with exit {r.returncode}")
    manifest, artifact = src / "cohort" / "manifest.tsv", a.artifact or src / "artifact"
    reference = a.reference or src / "reference.i32"
    for p in (manifest, artifact / "manifest.json", reference):
        if not p.is_file():
            raise Setup(f"missing {p}: --prepared needs cohort/, artifact/ and reference.i32 "
                        "(python -m evaluator.demo prepare --out DIR)")
    return manifest, manifest.parent, artifact, reference


def check_output(output: Path, rows: int, reference: Path, gate: float) -> tuple[list[str], dict]:
    import numpy as np

    from evaluator.agreement import agreement

    if not output.is_file():
        return [f"no output file at {output}"], {}
    data = output.read_bytes()
    if len(data) != 4 * rows:
        return [f"output has {len(data)} bytes, expected 4 x {rows} rows = {4 * rows} (little-endian int32)"], {}
    pred = np.frombuffer(data, "<i4")
    bad = np.flatnonzero((pred < 0) | (pred > 999))
    if len(bad):
        return [f"{len(bad)} values outside [0, 999], first {int(pred[bad[0]])} at row {int(bad[0]) + 1}"], {}
    ref = np.fromfile(reference, "<i4")
    if len(ref) != rows:
        raise Setup(f"reference {reference} has {len(ref)} rows, the manifest {rows}: not the same cohort")
    ag = agreement(pred, ref, gate)
    info = {"agreement": f"{ag.matches}/{ag.total}", "agreement_rate": round(ag.rate, 6)}
    return ([] if ag.passed else [f"agreement {ag.matches}/{ag.total} = {ag.rate:.4f} < gate {gate}"]), info


def rehearse(a: argparse.Namespace) -> dict:
    if os.geteuid() != 0:
        raise Setup("needs root: it drops to an unprivileged user (setpriv), unshares the network and "
                    "sets permissions on its copies; run it with sudo or in a root container")
    if not shutil.which("setpriv"):
        raise Setup("setpriv (util-linux) is missing: cannot drop to an unprivileged user")
    net = bool(shutil.which("unshare")) and not a.allow_network
    uid = gid = a.uid
    notes = []
    if not net:
        notes.append("network NOT isolated: " + ("--allow-network" if a.allow_network else "unshare is missing"))
    work = Path(tempfile.mkdtemp(prefix="rehearse-", dir=a.workdir))
    os.chmod(work, 0o755)
    if not all(_traversable(str(d), uid, gid) for d in work.parents):
        shutil.rmtree(work)
        raise Setup(f"uid {uid} cannot reach {work.parent}: pass --workdir a folder others can enter")
    summary: dict = {"workdir": str(work), "user": f"{uid}:{gid}", "home": HOME}
    try:
        manifest, image_root, artifact_src, reference = prepare_inputs(a, work)
        repo, art, inp = work / "repo", work / "artifact", work / "input"
        tmp, out, stage = work / "tmp", work / "out", work / "stage"
        summary["source_files"] = copy_repo(REPO, repo)
        shutil.copytree(artifact_src, art)
        _set_modes(art)
        rows = copy_cohort(manifest, image_root, inp)
        stage.mkdir(mode=0o700)
        for d in (tmp, out):  # the only folders the run may write
            d.mkdir(mode=0o700)
            os.chown(d, uid, gid)
        device = json.loads((art / "manifest.json").read_text()).get("device", "cpu")
        memory = a.memory
        if memory == "auto":
            memory = None if device == "cuda" else 16 << 30
            if device == "cuda":
                notes.append("no address-space bound: CUDA reserves huge virtual ranges (use --memory to force one)")
        summary["memory_limit_bytes"] = memory
        mounts = interpreter_mounts(uid, gid)
        if mounts and not shutil.which("unshare"):
            raise Setup(f"the interpreter is under {mounts[0][0]}, which uid {uid} cannot enter, and unshare is "
                        "missing to work around it: install Python where the user can reach it")
        if mounts:
            notes.append(f"python under {sorted({m[0] for m in mounts})} is exposed to the user through a "
                         "private mount namespace (tmpfs over the blocked folder, needed paths bound back)")
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "HOME": HOME,
               "TMPDIR": str(tmp), "LANG": "C.UTF-8", "PYTHON": sys.executable, "ENGINE_ARTIFACT": str(art),
               "CONTEST_REPORT": str(out / "report.json"), "REHEARSE_REPO": str(repo)}
        env.update({k: os.environ[k] for k in PASS_ENV if k in os.environ})
        env.update(dict(kv.split("=", 1) for kv in a.env))

        def wrap(cmd: list[str]) -> list[str]:
            return user_command(cmd, env, uid, gid, memory, a.nproc, net, mounts, stage)

        # Preflight: the user can run Python, cannot write the copies or HOME, can write TMPDIR and out.
        probe = ('for p in "$@"; do [ -w "$p" ] && echo "writable: $p"; done; '
                 f'for p in {tmp} {out}; do [ -w "$p" ] || echo "not writable: $p"; done; '
                 f'[ -e {HOME} ] && echo "exists: {HOME}"; "$PYTHON" -c "import sys" || echo "python unreachable"')
        rc, so, se, _ = run_as_user(wrap(["sh", "-c", probe, "probe", str(repo), str(repo / "scripts"),
                                          str(art), str(inp), str(work), "/"]), 120)
        if rc or so.strip():
            raise Setup(f"preflight as uid {uid} failed (rc {rc}): {(so + se).strip()[-2000:]}")

        prune = [str(work)]
        t_scan = time.perf_counter()
        places = writable_places(uid, gid, prune)
        summary["writable_places"] = places["dirs"]
        before = snapshot(work, (tmp, out))
        home_before = snapshot(Path(HOME))
        summary["scan_s"] = round(time.perf_counter() - t_scan, 3)

        output = out / "predictions.i32"
        abi = [str(inp / "manifest.tsv"), str(inp), str(output)]
        cmd = ["sh", "-c", a.run_cmd, "run", *abi] if a.run_cmd else [str(repo / "scripts" / "run"), *abi]
        rc, so, se, wall = run_as_user(wrap(cmd), a.timeout)
        summary.update({"rc": rc, "wall_s": round(wall, 3), "rows": rows, "stderr_tail": se[-2000:]})

        failures = []
        if rc:
            failures.append(f"the run exited {rc}")
        if so.strip():  # not a rule of the contest, but scripts/run itself never prints there
            notes.append(f"the run printed {len(so)} characters on stdout")
        bad_out, info = check_output(output, rows, reference, a.gate)
        failures += bad_out
        summary.update(info)
        outside = writes_outside(places, uid, prune) + diff(before, snapshot(work, (tmp, out)))
        outside += [f"HOME {c}" for c in diff(home_before, snapshot(Path(HOME)))]
        summary["writes_outside"] = outside
        failures += [f"wrote outside TMPDIR and the output folder: {w}" for w in outside[:20]]
        compiled, extracted = compiled_at_run_time(tmp, aoti_entries(art))
        summary["compiled"], summary["aoti_extracted"] = compiled, [str(Path(p).relative_to(tmp)) for p in extracted]
        failures += [f"compiled at run time: {c}" for c in compiled[:20]]
        summary["tmpdir_bytes"] = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        summary["output_files"] = sorted(p.name for p in out.iterdir())
        if (out / "report.json").is_file():
            try:
                summary["report"] = json.loads((out / "report.json").read_text()).get("stages")
            except ValueError:
                notes.append("report.json is not JSON")
        summary["network"] = "isolated (unshare --net)" if net else "not isolated"
        summary["notes"] = notes
        summary["failures"] = failures
        summary["verdict"] = "FAIL" if failures else "PASS"
        return summary
    finally:
        if a.keep:
            print(f"[rehearse] kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/rehearse", description=__doc__.split("\n\n")[0])
    p.add_argument("--prepared", type=Path, help="a dir made by `python -m evaluator.demo prepare` (used as is)")
    p.add_argument("--count", type=int, default=120, help="cohort size when preparing (no --prepared)")
    p.add_argument("--backend", choices=("aot", "eager"), default="aot", help="artifact backend when preparing")
    p.add_argument("--artifact", type=Path, help="artifact dir (default PREPARED/artifact)")
    p.add_argument("--reference", type=Path, help="reference .i32 (default PREPARED/reference.i32)")
    p.add_argument("--uid", type=int, default=65534, help="unprivileged uid (and gid) to run as")
    p.add_argument("--memory", default="auto", help="address-space bound: auto (16G on CPU, none on CUDA), none, 8G")
    p.add_argument("--nproc", type=int, default=4096, help="process+thread bound for the user (RLIMIT_NPROC)")
    p.add_argument("--gate", type=float, default=0.99, help="agreement with the reference needed to pass")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--run-cmd", default=os.environ.get("REHEARSE_RUN_CMD") or None,
                   help="sh command run instead of scripts/run, with MANIFEST IMAGE_ROOT OUTPUT as $1..$3 "
                        "($REHEARSE_REPO is the code copy); env REHEARSE_RUN_CMD")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra variable for the run")
    p.add_argument("--workdir", help="parent of the rehearsal folder (default the system temp dir)")
    p.add_argument("--allow-network", action="store_true", help="skip unshare --net")
    p.add_argument("--keep", action="store_true", help="keep the rehearsal folder")
    a = p.parse_args(argv)
    if a.memory != "auto":
        a.memory = parse_size(a.memory)
    if any("=" not in kv for kv in a.env):
        p.error("--env takes K=V")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        summary = rehearse(a)
    except Setup as e:
        print(f"rehearse: cannot rehearse: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    for f in summary["failures"]:
        print(f"rehearse: FAIL: {f}", file=sys.stderr)
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
