"""Each path of the compute-bound CPU workload as its own benchmark, one group per workload size,
so pytest-benchmark's table puts them side by side (with its relative column) and
`--benchmark-compare` matches a saved run path by path.

    python -m pytest tests/bench/test_bench_paths.py --benchmark-enable --benchmark-autosave
    ... change the kit ...
    python -m pytest tests/bench/test_bench_paths.py --benchmark-enable --benchmark-compare

Workloads (BENCH_WORKLOAD): `quick` (60 photo crops: an A/B loop of about 2 minutes on 2
cores, once prepared) and `full` (250 crops, tests/bench/test_bench_precision.py's cohort).
The model is timm's eva02_tiny_patch14_336 at full depth with a head fit on renders: the
network dominates, as it does for EVA-02-L/448. Paths, each a whole process in the kit's
environment (thread budget, OMP_WAIT_POLICY=PASSIVE):
    kit_auto      scripts/run on `engine.build --precision auto --batch-size auto --backend auto`
    kit_fp32      scripts/run on `engine.build --precision fp32` (aot, batch 16)
    kit_bf16      scripts/run on `engine.build --precision bf16` (guarded; slow where bf16 is emulated)
    naive         python -m evaluator.reference (PIL + timm eager FP32, batch 1)
    timm_batched  timm's transform, DataLoader batch 32, FP32 eager (tests/bench/timm_batched.py)
A path's rounds run one after another (pytest-benchmark times each benchmark on its own);
ratios that must be read from one run, alternated, come from test_bench_precision.py.
The saved JSON's machine_info names the CPU capability, torch and the thread budget
(tests/conftest.py). BENCH_PATHS=kit_auto,timm_batched runs a subset; BENCH_PREPARED=DIR
keeps checkpoint, cohorts and artifacts between runs (without it they live in one temporary
folder for the session, shared with test_bench_precision.py). The preparation says each step
on the terminal as it runs (tests/bench/prep_progress.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_abi
from prep_progress import Preparation, prepared_root
from test_bench_precision import BUILDS as ALT_BUILDS
from test_bench_precision import (
    COHORT_SEED,
    SPEC_ARGS,
    announce,
    artifact,
    checkpoint,
    photo_cohort,
    run_env,
)

pytestmark = pytest.mark.abi   # builds and scripts/run as whole processes, timed

WORKLOADS = {"quick": 60, "full": 250}
WORKLOAD = os.environ.get("BENCH_WORKLOAD", "quick")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
PATHS = ("kit_auto", "kit_fp32", "kit_bf16", "naive", "timm_batched")
CHOSEN = tuple(p for p in os.environ.get("BENCH_PATHS", ",".join(PATHS)).split(",") if p)
NAMES = {"kit_auto": "kit_auto", "kit_fp32": "kit_fp32", "kit_bf16": "kit"}   # the alternated benchmark's
BUILDS = {p: ALT_BUILDS[n] for p, n in NAMES.items()}                          # names: artifacts are shared


@pytest.fixture(scope="module")
def workload(request, tmp_path_factory):
    if request.config.getoption("benchmark_disable", True) and not request.config.getoption("benchmark_enable"):
        pytest.skip("compute-bound benchmark (minutes on two cores): run with --benchmark-enable")
    if WORKLOAD not in WORKLOADS:
        pytest.fail(f"BENCH_WORKLOAD must be one of {', '.join(WORKLOADS)}, got {WORKLOAD!r}")
    root, prep = prepared_root(tmp_path_factory), Preparation(request.config)
    cohort = root / f"photos_{WORKLOADS[WORKLOAD]}_seed{COHORT_SEED}"
    ref = cohort / "naive_reference.i32"
    announce(prep, root, [NAMES[p] for p in CHOSEN if p in BUILDS])
    ckpt = checkpoint(root, prep)
    if not (cohort / "manifest.tsv").is_file():
        with prep.step(f"writing {WORKLOADS[WORKLOAD]} photo crops -> {cohort.name}"):
            photo_cohort(cohort, WORKLOADS[WORKLOAD], COHORT_SEED)
    if not ref.is_file():   # the agreement every path is judged by: the naive FP32 path's answers
        with prep.step(f"answering {cohort.name} with the naive FP32 path", "a minute or more"):
            _naive(cohort, ckpt, ref, run_env())
    return {"root": root, "ckpt": ckpt, "cohort": cohort, "reference": ref, "prep": prep}


def _naive(cohort: Path, ckpt: Path, out: Path, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "evaluator.reference", str(cohort / "manifest.tsv"), str(cohort),
                    str(out), *SPEC_ARGS, "--checkpoint", str(ckpt)], check=True, capture_output=True, cwd=REPO,
                   env=env)




@pytest.mark.parametrize("path", PATHS)
def test_bench_path(benchmark, workload, path, tmp_path):
    if path not in CHOSEN:
        pytest.skip(f"not in BENCH_PATHS ({','.join(CHOSEN)})")
    benchmark.group = f"eva02-ti336 {WORKLOAD} ({WORKLOADS[WORKLOAD]} photo crops)"
    env, cohort, out = run_env(), workload["cohort"], tmp_path / "pred.i32"
    # built once, as test_bench_precision.py names it (shared in the session, kept by BENCH_PREPARED)
    art = artifact(workload["root"], NAMES[path], workload["ckpt"], workload["prep"]) if path in BUILDS else None

    def once() -> None:
        if path == "naive":
            _naive(cohort, workload["ckpt"], out, env)
        elif path == "timm_batched":
            subprocess.run([sys.executable, str(REPO / "tests" / "bench" / "timm_batched.py"),
                            str(cohort / "manifest.tsv"), str(cohort), str(out), *SPEC_ARGS, "--checkpoint",
                            str(workload["ckpt"]), "--batch-size", "32"], check=True, capture_output=True, cwd=REPO,
                           env=env)
        else:
            r = run_abi(cohort / "manifest.tsv", cohort, out, art, env=env, timeout=3600)
            assert r.returncode == 0, r.stderr[-2000:]

    t = time.perf_counter()
    benchmark.pedantic(once, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    want = np.fromfile(workload["reference"], "<i4")
    got = np.fromfile(out, "<i4")
    ok = want >= 0
    agreement = float((got[ok] == want[ok]).mean())
    info = {"path": path, "images": int(len(want)), "agreement_with_naive": round(agreement, 5),
            "rounds": ROUNDS, "seconds_all_rounds": round(time.perf_counter() - t, 2)}
    if art is not None:
        meta = json.loads((art / "manifest.json").read_text())
        info["artifact"] = {"precision": meta["precision"], "batch_size": meta["batch_size"],
                            "backend": meta["backend"], "chosen": meta["build"].get("search", {}).get("chosen")}
    benchmark.extra_info.update(info)
    assert len(got) == len(want) and agreement >= 0.995, f"{path} agrees on {agreement:.4f} of readable rows"
