"""One deadline per image, once: a JPEG that keeps a decoder busy (thousands of progressive scans)
costs at most one decode deadline, is never decoded again by another path, and a SIGTERM or
SIGINT ends the run within 2 s whatever the decoder is doing, leaving no OUTPUT or temp file."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, tiny_spec
from hostile import many_scans
from PIL import Image

# ~40 s of PIL work (5 ms a scan at 4096 px), ~1.3 MB: far past every deadline below
SLOW_COPIES = 8000


def _good(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (90, 120, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def slow_jpeg() -> bytes:
    return many_scans(4096, SLOW_COPIES)


def test_a_slow_image_costs_one_deadline_and_the_rest_of_its_batch_is_decoded(slow_jpeg, monkeypatch, capfd):
    from engine.decoders import make_decoder
    from engine.decoders.dali import DaliDecoder

    monkeypatch.setenv("ENGINE_DECODE_DEADLINE_S", "2")
    spec = tiny_spec()
    goods = [_good(s) for s in range(3)]
    dec = make_decoder("dali-cpu", spec, 5, 1, isolate=True)
    try:
        dec.decode([goods[0]])                                   # the child is up: only the batch is timed
        t0 = time.perf_counter()
        out, failed = dec.decode([goods[0], slow_jpeg, goods[1], None, goods[2]])
        took = time.perf_counter() - t0
        again, _ = dec.decode([goods[1]])                        # the fresh child serves the next batch
    finally:
        dec.close()
    assert sorted(failed) == [1, 3] and failed[3] == "not read"
    assert "not decoded within 2 s (ENGINE_DECODE_DEADLINE_S)" in failed[1]
    # one deadline, plus a fresh child's start: not the ~40 s the file needs, nor twice that
    assert 2.0 <= took < 2.0 + 20.0, took
    want, _ = DaliDecoder(spec, 3, threads=1).decode(goods)          # the same decoder, in this process
    assert all(np.array_equal(out[k], want[j]) for j, k in enumerate((0, 2, 4)))
    assert np.array_equal(again[0], out[2])
    err = capfd.readouterr().err
    assert err.count("image 1 of this batch is unreadable") == 1 and "starting a fresh decoder process" in err


def test_the_reference_beside_a_gpu_decoder_runs_in_a_child_under_the_deadline(slow_jpeg, monkeypatch):
    """dali-gpu and nvjpeg decode in this process; the images they route to PIL go to this child."""
    from engine.decoders.isolate import IsolatedDecoder, reference_decoder
    from engine.decoders.pil import PilDecoder

    monkeypatch.setenv("ENGINE_DECODE_DEADLINE_S", "2")
    spec = tiny_spec()
    good = _good(7)
    ref = reference_decoder(spec, 4, 2, isolate=True)
    try:
        assert isinstance(ref, IsolatedDecoder) and ref.name == "pil"
        ref.decode([good])
        t0 = time.perf_counter()
        out, failed = ref.decode([slow_jpeg, good])
        took = time.perf_counter() - t0
    finally:
        ref.close()
    assert list(failed) == [0] and "not decoded within 2 s" in failed[0]
    assert np.array_equal(out[1], PilDecoder(spec, 1, 1).decode([good])[0][0]) and not out[0].any()
    assert took < 2.0 + 20.0, took
    assert isinstance(reference_decoder(spec, 4, 2, isolate=False), PilDecoder)


def test_the_router_sends_a_jpeg_with_more_scans_than_dali_takes_to_the_reference(slow_jpeg):
    from engine.decoders.route import MAX_FAST_SCANS, jpeg_header, route

    assert jpeg_header(slow_jpeg).scans > MAX_FAST_SCANS
    fast, slow, failed = route([slow_jpeg], tiny_spec())
    assert fast == [] and slow == [0] and failed == {}


@pytest.fixture(scope="module")
def null_artifact(tmp_path_factory) -> Path:
    from engine.tuning import build

    out = tmp_path_factory.mktemp("null") / "artifact"
    build(tiny_spec(batch_size=4), None, out, backend="null", device="cpu")
    return out


@pytest.fixture(scope="module")
def slow_cohort(tmp_path_factory, slow_jpeg) -> Path:
    """6 rows, the slow JPEG at row 3, in batches of 4."""
    root = tmp_path_factory.mktemp("slow")
    (root / "img").mkdir()
    rows = []
    for i in range(6):
        name = "slow.JPEG" if i == 2 else f"g{i}.JPEG"
        (root / "img" / name).write_bytes(slow_jpeg if i == 2 else _good(i))
        rows.append(f"r{i}\timg/{name}")
    (root / "manifest.tsv").write_text("\n".join(rows) + "\n")
    return root


def _env(artifact: Path, **extra: str) -> dict:
    return {**os.environ, "ENGINE_ARTIFACT": str(artifact), "ENGINE_THREADS": "1", **extra}


@pytest.mark.abi
def test_a_run_answers_every_row_within_one_deadline(slow_cohort, null_artifact, tmp_path):
    out = tmp_path / "p.i32"
    t0 = time.perf_counter()
    r = subprocess.run([str(REPO / "scripts" / "run"), str(slow_cohort / "manifest.tsv"), str(slow_cohort), str(out)],
                       env=_env(null_artifact, ENGINE_DECODE_DEADLINE_S="3"), capture_output=True, text=True,
                       timeout=300)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(np.fromfile(out, "<i4")) == 6
    rows = [line for line in r.stderr.splitlines() if line.startswith("run: row")]
    assert len(rows) == 1 and "(r2, img/slow.JPEG): unreadable" in rows[0] and "ENGINE_DECODE_DEADLINE_S" in rows[0]
    assert took < 3.0 + 40.0, took          # start-up, one deadline, one fresh child; the file alone needs ~40 s


def _descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                stack += kids
        except OSError:
            pass
    return out


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) the process `pid` has spent; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_decoder(p: subprocess.Popen, err_file: Path, timeout: float = 180.0) -> int:
    """The process decoding the slow file once it has spent 8 s of CPU: the run's decoder child,
    or the run itself where its stderr says no child could start (imports and the pipeline take
    ~3-6 s of CPU; the file ~40 s). Fails with the run's stderr when the run ends first or when
    nothing gets that busy, so a failure names its cause."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            raise AssertionError(f"the run ended (rc {p.returncode}) before any decoder got busy:\n"
                                 + err_file.read_text(errors="replace")[-3000:])
        # the run itself decodes only after a line saying no child could start
        itself = [p.pid] if "in this process" in err_file.read_text(errors="replace") else []
        for c in [*_descendants(p.pid), *itself]:
            cpu = _cpu_s(c)
            if cpu is not None and cpu > 8.0:
                return c
        time.sleep(0.1)
    tree = {c: _cpu_s(c) for c in [p.pid, *_descendants(p.pid)]}
    raise AssertionError(f"no decoder got busy in {timeout:.0f} s; CPU seconds by pid {tree}; the run's stderr:\n"
                         + err_file.read_text(errors="replace")[-3000:])


