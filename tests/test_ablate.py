"""python -m evaluator.ablate on the generated corpus with the tiny CLIP: one command runs every
method through scripts/run.sh's code, scores each with evaluator.cir.score, prints the
table and writes the JSON; a method that cannot run is reported, not fatal to the others."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from cir_helpers import REPO, built_index, clip_dirs, corpus
from cir_quality_helpers import p2w_index

from evaluator.cir.score import load_label_files, load_results, score

pytestmark = pytest.mark.abi   # python -m evaluator.ablate as whole processes

METHODS = ["slerp", "text-only", "pic2word", "slerp+gap+qbnorm", "sum+csls+aqe", "pic2word+reinspect:n=20"]


def test_ablate_runs_scores_and_tabulates_every_method(tmp_path):
    index = p2w_index()
    out_json, out_dir = tmp_path / "ablate.json", tmp_path / "runs"
    env = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "CLIP_DEVICE": "cpu"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "evaluator.ablate", "--index-dir", str(index),
                        "--queries", str(corpus() / "requests.jsonl"), "--labels", str(corpus() / "labels.jsonl"),
                        "--methods", ",".join([*METHODS, "no-such-method"]), "--json", str(out_json),
                        "--out-dir", str(out_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert r.returncode == 1, r.stderr[-3000:]                     # one method failed: said in the status
    assert wall < 60, wall
    legend, *table = r.stdout.splitlines()                         # the table last: its header, one row a method
    assert legend.startswith("CIRCO / CIRR metrics in percent") and len(table) == len(METHODS) + 2
    head = table[0].split()
    for col in ("method", "circo", "mAP@5", "mAP@50", "cirr", "R@1", "R@50", "mean", "raw", "reward", "q/s"):
        assert col in head
    assert not [ln for ln in r.stderr.splitlines() if "{" in ln], "a run's JSON summary on stderr (it is in --json)"
    assert f"every method's run and score report: {out_json}" in r.stderr
    for m in METHODS:
        assert any(line.startswith(m + " ") for line in table), m
    assert any(line.startswith("no-such-method") and "run failed (2)" in line for line in table)
    report = json.loads(out_json.read_text())
    assert [m["method"] for m in report["methods"]] == [*METHODS, "no-such-method"]
    labels = load_label_files([corpus() / "labels.jsonl"])
    for m in report["methods"][:-1]:
        want = score(load_results(m["output"]), labels)             # the scorer, run on the same output
        assert m["score"]["raw"] == want["raw"] and m["score"]["reward"] == want["reward"]
        assert set(m["score"]["sources"]) == {"circo", "cirr"}
        assert m["run"]["answered"] == 40 and m["run"]["method_label"] == m["method"]
    rows = {row["method"]: row for row in report["table"]}
    assert rows["slerp"]["circo mean"] == report["methods"][0]["score"]["sources"]["circo"]["mean_percent"]
    assert rows["pic2word+reinspect:n=20"]["status"] == "ok"
    assert report["methods"][-1]["score"] is None and rows["no-such-method"]["raw"] is None


def _ablate(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "CLIP_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-m", "evaluator.ablate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_default_set_runs_what_an_index_without_extras_supports(tmp_path):
    from evaluator.cir.ablate import DEFAULT_METHODS

    out_json, out_dir = tmp_path / "ablate.json", tmp_path / "runs"
    r = _ablate("--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
                "--labels", str(corpus() / "labels.jsonl"), "--json", str(out_json), "--out-dir", str(out_dir),
                "--warmup", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out_json.read_text())
    ran = [m["method"] for m in report["methods"]]
    needs_extras = {"pic2word", "pic2word+qbnorm", "slerp+isoftmax", "slerp+qbnorm", "slerp+dual-softmax",
                    "slerp+csls"}                               # a mapping / a text bank (the default hubness bank)
    assert ran == [m for m in DEFAULT_METHODS if m not in needs_extras]
    assert "slerp+reinspect:n=20" in ran                              # the corpus is recorded in the index
    assert all(m["run"]["answered"] == 40 and m["score"] is not None for m in report["methods"])
    left_out = next(line for line in r.stderr.splitlines() if "default set" in line)
    for m in needs_extras:
        assert m in left_out
    assert "no Pic2Word mapping" in left_out and left_out.count("left out:") == 2      # one reason per group
    assert ("hubness scoring with bank=gallery (the default) needs a query bank of gallery-derived texts, and the "
            "index has none: they are written from a Pic2Word mapping (scripts/build.sh --mapping pic2word") in left_out
    # the untimed warm-up ran the first method on the first 8 requests, before any timed method
    assert len((out_dir / ".warmup.jsonl").read_text().splitlines()) == 8
    assert r.stderr.index("warm-up") < r.stderr.index("method 1 of")
    assert report["warmup"] == 8


def test_a_named_method_the_index_cannot_run_is_skipped_with_its_reason(tmp_path):
    r = _ablate("--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
                "--labels", str(corpus() / "labels.jsonl"), "--methods", "pic2word,text-only",
                "--out-dir", str(tmp_path), "--json", str(tmp_path / "a.json"), "--warmup", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["method"]: row for row in json.loads((tmp_path / "a.json").read_text())["table"]}
    assert rows["pic2word"]["status"].startswith("skipped: the index has no Pic2Word mapping")
    assert rows["pic2word"]["raw"] is None and rows["text-only"]["status"] == "ok"
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("pic2word"))
    assert "(skipped: the index has no Pic2Word mapping" in line
    assert not (tmp_path / ".warmup.jsonl").exists()                   # --warmup 0: none


def test_bad_inputs_are_one_line_and_exit_2(tmp_path):
    base = ["--queries", str(corpus() / "requests.jsonl"), "--labels", str(corpus() / "labels.jsonl")]
    for args, words in [(["--index-dir", str(tmp_path / "nowhere"), *base], "no finished index"),
                        (["--index-dir", str(built_index()), "--queries", str(tmp_path / "q.jsonl"),
                          "--labels", str(corpus() / "labels.jsonl")], "queries file not found"),
                        (["--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
                          "--labels", str(tmp_path / "l.jsonl")], "l.jsonl")]:
        r = _ablate(*args, timeout=60)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("python -m evaluator.ablate: error: ") and words in lines[0]


def test_ablate_finds_the_clip_the_index_records(tmp_path):
    """An index built with CLIP_MODEL_DIR=X ablates without X exported again: no --model-dir, no
    CLIP_MODEL_DIR and no /task/models/clip leave the folder the index records (its digest
    matching), said once on stderr; a recorded folder that changed is not used, and says why."""
    from evaluator.cir import task

    if task.CLIP_DIR.exists():
        pytest.skip(f"{task.CLIP_DIR} exists here: the task's folder comes before the recorded one")
    recorded = json.loads((built_index() / "meta.json").read_text())["model"]["dir"]
    assert recorded == os.path.abspath(clip_dirs()["open_clip"])
    env = {k: v for k, v in os.environ.items() if k != "CLIP_MODEL_DIR"}
    args = ["--queries", str(corpus() / "requests.jsonl"), "--labels", str(corpus() / "labels.jsonl"),
            "--methods", "slerp,sum", "--warmup", "0", "--out-dir", str(tmp_path / "runs")]
    r = subprocess.run([sys.executable, "-m", "evaluator.ablate", "--index-dir", str(built_index()), *args],
                       cwd=REPO, env={**env, "CLIP_DEVICE": "cpu"}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "the one the index records" in ln]
    assert len(said) == 1 and recorded in said[0] and "/task/models/clip is missing" in said[0], r.stderr
    assert "CLIP model path not found" not in r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines()[2:4]] == ["slerp", "sum"]     # legend, header, rows
    # the recorded folder's weights changed since the build: not used, and the error is the old one
    moved = tmp_path / "index"
    shutil.copytree(built_index(), moved)
    clip = tmp_path / "clip"
    shutil.copytree(clip_dirs()["open_clip"], clip)
    meta = json.loads((moved / "meta.json").read_text())
    meta["model"]["dir"] = str(clip)
    (moved / "meta.json").write_text(json.dumps(meta))
    weights = next(p for p in clip.iterdir() if "model" in p.name and p.suffix in (".bin", ".safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))              # one bit of the weights changed
    r = subprocess.run([sys.executable, "-m", "evaluator.ablate", "--index-dir", str(moved), *args],
                       cwd=REPO, env={**env, "CLIP_DEVICE": "cpu"}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"the CLIP in {clip}, the folder the index records, changed since the build" in r.stderr
    assert "CLIP model path not found: /task/models/clip" in r.stderr
