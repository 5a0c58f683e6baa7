"""Compute-bound CPU benchmark on natural photo crops: the kit's guarded bf16 build against its
raw form, the naive FP32 path and timm's batched FP32 pipeline, side by side.

    python -m pytest tests/bench/test_bench_precision.py --benchmark-enable --benchmark-json=bench.json

Model: timm's eva02_tiny_patch14_336 at full depth (12 blocks, 577 tokens) with a head fit
on generated renders, so its logits look trained: here the network, not JPEG decoding,
dominates, as it does for EVA-02-L/448. Cohort: BENCH_IMAGES JPEG crops (seed 7) of the
photographs scikit-image ships; the build's default calibration uses other crops (seed 1)
of the same photographs. No ImageNet data anywhere.

Paths, each a whole process with the same environment (OMP_WAIT_POLICY=PASSIVE and the
kit's thread budget: ENGINE_THREADS, OMP/MKL/OpenBLAS thread counts), alternated in a
rotating order for BENCH_ROUNDS rounds (BENCH_ALT_PATHS picks them, comma-separated):
    naive         python -m evaluator.reference (PIL + timm eager FP32, batch 1): the reference
    timm_batched  tests/bench/timm_batched.py (timm transform, DataLoader batch 32, workers 0, FP32)
    kit_auto      scripts/run on `engine.build` with precision, batch size and backend auto (the
                  default of ./build.sh: measured on this machine)
    kit_fp32      scripts/run on `engine.build --precision fp32 --batch-size 16` (aot)
    kit           scripts/run on `engine.build --precision bf16` (guarded)
    kit_raw       the same bf16 artifact with ENGINE_GUARD=0
Default: naive, timm_batched, kit_auto, kit_fp32, and kit + kit_raw where the CPU runs bf16
natively (engine.core.precision.native_precisions; elsewhere bf16 is emulated, minutes a run).
Reported (JSON on stderr and in the benchmark's extra_info): the CPU capability, wall
medians, agreement of each with the naive path, the ratios, and for the bf16 artifact the
guard's tau, re-checked fraction and time. Checked: every kit path's agreement passes the
gate's 99.5 %, and the re-checked fraction reported is re-checked / images over every row.
Skipped unless benchmarks are enabled: preparation takes minutes on two cores.
BENCH_PREPARED=DIR keeps the checkpoint, cohort and artifacts; BENCH_DEPTH shrinks the
model for a quick check that the benchmark runs.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_abi
from prep_progress import FIRST_RUN, Preparation, prepared_root

from engine.backends import DEFAULT as DEFAULT_BACKEND

pytestmark = pytest.mark.abi   # builds and scripts/run as whole processes, timed

MODEL = "eva02_tiny_patch14_336.mim_in22k_ft_in1k"
SIZE = 336
IMAGES = int(os.environ.get("BENCH_IMAGES", "250"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DEPTH = os.environ.get("BENCH_DEPTH")              # None: full depth
KWARGS = {"depth": int(DEPTH)} if DEPTH else {}
TAG = f"d{DEPTH}" if DEPTH else "full"             # in the names of the checkpoint and artifacts
GATE = 0.995
COHORT_SEED = 7                                     # calibration crops use seed 1
SPEC_ARGS = ["--model", MODEL, "--input-size", str(SIZE), "--crop-mode", "squash", "--crop-pct", "1.0",
             "--model-kwargs", json.dumps(KWARGS)]
ALL_PATHS = ("naive", "timm_batched", "kit_auto", "kit_fp32", "kit", "kit_raw")
BUILD_COST = {"kit_auto": "a measured search: up to 15 min", "kit_fp32": "an AOT compile: minutes",
              "kit": "calibration and an AOT compile: minutes"}
BUILDS = {"kit_auto": ["--precision", "auto", "--batch-size", "auto", "--backend", "auto"],
          "kit_fp32": ["--precision", "fp32", "--batch-size", "16", "--backend", DEFAULT_BACKEND],
          "kit": ["--precision", "bf16", "--batch-size", "16", "--backend", DEFAULT_BACKEND]}


def bench_paths() -> tuple[str, ...]:
    """BENCH_ALT_PATHS, else every path (the bf16 ones only where this CPU runs bf16 natively)."""
    if os.environ.get("BENCH_ALT_PATHS"):
        return tuple(p for p in os.environ["BENCH_ALT_PATHS"].split(",") if p)
    from engine.core.precision import native_precisions

    native = "bf16" in native_precisions("cpu")[0]
    return tuple(p for p in ALL_PATHS if native or p not in ("kit", "kit_raw"))


def photo_cohort(root: Path, count: int, seed: int) -> None:
    """`count` JPEG crops (quality 90) of scikit-image's photos and a manifest (id<TAB>path)."""
    from PIL import Image

    from engine.tuning.calibrate import augmented_crop, photo_sources

    photos = photo_sources()
    keys = sorted(photos)
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        crop = augmented_crop(photos[keys[int(rng.integers(len(keys)))]], rng)
        rel = f"images/photo_{i:05d}.jpg"
        Image.fromarray(crop).save(root / rel, "JPEG", quality=90)
        rows.append(f"p{i:05d}\t{rel}\n")
    (root / "manifest.tsv").write_text("".join(rows))


