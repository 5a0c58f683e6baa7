"""Hostile inputs and bounded sandboxes: no file crashes, hangs or silently corrupts a run.

Every batch of the hostile cohort holds a header-only or header-bit-flipped JPEG, and the
cohort has a FIFO, a directory, an empty file and (as root) a device among its images.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_abi, tiny_spec
from hostile import header_only, hostile_cohort

from engine.decoders.pil import PilDecoder

NOBODY = 65534


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, small_cohort) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("hostile")
    return root, hostile_cohort(small_cohort, root, batch=16)


def _check_output(out: Path, n: int) -> np.ndarray:
    pred = np.fromfile(out, "<i4")
    assert len(pred) == n and pred.min() >= 0 and pred.max() <= 999
    return pred


@pytest.mark.abi
@pytest.mark.parametrize("isolate", ["1", "0"])
def test_hostile_cohort_three_runs_exit_0_with_one_answer_per_row(hostile, aot_artifact, tmp_path, isolate):
    """With the DALI CPU decoder in a child process (default) and in this process: the router keeps
    every file DALI cannot parse away from it, so no batch fails and no process crashes."""
    root, kinds = hostile
    rows = (root / "manifest.tsv").read_text().splitlines()
    preds = []
    for i in range(3):
        out = tmp_path / f"p{i}.i32"
        r = run_abi(root / "manifest.tsv", root, out, aot_artifact, env={"ENGINE_DECODER_ISOLATE": isolate},
                    timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        preds.append(_check_output(out, len(rows)))
        assert "batch of" not in r.stderr            # DALI never saw a file it fails on
        for rid, kind in kinds.items():
            if kind in ("fifo", "directory", "device", "empty"):
                line = [e for e in r.stderr.splitlines() if f"({rid}," in e]
                assert len(line) == 1 and "unreadable" in line[0], (kind, r.stderr[-2000:])
                if kind != "empty":
                    assert "not a regular file" in line[0]
    assert all(np.array_equal(preds[0], p) for p in preds[1:])


@pytest.mark.abi   # slow: 20 batches in two child processes
def test_dali_crashes_on_a_header_only_jpeg_fed_directly_but_not_through_the_router(small_cohort, tmp_path):
    """The issue's reproduction: 20 batches of 32, one header-only JPEG in each. Fed straight to a
    DALI CPU pipeline, a batch fails (and the process often segfaults); through DaliDecoder
    (routed) every batch decodes and the process exits 0."""
    import json

    items = json.loads((small_cohort / "cohort.json").read_text())["items"]
    good = [str(small_cohort / it["path"]) for it in items if it["encoding"].startswith("rgb")][:32]
    bad = tmp_path / "header_only.JPEG"
    bad.write_bytes(header_only(Path(good[0]).read_bytes()))
    code = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]
        from conftest import tiny_spec
        from engine.decoders.dali import DaliDecoder
        good = [open(p, 'rb').read() for p in {good!r}]
        good = (good * 32)[:32]
        bad = open({str(bad)!r}, 'rb').read()
        dec = DaliDecoder(tiny_spec(), 32, threads=2)
        direct = sys.argv[1] == 'direct'
        for b in range(20):
            blobs = list(good)
            blobs[b % 32] = bad
            if direct:
                n = len(blobs)
                try:
                    dec._run(blobs, [np.array([112, 112], np.float32)] * n, [np.array([0, 0], np.int64)] * n)
                except Exception:
                    print('raised', flush=True)
                    sys.exit(3)
            else:
                out, failed = dec.decode(blobs)
                assert sorted(failed) == [b % 32], failed
        print('done', flush=True)
    """)
    routed = subprocess.run([sys.executable, "-c", code, "routed"], capture_output=True, text=True, timeout=300)
    assert routed.returncode == 0 and "done" in routed.stdout, routed.stderr[-2000:]
    assert "batch of" not in routed.stderr
    direct = subprocess.run([sys.executable, "-c", code, "direct"], capture_output=True, text=True, timeout=300)
    assert direct.returncode in (3, -signal.SIGSEGV, -signal.SIGABRT), (direct.returncode, direct.stderr[-2000:])


