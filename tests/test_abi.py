"""The contest ABI end to end: byte-checked output, row order, and every bad input."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_abi

from engine.classify.artifact import load_artifact
from engine.classify.runtime import load_runtime
from engine.decoders import make_decoder
from evaluator.contest.manifest import read_manifest

pytestmark = pytest.mark.abi   # scripts/run as whole processes


def _expected(manifest: Path, root: Path, artifact: Path, decoder: str = "dali-cpu") -> np.ndarray:
    """Predictions computed in-process, one batch at a time, without the pipeline."""
    art = load_artifact(artifact)
    rt = load_runtime(art)
    dec = make_decoder(decoder, art.spec, art.batch_size)
    rows = read_manifest(manifest)
    blobs = [(root / r.path).read_bytes() for r in rows]
    out = []
    for i in range(0, len(blobs), art.batch_size):
        arr, _ = dec.decode(blobs[i:i + art.batch_size])
        pad = np.zeros((art.batch_size,) + arr.shape[1:], np.uint8)
        pad[: len(arr)] = arr
        out.append(rt.run(pad)[: len(arr)])
    return np.concatenate(out)


def test_output_bytes_match_in_process_predictions(small_cohort, eager_artifact, plain_run):
    r, out, report = plain_run          # scripts/run MANIFEST IMAGE_ROOT OUTPUT --report FILE
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # nothing on stdout by default
    data = out.read_bytes()
    n = len(read_manifest(small_cohort / "manifest.tsv"))
    assert len(data) == 4 * n
    got = np.frombuffer(data, "<i4")
    assert got.min() >= 0 and got.max() <= 999
    want = _expected(small_cohort / "manifest.tsv", small_cohort, eager_artifact)
    assert data == want.astype("<i4").tobytes()
    # each unreadable row is named on stderr, once
    broken = [it for it in json.loads((small_cohort / "cohort.json").read_text())["items"]
              if it["encoding"].startswith("broken")]
    for it in broken:
        assert sum(it["request_id"] in line for line in r.stderr.splitlines()) == 1
    rep = json.loads(report.read_text())
    assert rep["images"] == rep["rows"] == n and rep["failed"] == len(broken) and rep["blank_lines_skipped"] == 0
    assert "warning" not in r.stderr                 # 3 of 40 unreadable: no summary line
    for k in ("imports", "artifact_load", "decode", "inference", "write", "total"):
        assert rep["stages"][k] >= 0
    assert rep["images_per_s"] > 0
    assert {e["stage"] for e in rep["timeline"]} == {"decode", "inference"}


def test_row_order_crlf_and_no_trailing_newline(small_cohort, eager_artifact, plain_run, tmp_path):
    rows = (small_cohort / "manifest.tsv").read_text().splitlines()
    base, plain, _ = plain_run                                    # the manifest as it is
    assert base.returncode == 0, base.stderr[-3000:]
    ref = np.fromfile(plain, "<i4")
    perm = np.random.default_rng(3).permutation(len(rows))
    m = tmp_path / "shuffled.tsv"
    m.write_bytes(("\r\n".join(rows[i] for i in perm)).encode())  # CRLF, no final newline
    out = tmp_path / "shuffled.i32"
    r = run_abi(m, small_cohort, out, eager_artifact)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.fromfile(out, "<i4"), ref[perm])


def test_defaults_from_contest_env(small_cohort, eager_artifact, tmp_path):
    out = tmp_path / "p.i32"
    env = {**os.environ, "ENGINE_ARTIFACT": str(eager_artifact), "CONTEST_MANIFEST": str(small_cohort / "manifest.tsv"),
           "CONTEST_IMAGE_ROOT": str(small_cohort), "CONTEST_OUTPUT": str(out)}
    r = subprocess.run([str(REPO / "scripts" / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size == 4 * len(read_manifest(small_cohort / "manifest.tsv"))


@pytest.mark.parametrize("line,needle", [("no tab here", ":2:"), ("\n\nno tab here", ":4:"),
                                         ("x\tpath.JPEG\rno tab", ":3:")])
def test_malformed_manifest_is_an_error_with_line_number(small_cohort, eager_artifact, tmp_path, line, needle):
    first = (small_cohort / "manifest.tsv").read_text().splitlines()[0]
    m = tmp_path / "bad.tsv"
    m.write_text(f"{first}\n{line}\n")
    out = tmp_path / "p.i32"
    r = run_abi(m, small_cohort, out, eager_artifact)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def _fifo_trap(path: Path):
    """A FIFO whose opening for read would block forever: proves a path is never opened."""
    os.mkfifo(path)
    opened = []

    def watch():  # a writer end that only succeeds if someone opens the FIFO for reading
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            opened.append(True)
            os.close(fd)
        except OSError:
            pass

    return watch, opened


@pytest.mark.parametrize("confine", [False, True])
def test_absolute_and_dotdot_paths_are_never_opened(small_cohort, eager_artifact, tmp_path, confine):
    """Absolute paths and `..` components are refused unopened; a symlink out of the root is
    followed (trusted staging) unless --confine refuses it unopened too."""
    root = tmp_path / "root"
    shutil.copytree(small_cohort / "images", root / "images")
    outside = tmp_path / "outside.JPEG"
    watch, opened = _fifo_trap(outside)
    (root / "link.JPEG").symlink_to(outside)
    good = (small_cohort / "manifest.tsv").read_text().splitlines()[:3]
    m = tmp_path / "m.tsv"
    m.write_text("\n".join(good + [f"abs\t{outside}", "up\t../outside.JPEG", "deep\timages/../../outside.JPEG",
                                   "sym\tlink.JPEG"]) + "\n")
    out = tmp_path / "p.i32"
    r = run_abi(m, root, out, eager_artifact, *(["--confine"] if confine else []), timeout=120)
    assert r.returncode == 0, r.stderr
    if confine:
        watch()
        assert not opened
    pred = np.fromfile(out, "<i4")
    assert len(pred) == 7 and pred.min() >= 0 and pred.max() <= 999
    lines = r.stderr.splitlines()
    for rid, why in (("abs", "absolute path refused"), ("up", "'..' component refused"),
                     ("deep", "'..' component refused"),
                     ("sym", "escapes IMAGE_ROOT" if confine else "a FIFO, not a regular file")):
        assert sum(f"({rid}," in line and why in line for line in lines) == 1, (rid, r.stderr)


def test_missing_or_corrupt_artifact_fails_before_any_image_is_read(small_cohort, eager_artifact, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    watch, opened = _fifo_trap(root / "trap.JPEG")
    m = tmp_path / "m.tsv"
    m.write_text("r1\ttrap.JPEG\n")
    out = tmp_path / "p.i32"
    r = run_abi(m, root, out, tmp_path / "nope", timeout=120)
    assert r.returncode == 2 and "artifact" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "corrupt"
    shutil.copytree(eager_artifact, bad)
    w = bad / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    r = run_abi(m, root, out, bad, timeout=120, env={"ENGINE_ARTIFACT_VERIFY": "sha256"})
    assert r.returncode == 2 and "SHA-256" in r.stderr
    watch()
    assert not opened and not out.exists()


def test_missing_image_and_unreadable_manifest(small_cohort, eager_artifact, tmp_path):
    m = tmp_path / "m.tsv"
    m.write_text("a\tdoes/not/exist.JPEG\n")
    out = tmp_path / "p.i32"
    r = run_abi(m, small_cohort, out, eager_artifact)
    assert r.returncode == 0 and "FileNotFoundError" in r.stderr
    assert 0 <= np.fromfile(out, "<i4")[0] <= 999
    r = run_abi(tmp_path / "absent.tsv", small_cohort, out, eager_artifact)
    assert r.returncode == 2 and "cannot read manifest" in r.stderr
    r = run_abi(m, small_cohort, tmp_path / "no" / "dir" / "p.i32", eager_artifact)
    assert r.returncode == 2 and "OUTPUT folder" in r.stderr


def test_killed_run_leaves_no_output(small_cohort, eager_artifact, tmp_path):
    """SIGKILL mid-run, every time: the test holds a write lease on the artifact's manifest.json,
    so the run's open of it (after the output is reserved) waits until the lease is released;
    the lease-break signal says the run got there."""
    art = tmp_path / "art"
    shutil.copytree(eager_artifact, art)
    out = tmp_path / "p.i32"
    broke: list[int] = []
    old = signal.signal(signal.SIGIO, lambda signum, frame: broke.append(signum))  # the lease-break notice
    fd = os.open(art / "manifest.json", os.O_RDONLY)
    try:
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_SETLEASE", 1024), fcntl.F_WRLCK)
        except OSError as e:
            pytest.skip(f"no file leases on this filesystem ({e.strerror}): the run cannot be held mid-way")
        p = subprocess.Popen([str(REPO / "scripts" / "run"), str(small_cohort / "manifest.tsv"), str(small_cohort),
                              str(out)], env={**os.environ, "ENGINE_ARTIFACT": str(art)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while not broke and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broke and p.poll() is None, p.stderr.read().decode(errors="replace")[-2000:]
        assert list(tmp_path.glob(".tmp-p.i32-*"))  # held after the output was reserved
        p.kill()
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETLEASE", 1024), fcntl.F_UNLCK)
        os.close(fd)
        signal.signal(signal.SIGIO, old)
    assert not out.exists()


def test_aot_run_imports_neither_timm_nor_the_compiler(small_cohort, aot_artifact, tmp_path):
    """Fixed costs: the AOT path loads a package, so timm / inductor / dynamo stay unimported."""
    code = ("import sys, evaluator.contest.run as r; "
            f"rc = r.main([{str(small_cohort / 'manifest.tsv')!r}, {str(small_cohort)!r}, "
            f"{str(tmp_path / 'p.i32')!r}, '--artifact', {str(aot_artifact)!r}]); "
            "print(rc, sorted(m for m in ('timm', 'torch._inductor', 'torch._dynamo') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.stdout.strip() == "0 []", r.stderr[-2000:]


def _trap_manifest(tmp_path: Path):
    """A one-row manifest whose image is a FIFO: opening it for reading would block."""
    root = tmp_path / "trap_root"
    root.mkdir()
    watch, opened = _fifo_trap(root / "trap.JPEG")
    m = tmp_path / "trap.tsv"
    m.write_text("r1\ttrap.JPEG\n")
    return m, root, watch, opened


def _one_error_line(r, needle: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.startswith("run: error:")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("field, value", [("input_size", 224), ("input_size", 96), ("batch_size", 8),
                                          ("crop_pct", 0.5), ("crop_mode", "center")])
def test_an_edited_artifact_manifest_is_refused_before_any_image_is_read(eager_artifact, tmp_path, field, value):
    art = tmp_path / "artifact"
    shutil.copytree(eager_artifact, art)
    meta = json.loads((art / "manifest.json").read_text())
    meta["spec"][field] = value
    if field == "batch_size":
        meta["batch_size"] = value
    (art / "manifest.json").write_text(json.dumps(meta, indent=2))
    m, root, watch, opened = _trap_manifest(tmp_path)
    out = tmp_path / "p.i32"
    r = run_abi(m, root, out, art, timeout=120)
    _one_error_line(r, "was changed after the build")
    watch()
    assert not opened and not out.exists()


@pytest.mark.parametrize("where", ["dir", "root", "missing"])
def test_a_bad_output_location_fails_before_any_image_is_read(eager_artifact, tmp_path, where):
    m, root, watch, opened = _trap_manifest(tmp_path)
    out = {"dir": tmp_path, "root": Path("/"), "missing": tmp_path / "no" / "p.i32"}[where]
    r = run_abi(m, root, out, eager_artifact, timeout=120)
    _one_error_line(r, "OUTPUT")
    watch()
    assert not opened


def test_a_stale_output_never_survives_a_failed_or_killed_run(small_cohort, eager_artifact, tmp_path):
    out = tmp_path / "p.i32"
    out.write_bytes(np.arange(40, dtype="<i4").tobytes())        # looks like a complete earlier answer
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, tmp_path / "no-artifact", timeout=120)
    assert r.returncode == 2 and not out.exists()
    out.write_bytes(np.arange(40, dtype="<i4").tobytes())
    env = {**os.environ, "ENGINE_ARTIFACT": str(eager_artifact)}
    p = subprocess.Popen([str(REPO / "scripts" / "run"), str(small_cohort / "manifest.tsv"), str(small_cohort),
                          str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while out.exists() and time.monotonic() < deadline:               # removed at start, before the model loads
        time.sleep(0.01)
    p.kill()
    p.wait(timeout=60)
    assert not out.exists()
    leftovers = [x.name for x in tmp_path.iterdir() if x.name.startswith(".tmp-p.i32-")]
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, eager_artifact)   # sweeps the killed run's temp
    assert r.returncode == 0 and out.stat().st_size == 160
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".tmp-p.i32-")], leftovers


@pytest.mark.parametrize("how", ["dev-full", "closed", "closed-pipe"])
def test_a_broken_stderr_or_stdout_does_not_change_the_result(small_cohort, eager_artifact, plain_run, tmp_path,
                                                             how):
    """Diagnostics are best effort: the run writes the same OUTPUT and exits 0 whatever stderr is."""
    plain, ref, _ = plain_run                                     # the same run with stderr as usual
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "p.i32"
    cmd = [str(REPO / "scripts" / "run"), str(small_cohort / "manifest.tsv"), str(small_cohort), str(out)]
    env = {**os.environ, "ENGINE_ARTIFACT": str(eager_artifact)}
    if how == "dev-full":
        with open("/dev/full", "w") as full:
            rc = subprocess.run(cmd, env=env, stdout=full, stderr=full, timeout=300).returncode
    elif how == "closed":
        rc = subprocess.run(["sh", "-c", '"$@" >&- 2>&-', "sh", *cmd], env=env, timeout=300).returncode
    else:
        rd, wr = os.pipe()
        os.close(rd)                               # every write to stderr fails with EPIPE
        try:
            rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=wr, timeout=300).returncode
        finally:
            os.close(wr)
    assert rc == 0
    assert out.read_bytes() == ref.read_bytes()


def test_the_scratch_folder_is_removed_and_killed_runs_folders_swept(small_cohort, aot_artifact, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp / f"eva-engine-run-{dead.pid}"                          # a killed run's unpacked package
    (stale / "aotinductor_x").mkdir(parents=True)
    (stale / "aotinductor_x" / "big.so").write_bytes(b"x" * 1000)
    other = tmp / "someone-elses"
    other.mkdir()
    out = tmp_path / "p.i32"
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, aot_artifact, env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp.iterdir()) == ["someone-elses"]


def test_a_live_runs_scratch_folder_is_never_swept_whatever_its_pid(small_cohort, aot_artifact, tmp_path):
    """Two containers sharing TMPDIR can both be PID 2: a folder is swept only when its owner lock can be
    taken. A live owner's (its .owner flocked by a running process) stays; an abandoned one goes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    live, gone = tmp / "eva-engine-run-live", tmp / "eva-engine-run-gone"
    for d in (live, gone):
        d.mkdir()
        (d / ".owner").write_bytes(b"")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
                               "time.sleep(600)", str(live / ".owner")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = tmp_path / "p.i32"
        r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, aot_artifact, env={"TMPDIR": str(tmp)})
        assert r.returncode == 0, r.stderr[-2000:]
        assert sorted(p.name for p in tmp.iterdir()) == ["eva-engine-run-live"]
    finally:
        holder.kill()
        holder.wait()


