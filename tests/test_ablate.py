"""python -m evaluator.ablate on the generated corpus with the tiny CLIP: one command runs every
method through scripts/run.sh's code, scores each with evaluator.cir.score, prints the
table and writes the JSON; a method that cannot run is reported, not fatal to the others."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from cir_helpers import REPO, clip_dirs, corpus
from cir_quality_helpers import p2w_index

from evaluator.cir.score import load_label_files, load_results, score

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
    table = r.stdout.splitlines()
    head = table[0].split()
    for col in ("circo", "mAP@5", "mAP@50", "cirr", "R@1", "R@50", "mean", "raw", "reward"):
        assert col in head
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
