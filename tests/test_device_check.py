"""The one-shot GPU check: without a GPU it ends in seconds with a JSON; on the CPU with the
tiny model it runs every step's code (the GPU run is the same code)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
import torch
from conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_it_ends_in_seconds_and_says_so(tmp_path):
    t = time.perf_counter()
    r = subprocess.run([str(REPO / "scripts" / "device_check.sh"), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t < 60
    doc = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert doc["status"] == "no-gpu" and "no CUDA GPU" in doc["note"] and doc["env"]["torch"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device_check.json"]


def test_cpu_rehearsal_runs_every_step(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "device_check.py"), "--out", str(out), "--tiny",
                        "--device", "cpu", "--count", "24", "--ref-count", "24", "--batch-size", "8",
                        "--limit-s", "900", "--gpu-tests-s", "60", "--calibration-count", "32"],
                       capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "device_check.json").read_text())
    steps = doc["steps"]
    assert list(steps) == ["cohort", "checkpoint", "reference", "aot_bf16", "abi_aot_bf16", "eager_bf16",
                           "eager_fp16", "eager_fp8", "batch_sweep", "attention", "topk", "gpu_tests"]
    assert not [n for n, s in steps.items() if "error" in s or "skipped" in s], steps
    abi = steps["abi_aot_bf16"]
    assert abi["agreement_rate"] >= 0.95 and abi["cuda_graph"] == "off" and abi["guard"]["images"] == 24
    assert steps["aot_bf16"]["tau"] >= 0 and steps["reference"]["images"] == 24
    assert steps["aot_bf16"]["estimated_per_10k"] <= steps["aot_bf16"]["budget_per_10k"]
    side = abi["guard_side_by_side"]                      # raw vs guarded, the re-checks' share and time
    assert side["guarded_agreement"] == abi["agreement"] and side["rechecked_fraction"] == abi["guard"]["fraction"]
    assert side["raw_agreement_rate"] >= 0.95 and side["recheck_seconds"] >= 0
    assert "guard_side_by_side" in steps["eager_bf16"]
    assert steps["eager_fp8"]["agreement_rate"] >= 0.5
    assert steps["attention"]["fastest"] == "math" and steps["topk"]["validated"]
    assert doc["status"] == "done" and not doc["alarms"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["device_check.json", "gpu_tests.txt", "logs.tar.gz"] and len(files) <= 8
    with tarfile.open(out / "logs.tar.gz") as t:
        names = t.getnames()
    assert any(n.endswith("build_aot_bf16.log") for n in names) and all(":" not in n for n in names)