CRASHY = '''
import os, signal
import numpy as np

def create(name, spec, batch_size, threads):
    return Crashy(spec)

class Crashy:
    name = "crashy"
    def __init__(self, spec):
        self.s = spec.input_size
    def decode(self, blobs):
        if any(b == b"CRASH" for b in blobs):
            os.kill(os.getpid(), signal.SIGSEGV)      # a native crash, as DALI's
        if any(b == b"HANG" for b in blobs):
            import time
            time.sleep(600)
        out = np.full((len(blobs), self.s, self.s, 3), 7, np.uint8)
        return out, {i: "not read" for i, b in enumerate(blobs) if b is None}
'''


@pytest.mark.abi   # slow: isolated decoder children that crash and restart
def test_a_crashing_isolated_decoder_costs_one_batch_not_the_run(tmp_path, monkeypatch, capfd):
    from engine.decoders.isolate import IsolatedDecoder

    (tmp_path / "crashy_decoder.py").write_text(CRASHY)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    spec = tiny_spec()
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (120, 90), (10, 200, 30)).save(buf, "JPEG")
    jpg = buf.getvalue()
    # the hanging batch waits out its whole deadline: short, yet far over the child's few ms a batch
    dec = IsolatedDecoder("crashy", "crashy_decoder", spec, 4, 1, deadline=lambda n: 8.0)
    try:
        a, failed = dec.decode([jpg, None, jpg])
        assert (a == 7).all() and failed == {1: "not read"}                 # the child's answer
        b, failed = dec.decode([jpg, b"CRASH", jpg])                         # the child dies
        ref, ref_failed = PilDecoder(spec, 4).decode([jpg, b"CRASH", jpg])
        assert np.array_equal(b, ref) and failed == ref_failed               # redone by the reference
        assert dec.crashes == 1
        c, _ = dec.decode([jpg])                                             # a fresh child answers
        assert (c == 7).all()
        t0 = time.perf_counter()
        d, _ = dec.decode([b"HANG", jpg])                                    # past its deadline: killed
        assert time.perf_counter() - t0 < 60 and dec.crashes == 2
        assert np.array_equal(d[1], ref[0])
        e, _ = dec.decode([jpg] * 9)                                         # larger than the slot: in pieces
        assert e.shape[0] == 9 and (e == 7).all()
    finally:
        dec.close()
    err = capfd.readouterr().err
    assert "the decoder process died (signal SIGSEGV)" in err and "no answer within 8 s" in err
    assert err.count("starting a fresh decoder process") == 2


def test_an_isolated_decoder_that_cannot_start_falls_back_to_pil(tmp_path, capfd):
    from engine.decoders.isolate import IsolatedDecoder

    spec = tiny_spec()
    dec = IsolatedDecoder("nothing", "no_such_decoder_module", spec, 4, 1)
    try:
        out, failed = dec.decode([b"not an image"])
        assert list(failed) == [0] and out.shape == (1, 112, 112, 3)
        assert dec.decode([None])[1] == {0: "not read"}
    finally:
        dec.close()
    assert "unavailable in its process" in capfd.readouterr().err


STUCK = '''
import time

def create(name, spec, batch_size, threads):
    time.sleep(3600)                                  # a pipeline build that never returns
'''


def test_an_isolated_decoder_whose_start_hangs_gives_way_to_pil_after_the_start_limit(tmp_path, monkeypatch,
                                                                                        capfd):
    """A child that never says it is ready costs HELLO_S once (then the PIL reference decodes, in a
    child of its own), not the run; the stuck child is killed."""
    import io

    from PIL import Image

    from engine.decoders import isolate
    from engine.decoders.isolate import IsolatedDecoder

    (tmp_path / "stuck_decoder.py").write_text(STUCK)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(isolate, "HELLO_S", 3.0)
    buf = io.BytesIO()
    Image.new("RGB", (120, 90), (10, 200, 30)).save(buf, "JPEG")
    spec = tiny_spec()
    dec = IsolatedDecoder("stuck", "stuck_decoder", spec, 4, 1)
    stuck = dec._proc
    try:
        t0 = time.perf_counter()
        out, failed = dec.decode([buf.getvalue(), None])
        took = time.perf_counter() - t0
        assert dec.name == "pil" and failed == {1: "not read"}
        assert np.array_equal(out[0], PilDecoder(spec, 4).decode([buf.getvalue()])[0][0])
    finally:
        dec.close()
    assert 3.0 <= took < 3.0 + 30.0, took                 # the start limit, then a PIL child's start
    assert stuck.poll() is not None                        # killed, not left sleeping
    err = capfd.readouterr().err
    assert err.count("decoder stuck unavailable in its process") == 1 and "using pil" in err, err


