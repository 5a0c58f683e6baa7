"""The contest ABI end to end: byte-checked output, row order, and every bad input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_abi

from engine.artifact import load_artifact
from engine.decoders import make_decoder
from engine.runtime import load_runtime
from evaluator.contest.manifest import read_manifest


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


def test_output_bytes_match_in_process_predictions(small_cohort, eager_artifact, tmp_path):
    out, report = tmp_path / "pred.i32", tmp_path / "timing.json"
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, eager_artifact, "--report", str(report))
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
    assert rep["images"] == n and rep["failed"] == len(broken)
    for k in ("imports", "artifact_load", "decode", "inference", "write", "total"):
        assert rep["stages"][k] >= 0
    assert rep["images_per_s"] > 0
    assert {e["stage"] for e in rep["timeline"]} == {"decode", "inference"}


def test_row_order_crlf_and_no_trailing_newline(small_cohort, eager_artifact, tmp_path):
    rows = (small_cohort / "manifest.tsv").read_text().splitlines()
    base = tmp_path / "base.i32"
    assert run_abi(small_cohort / "manifest.tsv", small_cohort, base, eager_artifact).returncode == 0
    ref = np.fromfile(base, "<i4")
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


@pytest.mark.parametrize("line,needle", [("no tab here", ":2:"), ("\tpath.JPEG", ":2:"), ("id\t", ":2:")])
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


def test_escaping_paths_are_never_opened(small_cohort, eager_artifact, tmp_path):
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
    r = run_abi(m, root, out, eager_artifact, timeout=120)
    assert r.returncode == 0, r.stderr
    watch()
    assert not opened
    pred = np.fromfile(out, "<i4")
    assert len(pred) == 7 and pred.min() >= 0 and pred.max() <= 999
    for rid in ("abs", "up", "deep", "sym"):
        assert any(f"({rid}," in line for line in r.stderr.splitlines()), rid


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


def test_a_crash_never_leaves_a_complete_looking_output(tmp_path, monkeypatch):
    from evaluator.contest import run as run_mod

    out = tmp_path / "p.i32"

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(run_mod.os, "fsync", boom)
    with pytest.raises(OSError):
        run_mod.write_predictions(out, np.arange(10, dtype=np.int32))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    run_mod.write_predictions(out, np.arange(10, dtype=np.int32))
    assert out.read_bytes() == np.arange(10, dtype="<i4").tobytes()


def test_killed_run_leaves_no_output(small_cohort, eager_artifact, tmp_path):
    out = tmp_path / "p.i32"
    env = {**os.environ, "ENGINE_ARTIFACT": str(eager_artifact)}
    p = subprocess.Popen([str(REPO / "scripts" / "run"), str(small_cohort / "manifest.tsv"), str(small_cohort), str(out)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = threading.Timer(2.5, p.kill)
    t.start()
    p.wait(timeout=300)
    t.cancel()
    if p.returncode == 0:
        pytest.skip("run finished before it could be killed")
    assert not out.exists()


def test_aot_run_imports_neither_timm_nor_the_compiler(small_cohort, aot_artifact, tmp_path):
    """Fixed costs: the AOT path loads a package, so timm / inductor / dynamo stay unimported."""
    code = ("import sys, evaluator.contest.run as r; "
            f"rc = r.main([{str(small_cohort / 'manifest.tsv')!r}, {str(small_cohort)!r}, "
            f"{str(tmp_path / 'p.i32')!r}, '--artifact', {str(aot_artifact)!r}]); "
            "print(rc, sorted(m for m in ('timm', 'torch._inductor', 'torch._dynamo') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.stdout.strip() == "0 []", r.stderr[-2000:]
