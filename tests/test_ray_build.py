"""The Ray Data gallery build (scripts/build.sh --ray) gives the single build's index: the same ids
in the same order, the same rows within FP16 rounding, the same search results; a build killed
mid-way and rerun (with or without --ray) equals an uninterrupted one; an actor's own error reaches
the user as one line; a SIGTERM leaves no Ray process or folder behind. One local Ray (2 CPUs)
serves the whole module; one test starts the build's own local Ray, to see what it leaves."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from cir_helpers import REPO, build_args, built_index, clip_dirs, corpus, script

pytestmark = pytest.mark.abi   # the Ray build (python -m evaluator.cir.build --ray) as whole processes

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install -r requirements/scale.txt)")


def test_ray_build_without_ray_is_one_clear_error(tmp_path, monkeypatch, capsys):
    from evaluator.cir import build as cir_build

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.setenv("CLIP_MODEL_DIR", str(clip_dirs()["open_clip"]))
    monkeypatch.setenv("CLIP_DEVICE", "cpu")
    assert cir_build.main([*build_args(tmp_path / "idx"), "--ray"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("scripts/build.sh: error: --ray needs Ray Data") and "pip install -e '.[scale]'" in last
    assert not (tmp_path / "idx" / "meta.json").exists()


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """One local Ray for the module; the builds (in-process and subprocess) join it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=200 * 1024 * 1024)
    addr = ray.get_runtime_context().gcs_address
    yield addr
    ray.shutdown()


def _ray_build(index_dir, env_extra: dict, **popen) -> subprocess.Popen:
    """The --ray build as a process in its own session; `env_extra`'s None values unset a variable."""
    env = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "CLIP_DEVICE": "cpu",
           "PYTHONPATH": str(REPO), **env_extra}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.Popen([sys.executable, "-m", "evaluator.cir.build", *build_args(index_dir), "--ray",
                             "--workers", "2"], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)


def _same_index(a, b) -> None:
    import json

    from engine.retrieval import open_index
    from engine.retrieval.index import load_index

    ia, ib = load_index(a), load_index(b)
    assert list(ia.ids) == list(ib.ids) and len(ia.ids) > 0
    ea, eb = np.asarray(ia.emb, np.float32), np.asarray(ib.emb, np.float32)
    assert ea.shape == eb.shape
    np.testing.assert_allclose(ea, eb, atol=2e-3, rtol=0)      # FP16 rounding of unit rows
    reqs = [json.loads(line) for line in (corpus() / "requests.jsonl").read_text().splitlines() if line.strip()]
    clip = clip_dirs()["open_clip"]
    ra = open_index(a, clip, device="cpu").search_many(reqs, 10)
    rb = open_index(b, clip, device="cpu").search_many(reqs, 10)
    assert len(ra) == len(reqs) and [[h["image_id"] for h in r] for r in ra] == [[h["image_id"] for h in r] for r in rb]


@needs_ray
def test_ray_build_gives_the_single_build_index(tmp_path, ray_address):
    p = _ray_build(tmp_path / "idx", {"RAY_ADDRESS": ray_address})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "chunk 6/6 done" in err or "6/6" in err, err[-2000:]
    _same_index(built_index(), tmp_path / "idx")


@needs_ray
def test_a_killed_ray_build_resumes_to_the_same_index(tmp_path, ray_address):
    idx = tmp_path / "idx"
    p = _ray_build(idx, {"RAY_ADDRESS": ray_address})
    deadline = time.monotonic() + 300        # generous: a busy machine starts Ray and its actors slowly
    while time.monotonic() < deadline and len(list((idx / ".build").glob("chunk-*.json"))) < 2:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    kept = len(list((idx / ".build").glob("chunk-*.json")))
    assert 2 <= kept < 6 and not (idx / "meta.json").exists()
    p = _ray_build(idx, {"RAY_ADDRESS": ray_address})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "resuming:" in err
    _same_index(built_index(), idx)