@pytest.fixture(scope="module")
def benchmark_enabled(request):
    if request.config.getoption("benchmark_disable", True) and not request.config.getoption("benchmark_enable"):
        pytest.skip("compute-bound benchmark (minutes on two cores): run with --benchmark-enable")


def checkpoint_path(root: Path) -> Path:
    return root / f"eva02_ti336_{TAG}.safetensors"


def checkpoint(root: Path, prep: Preparation) -> Path:
    """The full-depth (or BENCH_DEPTH) EVA-02-Ti/336 with its head fit on renders, made once in `root`."""
    from evaluator.synthetic.cohort import make_tiny_checkpoint

    ckpt = checkpoint_path(root)
    if not ckpt.is_file():
        with prep.step(f"fitting the head of {MODEL} ({TAG}) on generated renders -> {ckpt.name}", "minutes"):
            make_tiny_checkpoint(ckpt, model=MODEL, model_kwargs=KWARGS, input_size=SIZE, renders=6)
    return ckpt


def artifact(root: Path, name: str, ckpt: Path, prep: Preparation) -> Path:
    """The kit's build `name` of BUILDS in `root` (its own progress on the terminal), made once."""
    art = root / f"art_{name}_{TAG}"
    if not (art / "manifest.json").is_file():
        with prep.step(f"building {name} (python -m engine.build {' '.join(BUILDS[name])})", BUILD_COST[name]):
            subprocess.run([sys.executable, "-m", "engine.build", *SPEC_ARGS, "--checkpoint", str(ckpt), "--out",
                            str(art), *BUILDS[name]], check=True, cwd=REPO, env=run_env())
    return art


def announce(prep: Preparation, root: Path, builds: list[str]) -> None:
    """Where the preparation lives, and what a first run costs, when the checkpoint or one of
    `builds` is not there yet."""
    if not checkpoint_path(root).is_file() or any(not (root / f"art_{n}_{TAG}" / "manifest.json").is_file()
                                                  for n in builds):
        keep = "" if os.environ.get("BENCH_PREPARED") else "; BENCH_PREPARED=DIR keeps it for the next run"
        prep.say(f"preparing in {root} (a first run: {FIRST_RUN}{keep})")


@pytest.fixture(scope="module")
def prepared(benchmark_enabled, request, tmp_path_factory):
    root, prep = prepared_root(tmp_path_factory), Preparation(request.config)
    names = list(dict.fromkeys("kit" if p == "kit_raw" else p for p in bench_paths() if p != "naive"))
    names = [n for n in names if n in BUILDS]
    cohort = root / f"photos_{IMAGES}_seed{COHORT_SEED}"
    announce(prep, root, names)
    ckpt = checkpoint(root, prep)
    if not (cohort / "manifest.tsv").is_file():
        with prep.step(f"writing {IMAGES} photo crops -> {cohort.name}"):
            photo_cohort(cohort, IMAGES, COHORT_SEED)
    arts, build_s = {}, {}
    for name in names:
        t = time.perf_counter()
        arts[name] = artifact(root, name, ckpt, prep)
        build_s[name] = round(time.perf_counter() - t, 1)
    return {"ckpt": ckpt, "cohort": cohort, "artifacts": arts, "build_s": build_s}


def run_env() -> dict:
    """The one environment every path runs in: the kit's thread budget and OpenMP wait policy."""
    from engine import threads

    b = threads.budget("cpu")
    return {**os.environ, **threads.library_env(b), "OMP_WAIT_POLICY": "PASSIVE", "ENGINE_THREADS": str(b.total)}


