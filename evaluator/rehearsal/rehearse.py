"""Rehearse the scored environment without Docker: the ABI as an unprivileged user, offline,
with read-only code and artifact, and fail on any write outside TMPDIR and the output folder,
on a wrong output, or on compilation at run time.

    scripts/rehearse --artifact A [--cohort C] [--reference R] [--checkpoint CK]   # your artifact
    scripts/rehearse [--prepared DIR | --count N --backend NAME]                    # the kit's own
        [--uid 10001] [--memory auto|none|16G] [--nproc N] [--run-cmd SH] [--keep]

What it rehearses. `--artifact A` rehearses exactly A: on the cohort C (C/manifest.tsv,
image paths relative to C) or, without `--cohort`, on a generated one (`--count` images);
against the reference R or, without `--reference`, one `python -m evaluator.reference`
computes with A's own spec (model, input size, crop mode, crop_pct, model kwargs) from
the checkpoint A was built from (A's manifest records its path and SHA-256; `--checkpoint`
names another copy). It builds nothing else. `--prepared DIR` takes a folder from
`python -m evaluator.demo prepare`; with neither, one is prepared (a generated cohort, the
kit's tiny checkpoint, a `--backend` artifact). The verdict uses evaluator.agreement's
figure: rows the reference could not read (-1) are left out and counted apart.

Root or not. As root it runs the ABI as an unprivileged user (setpriv), offline (unshare
--net), with read-only copies of code and artifact and the write scan below. Without root
it still runs the copies read-only (by mode), with HOME unwritable, TMPDIR and the output
folder the only writable places it gives, the memory bound and the output, agreement and
compilation checks, offline where `unshare -rn` is allowed; it says on stderr what it
cannot check then (the user switch, writes elsewhere the user may write).
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
from evaluator.contest.agreement import GATE
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
    """Readable, never writable, by the run: as root, root-owned, folders 0755, files 0644 (0755 when
    executable); without root (the run is this user) owner-writable bits off too: 0555 / 0444."""
    privileged = os.geteuid() == 0
    dmode, fmode, xmode = (0o755, 0o644, 0o755) if privileged else (0o555, 0o444, 0o555)
    for p in sorted([root, *root.rglob("*")], key=lambda q: -len(q.parts)):   # deepest first
        if p.is_symlink():
            continue
        if privileged:
            os.chown(p, 0, 0)
        if p.is_dir():
            os.chmod(p, dmode)
        else:
            os.chmod(p, xmode if p.stat().st_mode & stat.S_IXUSR else fmode)


def _remove(work: Path) -> None:
    """rmtree that first gives back the write bits _set_modes took (needed without root)."""
    for p in [work, *work.rglob("*")]:
        if not p.is_symlink() and p.is_dir():
            try:
                os.chmod(p, 0o755)
            except OSError:
                pass
    shutil.rmtree(work, ignore_errors=True)


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

def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def artifact_checkpoint(artifact: Path, given: Path | None) -> Path:
    """The FP32 checkpoint `artifact` was built from: `given`, else the path its manifest records
    (a relative one as the build saw it: from here, or from the repository, where build.sh runs),
    which must still hold the same bytes (SHA-256)."""
    from engine.io import sha256_file

    meta = json.loads((artifact / "manifest.json").read_text()).get("checkpoint") or {}
    ck = given
    if ck is None and meta.get("path"):
        ck = next((c for c in (Path(meta["path"]), REPO / meta["path"]) if c.is_file()), Path(meta["path"]))
    if ck is None or not ck.is_file():
        raise Setup(f"no reference without the checkpoint {artifact} was built from ({ck or 'not recorded'} is not "
                    "a file): pass --reference R, or --checkpoint FILE")
    if meta.get("sha256") and sha256_file(ck) != meta["sha256"]:
        raise Setup(f"{ck} is not the checkpoint {artifact} was built from (SHA-256 differs): pass --checkpoint")
    return ck


def reference_for(artifact: Path, manifest: Path, image_root: Path, out: Path, checkpoint: Path | None) -> Path:
    """`python -m evaluator.reference` on the cohort with the artifact's own spec (crop mode included)."""
    spec = json.loads((artifact / "manifest.json").read_text())["spec"]
    ck = artifact_checkpoint(artifact, checkpoint)
    manifest, image_root, out, ck = (x.resolve() for x in (manifest, image_root, out, ck))   # the child runs in REPO
    cmd = [sys.executable, "-m", "evaluator.reference", str(manifest), str(image_root), str(out),
           "--model", spec["model"], "--input-size", str(spec["input_size"]), "--crop-mode", spec["crop_mode"],
           "--crop-pct", str(spec["crop_pct"]), "--checkpoint", str(ck)]
    if spec.get("model_kwargs"):
        cmd += ["--model-kwargs", json.dumps(spec["model_kwargs"])]
    _say(f"computing the reference with the artifact's spec ({spec['model']}, {spec['input_size']} px, "
         f"{spec['crop_mode']}, crop_pct {spec['crop_pct']}) from {ck} (python -m evaluator.reference)")
    r = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise Setup(f"the reference run failed with exit {r.returncode}: {r.stderr.strip()[-1000:]}")
    return out