@needs_ray
def test_the_ray_build_embeds_with_the_towers_it_measured_and_records_them(tmp_path, ray_address):
    """CLIP_TOWERS=auto: the driver measures the towers once (engine.clip.tune) and records them in
    meta.json; every actor loads that choice, so the rows agree with eager FP32 as the choice was
    verified to (cosine >= 0.999 per row)."""
    import json

    from engine.retrieval.index import load_index

    # oneDNN held to AVX2: fp32 is the CPU's one native float precision, so the driver measures
    # eager/aot fp32 and int8 (two AOT compiles, not up to six; on this tiny CLIP bf16/fp16 lose on
    # their top-50 lists anyway): which precisions are measured is not what this test is about
    p = _ray_build(tmp_path / "idx", {"RAY_ADDRESS": ray_address, "CLIP_TOWERS": "auto", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert err.count("towers: measuring the candidates") == 1, err[-3000:]
    towers = json.loads((tmp_path / "idx" / "meta.json").read_text())["towers"]
    assert towers["mode"] == "auto" and towers["image"]["choice"]["backend"] in ("eager", "aot")
    ref, got = load_index(built_index()), load_index(tmp_path / "idx")
    assert list(ref.ids) == list(got.ids)
    cos = (np.asarray(ref.emb, np.float32) * np.asarray(got.emb, np.float32)).sum(axis=1)
    assert cos.min() >= 0.999 - 2e-3, cos.min()          # the verified criterion, less FP16 rounding


@needs_ray
def test_an_actor_error_reaches_the_user_as_our_one_line_and_nothing_is_left(tmp_path):
    """records.jsonl changes once the driver has read it (here: once the build's own local Ray
    starts): every actor's own check refuses it, and the user reads that refusal once, as one line
    (not Ray's ActorDiedError and its traceback), exit 1; no process of that Ray and no Ray folder
    is left behind."""
    src = corpus()
    folder = tmp_path / "corpus"
    folder.mkdir()
    rows = [json.loads(line) for line in (src / "records.jsonl").read_text().splitlines() if line.strip()]
    absolute = [{**r, "path": str(src / r["path"])} if isinstance(r.get("path"), str) else r for r in rows]
    records = folder / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in absolute))
    with _short_tmpdir() as tmp:
        env = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "CLIP_DEVICE": "cpu",
               "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
        env.pop("RAY_ADDRESS", None)
        p = subprocess.Popen([sys.executable, "-m", "evaluator.cir.build", "--corpus", str(folder),
                              *build_args(tmp_path / "idx")[2:], "--ray"], env=env, cwd=REPO,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and p.poll() is None and not list(tmp.glob("ray*")):
                time.sleep(0.05)
            with records.open("a") as f:        # the driver read the records before Ray started
                f.write(json.dumps({"image_id": "late", "path": absolute[0]["path"]}) + "\n")
            _, err = p.communicate(timeout=300)
            assert p.returncode == 1, err[-3000:]
            assert "Traceback" not in err and "ActorDiedError" not in err, err[-3000:]
            mine = [ln for ln in err.splitlines() if ln.startswith("scripts/build.sh:")]
            assert mine == [err.strip().splitlines()[-1]], err[-3000:]
            assert mine[0].startswith(f"scripts/build.sh: error: a Ray actor failed: {records} changed while the "
                                      "build ran"), mine
            _assert_nothing_left(p.pid, tmp)
            assert not (tmp_path / "idx" / "meta.json").exists()
        finally:
            _kill_group(p.pid)


@contextlib.contextmanager
def _short_tmpdir():
    """A TMPDIR of its own, short: a local Ray's socket paths under it are bounded."""
    import shutil

    tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _assert_nothing_left(pgid: int, tmp: Path) -> None:
    """No process of the build's process group runs (GCS, raylet, workers, agents) and no Ray folder
    is left in `tmp`."""
    left = _group_alive(pgid)
    for _ in range(50):          # what the build killed is gone before it exits; a moment of slack
        if not left:
            break
        time.sleep(0.1)
        left = _group_alive(pgid)
    assert left == [], left
    assert [f.name for f in tmp.iterdir() if f.name.startswith("ray")] == []


def _kill_group(pgid: int) -> None:
    for pid in _group_alive(pgid):
        os.kill(int(pid.split()[0]), signal.SIGKILL)


def _group_alive(pgid: int) -> list[str]:
    """The processes of process group `pgid` still running: 'pid name' each."""
    alive = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            comm, rest = (d / "stat").read_text().rsplit(") ", 1)
        except OSError:
            continue
        state, _, group = rest.split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            alive.append(f"{d.name} {comm.split('(', 1)[1]}")
    return alive


@needs_ray
def test_a_sigterm_mid_ray_build_leaves_nothing_behind_and_the_single_build_resumes_it(tmp_path):
    """SIGTERM to a --ray build that started its own local Ray: one line, exit 128 + 15, no process
    of its Ray left (GCS, raylet, workers, agents: its process group), no Ray folder in TMPDIR, the
    finished chunks kept; the single build (no --ray) resumes them to the clean build's index."""
    with _short_tmpdir() as tmp:
        idx = tmp_path / "idx"
        p = _ray_build(idx, {"RAY_ADDRESS": None, "TMPDIR": str(tmp)})
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and len(list((idx / ".build").glob("chunk-*.json"))) < 2:
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=60)
            assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
            assert err.strip().splitlines()[-1] == ("scripts/build.sh: interrupted (SIGTERM): finished chunks are "
                                                    "kept; the same command resumes the build"), err[-3000:]
            assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
            _assert_nothing_left(p.pid, tmp)
            kept = len(list((idx / ".build").glob("chunk-*.json")))
            assert kept >= 2 and not (idx / "meta.json").exists()
            r = script("build.sh", *build_args(idx), env={"TMPDIR": str(tmp)})
            assert r.returncode == 0, r.stderr[-3000:]
            assert "resuming:" in r.stderr
            _same_index(built_index(), idx)
        finally:
            _kill_group(p.pid)


@needs_ray
def test_a_killed_ray_driver_leaves_no_ray_process_or_folder(tmp_path):
    """kill -9 of a --ray build (no handler of ours runs): its guardian, told by the kernel, stops
    every process of its local Ray and removes its folder within seconds (Ray alone took 60-90 s
    and left the folder)."""
    with _short_tmpdir() as tmp:
        idx = tmp_path / "idx"
        p = _ray_build(idx, {"RAY_ADDRESS": None, "TMPDIR": str(tmp)})
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not list((idx / ".build").glob("chunk-*.json")):
                time.sleep(0.05)
            assert [f for f in tmp.iterdir() if f.name.startswith("ray")], "no local Ray folder to clean"
            p.kill()
            p.communicate(timeout=60)
            end = time.monotonic() + 30
            while time.monotonic() < end and (_group_alive(p.pid) or list(tmp.glob("ray*"))):
                time.sleep(0.2)
            _assert_nothing_left(p.pid, tmp)
        finally:
            _kill_group(p.pid)