def test_the_isolated_dali_decoder_matches_the_in_process_one(small_cohort):
    import json

    from engine.decoders import make_decoder
    from engine.decoders.dali import DaliDecoder

    items = json.loads((small_cohort / "cohort.json").read_text())["items"]
    blobs = [(small_cohort / it["path"]).read_bytes() for it in items[:16]] + [None]
    iso = make_decoder("dali-cpu", tiny_spec(), 17, 2, isolate=True)
    try:
        assert getattr(iso, "isolated", False)
        got, failed = iso.decode(blobs)
    finally:
        iso.close()
    want, want_failed = DaliDecoder(tiny_spec(), 17, threads=2).decode(blobs)
    assert np.array_equal(got, want) and failed == want_failed
    assert not getattr(make_decoder("dali-cpu", tiny_spec(), 4, 1, isolate=False), "isolated", False)


def _tree_threads(pid: int) -> int:
    """Threads of `pid` and all its descendants, from /proc."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        total += len(tasks)
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    stack += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return total


@pytest.mark.abi
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_peak_thread_count_stays_within_the_documented_bound(small_cohort, aot_artifact, tmp_path, budget,
                                                             monkeypatch):
    from engine import settings, threads

    monkeypatch.setenv("ENGINE_THREADS", str(budget))
    bound = threads.budget("cpu").peak()
    settings.reload()
    env = {**os.environ, "ENGINE_ARTIFACT": str(aot_artifact), "ENGINE_THREADS": str(budget)}
    p = subprocess.Popen([str(REPO / "scripts" / "run"), str(small_cohort / "manifest.tsv"), str(small_cohort),
                          str(tmp_path / "p.i32")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while p.poll() is None:
        peak = max(peak, _tree_threads(p.pid))
        time.sleep(0.002)
    assert p.returncode == 0
    assert 0 < peak <= bound, (peak, bound)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("prlimit")),
                                reason="needs root, setpriv and prlimit to run as an unprivileged user")


@pytest.mark.abi
@needs_root
def test_hostile_cohort_as_nobody_under_nproc_16(small_cohort, aot_artifact):
    """The scored sandbox bounds PIDs: the whole run (threads and the child decoder included) fits
    in 16 tasks of the unprivileged user, 3 times of 3."""
    from evaluator.rehearsal.sandbox import interpreter_mounts, user_command

    base = Path(tempfile.mkdtemp(prefix="hostile-nobody-"))
    try:
        os.chmod(base, 0o755)
        data, art, out, tmp = base / "data", base / "artifact", base / "out", base / "tmp"
        hostile_cohort(small_cohort, data, batch=16)
        root = data
        shutil.copytree(aot_artifact, art)
        subprocess.run(["chmod", "-R", "go+rX", str(data), str(art)], check=True)
        for d in (out, tmp):
            d.mkdir()
            os.chown(d, NOBODY, NOBODY)
        (base / "stage").mkdir()
        n = len((root / "manifest.tsv").read_text().splitlines())
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "TMPDIR": str(tmp),
               "ENGINE_ARTIFACT": str(art), "PYTHON": sys.executable, "LANG": "C.UTF-8"}
        for i in range(3):
            cmd = user_command([str(REPO / "scripts" / "run"), str(data / "manifest.tsv"), str(data),
                                str(out / f"p{i}.i32")], env, NOBODY, NOBODY, None, 16, False,
                               interpreter_mounts(NOBODY, NOBODY), base / "stage")
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            _check_output(out / f"p{i}.i32", n)
        assert not list(tmp.iterdir()), "the run left scratch files in TMPDIR"
    finally:
        shutil.rmtree(base, ignore_errors=True)