def test_bench_kit_vs_raw_naive_and_timm_batched(benchmark, prepared, tmp_path):
    import torch

    cohort, arts, ckpt = prepared["cohort"], prepared["artifacts"], prepared["ckpt"]
    paths = bench_paths()
    env = run_env()
    manifest = cohort / "manifest.tsv"
    out = {p: tmp_path / f"{p}.i32" for p in paths}
    reports = {p: tmp_path / f"{p}_timing.json" for p in paths if p.startswith("kit")}
    walls: dict[str, list[float]] = {p: [] for p in paths}

    def run(path: str) -> None:
        t = time.perf_counter()
        if path == "naive":
            subprocess.run([sys.executable, "-m", "evaluator.reference", str(manifest), str(cohort), str(out[path]),
                            *SPEC_ARGS, "--checkpoint", str(ckpt)], check=True, capture_output=True, cwd=REPO,
                           env=env)
        elif path == "timm_batched":
            subprocess.run([sys.executable, str(REPO / "tests" / "bench" / "timm_batched.py"), str(manifest),
                            str(cohort), str(out[path]), *SPEC_ARGS, "--checkpoint", str(ckpt), "--batch-size", "32"],
                           check=True, capture_output=True, cwd=REPO, env=env)
        else:
            art = arts["kit" if path == "kit_raw" else path]
            extra = {"CONTEST_REPORT": str(reports[path]), **({"ENGINE_GUARD": "0"} if path == "kit_raw" else {})}
            r = run_abi(manifest, cohort, out[path], art, env={**env, **extra}, timeout=3600)
            assert r.returncode == 0, r.stderr[-2000:]
        walls[path].append(time.perf_counter() - t)

    rounds = iter(range(ROUNDS))

    def one_round() -> None:  # every path once, the order rotated each round
        k = next(rounds)
        for path in paths[k % len(paths):] + paths[: k % len(paths)]:
            run(path)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)

    want = np.fromfile(out["naive"], "<i4")
    readable = want >= 0
    agree = {p: float((np.fromfile(out[p], "<i4")[readable] == want[readable]).mean())
             for p in paths if p != "naive"}
    med = {p: statistics.median(v) for p, v in walls.items()}
    peers = [med[p] for p in ("naive", "timm_batched") if p in med]
    fastest_peer = min(peers)
    info = {
        "model": MODEL, "model_kwargs": KWARGS, "images": int(len(want)), "readable": int(readable.sum()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cohort": f"scikit-image photo crops, seed {COHORT_SEED} (calibration: other crops, seed 1)",
        "rounds": ROUNDS, "env": {k: env[k] for k in ("OMP_WAIT_POLICY", "ENGINE_THREADS", "OMP_NUM_THREADS")},
        "wall_median_s": {p: round(v, 3) for p, v in med.items()},
        "wall_s": {p: [round(x, 3) for x in v] for p, v in walls.items()},
        "agreement_with_naive": {p: round(v, 5) for p, v in agree.items()},
        "speedup_vs_fastest_peer": {p: round(fastest_peer / med[p], 3) for p in paths if p.startswith("kit")},
        "build_s": prepared["build_s"]}
    for p, art in arts.items():
        meta = json.loads((art / "manifest.json").read_text())
        info.setdefault("artifacts", {})[p] = {"precision": meta["precision"], "batch_size": meta["batch_size"],
                                               "backend": meta["backend"],
                                               "chosen": meta["build"].get("search", {}).get("chosen")}
    if "kit" in paths:
        kit = json.loads(reports["kit"].read_text())["runtime"]["guard"]
        meta = json.loads((arts["kit"] / "manifest.json").read_text())["guard"]
        info.update({"tau": meta["tau"], "guard_budget_per_10k": meta["budget_per_10k"],
                     "expected_rechecked_fraction": meta["rechecked_fraction"], "rechecked_fraction": kit["fraction"],
                     "rechecked": kit["rechecked"], "changed": kit["changed"], "recheck_seconds": kit["seconds"],
                     "recheck_calls": kit["calls"]})
        assert kit["images"] == len(want)
        assert kit["fraction"] == round(kit["rechecked"] / kit["images"], 6) and kit["changed"] <= kit["rechecked"]
        assert kit["tau"] == meta["tau"] and kit["calls"] == -(-kit["rechecked"] // kit["recheck_batch"])
        if "kit_raw" in paths:
            raw = json.loads(reports["kit_raw"].read_text())["runtime"]["guard"]
            assert raw == "off (ENGINE_GUARD=0): raw low-precision answers"
            info["guard_overhead"] = round(med["kit"] / med["kit_raw"] - 1, 4)
    benchmark.extra_info.update(info)
    print(json.dumps(info), file=sys.stderr)
    # what the benchmark reports, checked: every kit path holds the gate
    for p in paths:
        if p.startswith("kit") and p != "kit_raw":
            assert agree[p] >= GATE, f"{p} agrees on {agree[p]:.4f} of readable rows, under the gate"
    assert all(len(v) == ROUNDS for v in walls.values())