def test_an_unusable_tmpdir_is_one_warning_and_the_run_still_answers(small_cohort, aot_artifact, tmp_path):
    """The AOT graph is loaded from the artifact in place: a run needs no TMPDIR, and says it has none."""
    afile = tmp_path / "not-a-folder"
    afile.write_text("x")
    out = tmp_path / "p.i32"
    m = small_cohort / "manifest.tsv"
    r = run_abi(m, small_cohort, out, aot_artifact, env={"TMPDIR": str(afile)}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in r.stderr.splitlines() if "TMPDIR" in ln and "not writable" in ln]
    assert len(warned) == 1 and warned[0].startswith("run: warning:"), r.stderr[-3000:]
    assert out.stat().st_size == 4 * len([ln for ln in m.read_text().splitlines() if ln.strip()])


@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs prlimit")
def test_an_address_space_limit_below_the_need_is_one_line(small_cohort, eager_artifact, tmp_path):
    m, root, watch, opened = _trap_manifest(tmp_path)
    r = subprocess.run(["prlimit", f"--as={2 << 30}", "--", str(REPO / "scripts" / "run"), str(m), str(root),
                        str(tmp_path / "p.i32")], env={**os.environ, "ENGINE_ARTIFACT": str(eager_artifact)},
                       capture_output=True, text=True, timeout=120)
    _one_error_line(r, "address-space limit")
    watch()
    assert not opened