@pytest.mark.abi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_decode_ends_the_run_within_2_s_leaving_nothing(slow_cohort, null_artifact, tmp_path, sig):
    out = tmp_path / "out" / "p.i32"
    out.parent.mkdir()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    err_file = tmp_path / "stderr.txt"           # a file, so a failure can show it while the run goes on
    with open(err_file, "wb") as err_sink:
        p = subprocess.Popen([str(REPO / "scripts" / "run"), str(slow_cohort / "manifest.tsv"), str(slow_cohort),
                              str(out)], env=_env(null_artifact, ENGINE_DECODE_DEADLINE_S="300", TMPDIR=str(scratch)),
                             stdout=subprocess.DEVNULL, stderr=err_sink, start_new_session=True)
    try:
        child = _busy_decoder(p, err_file)
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        rc = p.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = err_file.read_text(errors="replace")
    assert took < 2.0, (took, err[-2000:])
    assert rc in (128 + sig, -sig), (rc, err[-2000:])
    assert list(out.parent.iterdir()) == []                  # no OUTPUT, no temp file beside it
    assert list(scratch.iterdir()) == []                     # the run's scratch folder is gone
    end = time.monotonic() + 2.0
    while os.path.exists(f"/proc/{child}") and time.monotonic() < end:
        time.sleep(0.05)
    try:
        with open(f"/proc/{child}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z"), "the decoder child outlived the run by 2 s"
