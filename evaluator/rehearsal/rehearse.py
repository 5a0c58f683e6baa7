"""Rehearse the scored environment without Docker: the ABI as an unprivileged user, offline,
with read-only code and artifact, and fail on any write outside TMPDIR and the output folder,
on a wrong output, or on compilation at run time.

    scripts/rehearse [--prepared DIR | --count N --backend NAME] [--artifact DIR] [--reference R]
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
CRC-32) to an entry of a .pt2 package (a zip) of the artifact, which torch's package loader
would extract into `$TMPDIR/aotinductor_XXXXXX/`: extraction, not compilation. The kit's aot
backend ships no package (the build unpacks it, the run loads `aot/model.so` in place), so
for its artifacts any compiled-code file under TMPDIR is flagged.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from evaluator import settings as evaluator_settings
from evaluator.rehearsal.sandbox import interpreter_mounts, run_as_user, traversable, user_command  # noqa: F401 - re-exported
from evaluator.rehearsal.write_scan import diff, snapshot, writable_places, writes_outside  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
PROG = "scripts/rehearse"
HOME = "/nonexistent"
COMPILE_CACHES = ("inductor", "triton", "cupy")  # the names scripts/run gives them under TMPDIR
COMPILED = {".so", ".o", ".a", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp", ".cubin", ".ptx", ".fatbin",
            ".ttir", ".ttgir", ".llir"}
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
    from evaluator.contest.manifest import read_manifest

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


# ---------------------------------------------------------------- compilation at run time

def aoti_entries(artifact: Path) -> dict[str, tuple[int, int]]:
    """{archive member name: (size, crc32)} of every compiled package (a zip a backend declares
    compiled code, engine.backends) in the artifact."""
    from engine.backends import compiled_suffixes

    out = {}
    suffixes = compiled_suffixes()
    for pkg in artifact.rglob("*"):
        if pkg.suffix not in suffixes or not zipfile.is_zipfile(pkg):
            continue
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
            bad.append(f"{p} (compiled-code file, not an entry of the artifact's compiled package)")
    return bad, extracted


# ---------------------------------------------------------------- the rehearsal

def prepare_inputs(a: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, Path]:
    """(manifest, image_root, artifact, reference) from --prepared or a fresh evaluator.contest.demo prepare."""
    src = a.prepared
    if src is None:
        src = work / "prepared"
        print(f"{PROG}: preparing a generated cohort in {src} (evaluator.contest.demo prepare)", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "evaluator.demo", "prepare", "--out", str(src), "--count",
                            str(a.count), "--backend", a.backend], cwd=REPO, stdout=subprocess.DEVNULL)
        if r.returncode:
            raise Setup(f"evaluator.contest.demo prepare failed with exit {r.returncode}")
    manifest, artifact = src / "cohort" / "manifest.tsv", a.artifact or src / "artifact"
    reference = a.reference or src / "reference.i32"
    for p in (manifest, artifact / "manifest.json", reference):
        if not p.is_file():
            raise Setup(f"missing {p}: --prepared needs cohort/, artifact/ and reference.i32 "
                        "(python -m evaluator.demo prepare --out DIR)")
    return manifest, manifest.parent, artifact, reference


def check_output(output: Path, rows: int, reference: Path, gate: float) -> tuple[list[str], dict]:
    import numpy as np

    from evaluator.contest.agreement import agreement

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
    if not all(traversable(str(d), uid, gid) for d in work.parents):
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
        env.update({k: v for k, v in os.environ.items() if k in PASS_ENV})
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
            print(f"{PROG}: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine.backends import BACKENDS
    from engine.backends import DEFAULT as DEFAULT_BACKEND
    from engine.cli import parser

    p = parser(PROG, __doc__.split("\n\n")[0], {
        "REHEARSE_RUN_CMD": "sh command run instead of scripts/run (as --run-cmd)",
        "ENGINE_DEBUG": "1: tracebacks instead of one-line errors"})
    p.add_argument("--prepared", type=Path, help="a dir made by `python -m evaluator.demo prepare` (used as is)")
    p.add_argument("--count", type=int, default=120, help="cohort size when preparing (no --prepared)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND,
                   help="artifact backend when preparing (engine.backends)")
    p.add_argument("--artifact", type=Path, help="artifact dir (default PREPARED/artifact)")
    p.add_argument("--reference", type=Path, help="reference .i32 (default PREPARED/reference.i32)")
    p.add_argument("--uid", type=int, default=65534, help="unprivileged uid (and gid) to run as")
    p.add_argument("--memory", default="auto", help="address-space bound: auto (16G on CPU, none on CUDA), none, 8G")
    p.add_argument("--nproc", type=int, default=4096, help="process+thread bound for the user (RLIMIT_NPROC)")
    p.add_argument("--gate", type=float, default=0.99, help="agreement with the reference needed to pass")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take")
    p.add_argument("--run-cmd", default=evaluator_settings.rehearse_run_cmd(),
                   help="sh command run instead of scripts/run, with MANIFEST IMAGE_ROOT OUTPUT as $1..$3 "
                        "($REHEARSE_REPO is the code copy); env REHEARSE_RUN_CMD")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra variable for the run")
    p.add_argument("--workdir", help="parent of the rehearsal folder (default the system temp dir)")
    p.add_argument("--allow-network", action="store_true", help="skip unshare --net")
    p.add_argument("--keep", action="store_true", help="keep the rehearsal folder")
    a = p.parse_args(argv)
    if a.memory != "auto":
        try:
            a.memory = parse_size(a.memory)
        except argparse.ArgumentTypeError as e:
            p.error(f"--memory: {e}")
    if any("=" not in kv for kv in a.env):
        p.error("--env takes K=V")
    if a.prepared is None and not 2 <= a.count <= 100_000:
        p.error(f"--count must be in 2..100000, got {a.count}")
    if not 0.0 < a.gate <= 1.0 or a.timeout <= 0:
        p.error("--gate must lie in (0, 1] and --timeout be > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    from engine.cli import error, guard

    a = parse_args(argv)

    def body() -> int:
        try:
            summary = rehearse(a)
        except Setup as e:
            return error(PROG, f"cannot rehearse: {e}")
        print(json.dumps(summary, indent=1))
        for f in summary["failures"]:
            print(f"{PROG}: FAIL: {f}", file=sys.stderr)
        return 0 if summary["verdict"] == "PASS" else 1

    return guard(PROG, body, debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