def test_out_of_memory_while_classifying_is_one_line(small_cohort, eager_artifact, tmp_path, monkeypatch, capsys):
    import engine.classify.pipeline
    from evaluator.contest import run as run_mod

    for var in ("TMPDIR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):   # main sets them
        monkeypatch.setenv(var, os.environ.get(var, str(tmp_path) if var == "TMPDIR" else "1"))
    monkeypatch.setenv("ENGINE_DECODER_ISOLATE", "0")

    def exhausted(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")

    monkeypatch.setattr(engine.classify.pipeline, "classify", exhausted)
    out = tmp_path / "p.i32"
    rc = run_mod.main([str(small_cohort / "manifest.tsv"), str(small_cohort), str(out),
                       "--artifact", str(eager_artifact)])
    err = capsys.readouterr().err
    assert rc == 2 and "run: error: out of memory" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob("eva-engine-run-*"))


def test_files_that_are_not_regular_or_too_large_get_a_prediction_and_a_line(small_cohort, eager_artifact, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(small_cohort / "images", root / "images")
    big = root / "big.JPEG"
    with open(big, "wb") as f:                     # sparse: its size is above the cap, nothing is read
        f.truncate(80 << 20)
    os.mkfifo(root / "fifo.JPEG")
    (root / "dir.JPEG").mkdir()
    (root / "empty.JPEG").write_bytes(b"")
    good = (small_cohort / "manifest.tsv").read_text().splitlines()[:2]
    m = tmp_path / "m.tsv"
    m.write_text("\n".join(good + ["big\tbig.JPEG", "fifo\tfifo.JPEG", "dir\tdir.JPEG", "empty\tempty.JPEG"]) + "\n")
    out = tmp_path / "p.i32"
    r = run_abi(m, root, out, eager_artifact, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    pred = np.fromfile(out, "<i4")
    assert len(pred) == 6 and pred.min() >= 0 and pred.max() <= 999
    for rid, what in [("big", "above the limit of 67108864 (ENGINE_MAX_FILE_BYTES)"), ("fifo", "a FIFO"),
                      ("dir", "a directory"), ("empty", "unreadable")]:
        assert sum(f"({rid}," in line and what in line for line in r.stderr.splitlines()) == 1, (rid, r.stderr)
    r = run_abi(m, root, out, eager_artifact, env={"ENGINE_MAX_FILE_BYTES": "1000"}, timeout=120)
    assert r.returncode == 0 and r.stderr.count("above the limit of 1000") == 3     # the two JPEGs and big


@pytest.mark.parametrize("var, value", [("ENGINE_THREADS", "0"), ("ENGINE_MAX_FILE_BYTES", "lots"),
                                        ("ENGINE_DECODER_ISOLATE", "sometimes"), ("ENGINE_ARTIFACT_VERIFY", "md5")])
def test_a_bad_switch_is_one_line(small_cohort, eager_artifact, tmp_path, var, value):
    m, root, watch, opened = _trap_manifest(tmp_path)
    r = run_abi(m, root, tmp_path / "p.i32", eager_artifact, env={var: value}, timeout=120)
    _one_error_line(r, var)
    watch()
    assert not opened


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to run as an unprivileged user")


@needs_root
def test_a_read_only_output_folder_fails_before_any_image_is_read(eager_artifact):
    import tempfile

    from evaluator.rehearsal.sandbox import interpreter_mounts, user_command

    base = Path(tempfile.mkdtemp(prefix="ro-output-"))                 # traversable by the unprivileged user
    try:
        base.chmod(0o755)
        m, root, watch, opened = _trap_manifest(base)
        ro, tmp, art = base / "ro", base / "tmp", base / "artifact"
        ro.mkdir()
        tmp.mkdir()
        os.chown(tmp, 65534, 65534)
        shutil.copytree(eager_artifact, art)
        subprocess.run(["chmod", "-R", "go+rX", str(base)], check=True)
        (base / "stage").mkdir()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "TMPDIR": str(tmp),
               "ENGINE_ARTIFACT": str(art), "PYTHON": sys.executable, "LANG": "C.UTF-8"}
        cmd = user_command([str(REPO / "scripts" / "run"), str(m), str(root), str(ro / "p.i32")], env, 65534, 65534,
                           None, 256, False, interpreter_mounts(65534, 65534), base / "stage")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        _one_error_line(r, "cannot write OUTPUT")
        watch()
        assert not opened
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_terminated_run_removes_its_scratch_folder_and_temp_output(small_cohort, aot_artifact, tmp_path):
    """SIGTERM once the AOT graph is loaded (its .so mapped from the artifact): the run's scratch
    folder and the reserved temp output are gone when the process has exited."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rows = (small_cohort / "manifest.tsv").read_text().splitlines()
    m = tmp_path / "long.tsv"
    m.write_text("\n".join(rows * 40) + "\n")                         # long enough to be caught mid-run
    out = tmp_path / "p.i32"
    env = {**os.environ, "ENGINE_ARTIFACT": str(aot_artifact), "TMPDIR": str(tmp)}
    p = subprocess.Popen([str(REPO / "scripts" / "run"), str(m), str(small_cohort), str(out)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    so = str((aot_artifact / "aot" / "model.so").resolve())

    def mapped() -> bool:
        try:
            return so in Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            return False
    while not mapped() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    if p.poll() is not None:
        pytest.skip("the run ended before it could be terminated")
    assert list(tmp_path.glob(".tmp-p.i32-*"))                        # the output is reserved
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 128 + signal.SIGTERM
    assert list(tmp.iterdir()) == [] and not out.exists() and not list(tmp_path.glob(".tmp-p.i32-*"))