def prepare_inputs(a: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, Path]:
    """(manifest, image_root, artifact, reference): --artifact [--cohort] [--reference], --prepared, or
    a fresh `python -m evaluator.demo prepare`."""
    if a.artifact is not None and a.prepared is None:
        if not (a.artifact / "manifest.json").is_file():
            raise Setup(f"--artifact {a.artifact}: no manifest.json there (not an artifact)")
        if a.cohort is not None:
            manifest = a.cohort / "manifest.tsv"
            if not manifest.is_file():
                raise Setup(f"--cohort {a.cohort}: no manifest.tsv there (image paths are relative to the folder)")
        else:
            from evaluator.synthetic.cohort import make_cohort

            _say(f"generating a cohort of {a.count} images in {work / 'cohort'} (evaluator.cohort)")
            make_cohort(work / "cohort", a.count, seed=0)
            manifest = work / "cohort" / "manifest.tsv"
        reference = a.reference or reference_for(a.artifact, manifest, manifest.parent, work / "reference.i32",
                                                 a.checkpoint)
        if not reference.is_file():
            raise Setup(f"--reference {reference}: not a file")
        return manifest, manifest.parent, a.artifact, reference
    src = a.prepared
    if src is None:
        src = work / "prepared"
        print(f"{PROG}: preparing a generated cohort in {src} (python -m evaluator.demo prepare)", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "evaluator.demo", "prepare", "--out", str(src), "--count",
                            str(a.count), "--backend", a.backend], cwd=REPO, stdout=subprocess.DEVNULL)
        if r.returncode:
            raise Setup(f"python -m evaluator.demo prepare failed with exit {r.returncode}")
    manifest, artifact = src / "cohort" / "manifest.tsv", a.artifact or src / "artifact"
    reference = a.reference or src / "reference.i32"
    for p in (manifest, artifact / "manifest.json", reference):
        if not p.is_file():
            raise Setup(f"missing {p}: --prepared needs cohort/, artifact/ and reference.i32 "
                        "(python -m evaluator.demo prepare --out DIR)")
    if a.reference is None and a.artifact is not None and (src / "artifact" / "manifest.json").is_file() \
            and preprocessing(a.artifact) != preprocessing(src / "artifact"):
        _say(f"{a.artifact} preprocesses differently from {src / 'artifact'}, whose spec made "
             f"{src / 'reference.i32'}: a new reference with the artifact's own spec")
        reference = reference_for(a.artifact, manifest, manifest.parent, work / "reference.i32", a.checkpoint)
    return manifest, manifest.parent, artifact, reference


def preprocessing(artifact: Path) -> dict:
    """The spec fields that decide the reference's answers (not precision or batch size)."""
    spec = json.loads((artifact / "manifest.json").read_text())["spec"]
    return {k: spec.get(k) for k in ("model", "input_size", "crop_mode", "crop_pct", "interpolation", "model_kwargs",
                                     "mean", "std")}


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


UNCHECKED_WITHOUT_ROOT = ("the switch to an unprivileged user (the run is your own user)",
                          "writes outside TMPDIR and the output folder in places your user may write "
                          "(only the rehearsal's copies and HOME are compared)",
                          "a mount namespace for an interpreter the scored user could not reach")


def _user_netns_works() -> bool:
    """True when this user may unshare a network namespace (`unshare -rn`: user namespaces allowed)."""
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


