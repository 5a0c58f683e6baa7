"""The precision x batch-size sweep on a generated cohort: builds, runs the ABI, judges at the gate."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

pytestmark = pytest.mark.abi   # python -m evaluator.sweep, which builds and runs, as a whole process


def test_sweep_builds_runs_and_judges_each_precision(small_cohort, tiny_checkpoint, tmp_path):
    ref = tmp_path / "ref.i32"
    subprocess.run([sys.executable, "-m", "evaluator.reference", str(small_cohort / "manifest.tsv"),
                    str(small_cohort), str(ref), "--model", TINY_MODEL, "--input-size", str(TINY_INPUT),
                    "--crop-mode", "squash", "--crop-pct", "1.0", "--model-kwargs", json.dumps(TINY_KWARGS),
                    "--checkpoint", str(tiny_checkpoint)], check=True, capture_output=True, cwd=REPO)
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "evaluator.sweep", "--model", TINY_MODEL, "--checkpoint", str(tiny_checkpoint),
           "--manifest", str(small_cohort / "manifest.tsv"), "--image-root", str(small_cohort),
           "--reference", str(ref), "--precisions", "fp32,bf16", "--batch-sizes", "16", "--backend", "eager",
           "--out", str(out), "--json", str(tmp_path / "sweep.json"),
           f"--build-arg=--input-size={TINY_INPUT}", "--build-arg=--crop-mode=squash", "--build-arg=--crop-pct=1.0",
           f"--build-arg=--model-kwargs={json.dumps(TINY_KWARGS)}", "--build-arg=--calibration-count=32"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc == json.loads((tmp_path / "sweep.json").read_text())
    rows = len((small_cohort / "manifest.tsv").read_text().splitlines())
    unanswered = int((np.fromfile(ref, "<i4") < 0).sum())                # planted broken files
    assert "evaluation only" in doc["note"] and doc["rows"] == rows and unanswered >= 3
    by = {e["precision"]: e for e in doc["results"]}
    assert set(by) == {"fp32", "bf16"}
    fp32, bf16 = by["fp32"], by["bf16"]
    # the reference could not read the broken files: left out of the verdict, counted apart; over all
    # rows (the contest's gate, gate_all_rows) they are misses
    assert fp32["gate"]["rows"] == rows - unanswered and fp32["gate"]["matches"] == rows - unanswered
    assert fp32["gate"]["passed"] and fp32["gate"]["unreadable"] == unanswered
    assert fp32["gate_all_rows"]["rows"] == rows and fp32["gate_all_rows"]["matches"] == rows - unanswered
    assert fp32["agreement_answered"] == 1.0
    assert fp32["tau"] is None and fp32["rechecked_fraction"] is None
    assert bf16["tau"] >= 0 and bf16["agreement_answered"] >= 0.95    # tau 0: the budget holds without re-checks
    assert "precision" in r.stderr and "rechecked" in r.stderr          # the table
    timing = json.loads((out / bf16["timing_report"]).read_text())
    g = timing["runtime"]["guard"]
    assert g["images"] == rows and g["tau"] == bf16["tau"]
    assert bf16["rechecked_fraction"] == round(g["rechecked"] / g["images"], 6)   # re-checked / images
