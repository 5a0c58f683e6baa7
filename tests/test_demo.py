"""python -m evaluator.demo: says what it runs, measures both paths fresh and alternated, keeps
everything under --out, validates its flags."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.abi   # python -m evaluator.demo as whole processes

PROG = "python -m evaluator.demo"


def _demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_ARTIFACT", "CONTEST_REPORT")}
    return subprocess.run([sys.executable, "-m", "evaluator.demo", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [(["--count", "0"], "--count: must be a whole number in 2.."),
                                         (["--count", "1"], "--count: must be a whole number in 2.."),
                                         (["--count", "abc"], "--count: must be a whole number in 2.."),
                                         (["--repeats", "0"], "--repeats: must be a whole number in 1..20"),
                                         (["--batch-size", "0"], "--batch-size: must be a whole number in 1..1024")])
def test_bad_flags_exit_2_before_any_work(tmp_path, args, words):
    r = _demo("--out", str(tmp_path / "out"), *args, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{PROG}: error: ") and words in last, last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("var, value", [("ENGINE_DECODER", "foo"), ("ENGINE_READERS", "0"),
                                        ("ENGINE_READERS", "abc"), ("ENGINE_PROGRESS", "loud")])
def test_a_bad_engine_switch_exits_2_before_any_work(tmp_path, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    r = _demo("--out", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{PROG}: error: {var} must be"), last
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def demo_runs(tiny_checkpoint, tmp_path_factory):
    """Two demo runs on one --out: 12 images, eager artifact (the checkpoint is the session's, reused)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    out.mkdir()
    for suffix in (".safetensors", ".json"):   # prepare reuses a checkpoint whose recipe has the same seed
        shutil.copy(tiny_checkpoint.with_suffix(suffix), out / f"tiny_eva02{suffix}")
    default_art = REPO / "artifacts" / "default" / "manifest.json"
    before = default_art.stat().st_mtime_ns if default_art.exists() else None
    args = ("--out", str(out), "--count", "12", "--backend", "eager", "--batch-size", "4")
    first = _demo(*args)
    logs_after_first = {p.name: p.stat().st_mtime_ns for p in (out / "logs").glob("*-?.log")}
    second = _demo(*args)
    after = default_art.stat().st_mtime_ns if default_art.exists() else None
    return out, first, second, logs_after_first, (before, after)


def _summary(r: subprocess.CompletedProcess) -> tuple[list[str], dict]:
    text = r.stdout
    start = text.index("\n{") + 1
    return text[:start].splitlines(), json.loads(text[start:])


def test_first_lines_say_what_runs(demo_runs):
    out, first, _, _, _ = demo_runs
    assert first.returncode == 0, first.stderr[-3000:]
    lines, _ = _summary(first)
    assert lines[0].startswith("demo: the contest ABI against the naive FP32 reference")
    model = next(ln for ln in lines if ln.strip().startswith("model"))
    assert "eva02_tiny_patch14_224" in model and "4 blocks" in model and "112 px" in model
    assert "not EVA-02-L/448" in model
    cohort = next(ln for ln in lines if ln.strip().startswith("cohort"))
    assert "12 generated JPEGs" in cohort and "1 planted broken" in cohort and "expected" in cohort
    record = json.loads((out / "cohort" / "cohort.json").read_text())
    broken = [it["path"] for it in record["items"] if it["encoding"].startswith("broken:")]
    planted = next(ln for ln in lines if ln.strip().startswith("planted"))
    assert all(p in planted for p in broken) and "row " in planted
    assert any("99%" in ln and ln.strip().startswith("pass") for ln in lines)


def test_summary_before_json_and_fresh_alternated_timings(demo_runs):
    out, first, second, logs_after_first, _ = demo_runs
    for r in (first, second):
        assert r.returncode == 0, r.stderr[-3000:]
        lines, s = _summary(r)
        if r is second:
            assert s == json.loads((out / "demo.json").read_text())
        agree = next(ln for ln in lines if ln.startswith("agreement"))
        assert f"{s['agreement']}" in agree and "PASS at the 99% gate" in agree and "left out" in agree
        wall = next(ln for ln in lines if ln.startswith("wall time"))
        assert f"reference / optimized = {s['speedup_vs_reference']:.2f}x" in wall
        assert any(ln.startswith("optimized  imports") and "overlapped" in ln for ln in lines)
        assert len(s["reference_wall_s"]) == len(s["optimized_wall_s"]) == 2
        assert s["reference_wall_median_s"] == pytest.approx(statistics.median(s["reference_wall_s"]), abs=1e-3)
        assert s["optimized_wall_median_s"] == pytest.approx(statistics.median(s["optimized_wall_s"]), abs=1e-3)
        assert s["speedup_vs_reference"] == pytest.approx(
            s["reference_wall_median_s"] / s["optimized_wall_median_s"], abs=0.01)
        assert s["order"] == ["reference", "optimized", "reference", "optimized"]
        assert s["environment"]["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        assert s["planted_broken"] == 1 == s["unreadable_for_reference"] and s["unreadable_reported_by_run"] == [1, 1]
        assert s["images"] == 12 and s["verdict"] == "PASS"
    # every process of the second run is new (nothing timed is reused), and they ran alternated
    logs = {p.name: p.stat().st_mtime_ns for p in (out / "logs").glob("*-?.log")}
    assert set(logs) == {"reference-1.log", "reference-2.log", "optimized-1.log", "optimized-2.log"}
    assert all(logs[k] > logs_after_first[k] for k in logs)
    order = sorted(logs, key=logs.get)
    assert order == ["reference-1.log", "optimized-1.log", "reference-2.log", "optimized-2.log"]


def test_everything_stays_under_out(demo_runs):
    out, first, _, _, (before, after) = demo_runs
    assert first.returncode == 0, first.stderr[-3000:]
    _, s = _summary(first)
    for key in ("artifact", "predictions", "reference", "logs"):
        assert Path(s[key]).resolve().is_relative_to(out.resolve()), key
    assert (out / "artifact" / "manifest.json").is_file()
    assert before == after                              # artifacts/default untouched (or still absent)
    assert s["environment"]["TMPDIR"] == str(out.resolve() / "tmp")
    pred = (out / "predictions.i32").read_bytes()
    assert len(pred) == 4 * 12