def rehearse(a: argparse.Namespace) -> dict:
    privileged = os.geteuid() == 0
    notes = []
    if privileged:
        if not shutil.which("setpriv"):
            raise Setup("setpriv (util-linux) is missing: cannot drop to an unprivileged user")
        net = bool(shutil.which("unshare")) and not a.allow_network
        uid = gid = a.uid
    else:
        net = not a.allow_network and _user_netns_works()
        uid, gid = os.geteuid(), os.getegid()
        for what in UNCHECKED_WITHOUT_ROOT:
            _say(f"not checked without root: {what}")
        notes += [f"not checked without root: {w}" for w in UNCHECKED_WITHOUT_ROOT]
    if not net:
        notes.append("network NOT isolated: " + ("--allow-network" if a.allow_network else
                                                 "unshare is missing" if privileged or not shutil.which("unshare")
                                                 else "unshare -rn is not allowed here (no user namespaces)"))
    work = Path(tempfile.mkdtemp(prefix="rehearse-", dir=a.workdir))
    os.chmod(work, 0o755)
    if not all(traversable(str(d), uid, gid) for d in work.parents):
        shutil.rmtree(work)
        raise Setup(f"uid {uid} cannot reach {work.parent}: pass --workdir a folder others can enter")
    summary: dict = {"workdir": str(work), "user": f"{uid}:{gid}", "home": HOME, "privileged": privileged}
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
            if privileged:
                os.chown(d, uid, gid)
        device = json.loads((art / "manifest.json").read_text()).get("device", "cpu")
        memory = a.memory
        if memory == "auto":
            memory = None if device == "cuda" else 16 << 30
            if device == "cuda":
                notes.append("no address-space bound: CUDA reserves huge virtual ranges (use --memory to force one)")
        summary["memory_limit_bytes"] = memory
        mounts = interpreter_mounts(uid, gid) if privileged else []
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
            if privileged:
                return user_command(cmd, env, uid, gid, memory, a.nproc, net, mounts, stage)
            lim = ["prlimit", f"--nproc={a.nproc}"] + ([f"--as={memory}"] if memory else []) + ["--"]
            return (["unshare", "-rn", "--"] if net else []) + lim + ["env", "-i", *[f"{k}={v}" for k, v in
                                                                       env.items()], *cmd]

        # Preflight: the user can run Python, cannot write the copies or HOME, can write TMPDIR and out
        # (the copies' modes bind an unprivileged user; a root run of the probe would write anything).
        writable_check = 'if [ "$(id -u)" != 0 ]; then for p in "$@"; do [ -w "$p" ] && echo "writable: $p"; done; fi; '
        probe = (writable_check + f'for p in {tmp} {out}; do [ -w "$p" ] || echo "not writable: $p"; done; '
                 f'[ -e {HOME} ] && echo "exists: {HOME}"; "$PYTHON" -c "import sys" || echo "python unreachable"')
        rc, so, se, _ = run_as_user(wrap(["sh", "-c", probe, "probe", str(repo), str(repo / "scripts"),
                                          str(art), str(inp), str(work), "/"]), 120)
        if rc or so.strip():
            raise Setup(f"preflight as uid {uid} failed (rc {rc}): {(so + se).strip()[-2000:]}")

        prune = [str(work)]
        t_scan = time.perf_counter()
        places = writable_places(uid, gid, prune) if privileged else None
        summary["writable_places"] = places["dirs"] if places else None
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
        outside = (writes_outside(places, uid, prune) if places else []) + diff(before, snapshot(work, (tmp, out)))
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
        summary["network"] = (f"isolated ({'unshare --net' if privileged else 'unshare -rn'})" if net
                              else "not isolated")
        summary["notes"] = notes
        summary["failures"] = failures
        summary["verdict"] = "FAIL" if failures else "PASS"
        return summary
    finally:
        if a.keep:
            print(f"{PROG}: kept {work}", file=sys.stderr)
        else:
            _remove(work)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine.backends import BACKENDS
    from engine.backends import DEFAULT as DEFAULT_BACKEND
    from engine.cli import MAX_DEADLINE_S, finite_float, parser, whole_number

    p = parser(PROG, __doc__.split("\n\n")[0], {
        "REHEARSE_RUN_CMD": "sh command run instead of scripts/run (as --run-cmd)",
        "ENGINE_DEBUG": "1: tracebacks instead of one-line errors"})
    p.add_argument("--artifact", type=Path, help="the artifact to rehearse (default: PREPARED/artifact, else one "
                                                 "prepared here on a generated cohort)")
    p.add_argument("--cohort", type=Path, help="with --artifact: a folder with manifest.tsv (paths relative to it); "
                                               "default: a generated cohort of --count images")
    p.add_argument("--reference", type=Path, help="reference .i32 (default: computed with the artifact's spec, or "
                                                  "PREPARED/reference.i32)")
    p.add_argument("--checkpoint", type=Path, help="with --artifact and no --reference: the FP32 checkpoint for the "
                                                   "reference (default: the one the artifact's manifest records)")
    p.add_argument("--prepared", type=Path, help="a dir made by `python -m evaluator.demo prepare` (used as is; "
                                                 "default: one prepared in a temporary folder)")
    p.add_argument("--count", type=whole_number(2, 100_000, "images"), default=120, help="generated cohort size (no --cohort, no --prepared)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND,
                   help="artifact backend when preparing (engine.backends)")
    p.add_argument("--uid", type=whole_number(1, 2**31 - 2), default=10001, help="unprivileged uid (and gid) to run as (the image's user)")
    p.add_argument("--memory", default="auto", help="address-space bound: auto (16G on CPU, none on CUDA), none, 8G")
    p.add_argument("--nproc", type=whole_number(1, 2**22, "processes"), default=4096, help="process+thread bound for the user (RLIMIT_NPROC)")
    p.add_argument("--gate", type=finite_float(0.0, 1.0, lo_open=True), default=GATE, help="agreement with the reference needed to pass")
    p.add_argument("--timeout", type=finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True), default=1800.0, help="seconds the run may take")
    p.add_argument("--run-cmd", default=evaluator_settings.rehearse_run_cmd(),
                   help="sh command run instead of scripts/run, with MANIFEST IMAGE_ROOT OUTPUT as $1..$3 "
                        "($REHEARSE_REPO is the code copy); env REHEARSE_RUN_CMD (default: scripts/run itself)")
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
    if a.cohort is not None and (a.artifact is None or a.prepared is not None):
        p.error("--cohort goes with --artifact (and not with --prepared)")
    if a.checkpoint is not None and (a.artifact is None or a.reference is not None):
        p.error("--checkpoint is for the reference of --artifact (not with --reference)")
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
