"""The GPU check script's logic, run on the CPU with the tiny model (the GPU run is the same code)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_device_bench_runs_on_cpu_with_the_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "device_bench.py"), "--out", str(tmp_path / "w"),
                        "--json", str(out), "--tiny", "--device", "cpu", "--count", "24", "--ref-count", "24",
                        "--configs", "eager:fp32,aot:fp32", "--batch-size", "8", "--budget-s", "1"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["reference"]["images"] == 24 and res["reference"]["images_per_s"] > 0
    eager, aot = res["configs"]
    assert "skipped" in aot and "budget" in aot["skipped"]  # the budget guard skips later configs
    assert eager["agreement_rate"] >= 0.95 and eager["device"] == "cpu"
    assert set(eager["targets_met"]) == {"images_per_s", "first_batch_s", "agreement", "speedup_vs_fp32_path"}
    assert res["system"]["torch"]
