"""GPU check of the contest path: EVA-02-L/448 on generated JPEGs, per backend and precision.

    python scripts/device_bench.py --out DIR --json FILE [--count 2000] [--configs BACKEND:PRECISION,...]
        [--ref-count 2000] [--batch-size 64] [--budget-s 420] [--tiny] [--device cuda]

Steps, each timed: a generated cohort; an EVA-02 whose head is fit on generated renders
(trained-looking logits); the naive FP32 reference path (PIL + eager FP32, batch 1) on the
first --ref-count rows; then per config an untimed `engine.build` and a timed whole-process
`scripts/run`, with agreement against the reference and the run's own stage report.
Targets (from the GPU issue) are compared in the JSON. Configs after the first that would
start past --budget-s are skipped and say so. `--tiny --device cpu` runs the same logic on the tiny
test model (used by a CPU test of this script).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGETS = {"images_per_s": 600.0, "first_batch_s": 5.0, "agreement": 0.995, "speedup_vs_fp32_path": 40.0}


def gpu_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "machine": platform.machine(), "gpu": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["driver"] = f"unknown ({e})"
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("timm", "torchvision", "nvidia-dali-cuda130", "nvidia-dali-cuda120", "tensorrt", "cupy-cuda13x"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    return info


def _timed(cmd: list[str], env: dict | None = None, log: Path | None = None) -> tuple[int, float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if log is not None:
        log.write_text(r.stdout + r.stderr)
    return r.returncode, round(time.perf_counter() - t, 3), r.stderr[-1500:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--ref-count", type=int, default=2000)
    from engine import backends

    # every backend that runs a model, in bf16 (the contest's likely precision), then the default in fp16
    real = [b for b in backends.BACKENDS if backends.get(b).NEEDS_WEIGHTS]
    p.add_argument("--configs", default=",".join([f"{b}:bf16" for b in real] + [f"{real[0]}:fp16"]))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny test model instead of EVA-02-L/448")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    from evaluator.contest.agreement import agreement
    from evaluator.synthetic.cohort import (
        TINY_INPUT,
        TINY_KWARGS,
        TINY_MODEL,
        make_cohort,
        make_tiny_checkpoint,
    )

    model, kwargs, size = ((TINY_MODEL, TINY_KWARGS, TINY_INPUT) if a.tiny
                           else ("eva02_large_patch14_448.mim_m38m_ft_in22k_in1k", {}, 448))
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "system": gpu_info(), "model": model, "input_size": size,
                 "count": a.count, "targets": TARGETS, "steps": {}, "configs": []}

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        a.json.write_text(json.dumps(res, indent=1) + "\n")

    t = time.perf_counter()
    cohort = a.out / "cohort"
    make_cohort(cohort, a.count, seed=0, workers=max(1, (os.cpu_count() or 2) - 1))
    res["steps"]["cohort_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    ckpt = a.out / "model.safetensors"
    make_tiny_checkpoint(ckpt, seed=0, renders=6 if not a.tiny else 4, input_size=size, model=model,
                         model_kwargs=kwargs, device=a.device)
    res["steps"]["checkpoint_s"] = round(time.perf_counter() - t, 1)
    save()

    model_args = ["--model", model, "--input-size", str(size), "--crop-mode", "squash", "--crop-pct", "1.0",
                  "--model-kwargs", json.dumps(kwargs), "--checkpoint", str(ckpt)]
    rows = (cohort / "manifest.tsv").read_text().splitlines(keepends=True)
    n_ref = min(a.ref_count, len(rows))
    (a.out / "ref_manifest.tsv").write_text("".join(rows[:n_ref]))
    rc, wall, err = _timed([sys.executable, "-m", "evaluator.reference", str(a.out / "ref_manifest.tsv"), str(cohort),
                            str(a.out / "ref.i32"), *model_args, "--device", a.device], log=a.out / "reference.log")
    if rc != 0:
        res["error"] = f"reference path failed: {err}"
        save()
        return 1
    ref = np.fromfile(a.out / "ref.i32", "<i4")
    res["reference"] = {"images": n_ref, "wall_s": wall, "images_per_s": round(n_ref / wall, 2),
                        "distinct_top1": int(len(np.unique(ref[ref >= 0]))), "path": "PIL + timm eager FP32, batch 1"}
    save()

    for cfg in a.configs.split(","):
        backend, precision = cfg.split(":")
        entry: dict = {"backend": backend, "precision": precision, "batch_size": a.batch_size}
        res["configs"].append(entry)
        if len(res["configs"]) > 1 and time.perf_counter() - t_start > a.budget_s:  # the first always runs
            entry["skipped"] = f"budget of {a.budget_s} s spent"
            save()
            continue
        art = a.out / f"art_{backend}_{precision}"
        rc, entry["build_s"], err = _timed([sys.executable, "-m", "engine.build", *model_args, "--out", str(art),
                                            "--device", a.device, "--backend", backend, "--precision", precision,
                                            "--batch-size", str(a.batch_size)], log=a.out / f"build_{cfg}.log")
        if rc != 0:
            entry["error"] = f"build failed: {err}"
            save()
            continue
        pred, report = a.out / f"pred_{backend}_{precision}.i32", a.out / f"timing_{backend}_{precision}.json"
        env = {**os.environ, "ENGINE_ARTIFACT": str(art), "CONTEST_REPORT": str(report)}
        rc, entry["wall_s"], err = _timed([str(REPO / "scripts" / "run"), str(cohort / "manifest.tsv"), str(cohort),
                                           str(pred)], env=env, log=a.out / f"run_{cfg}.log")
        if rc != 0:
            entry["error"] = f"run failed: {err}"
            save()
            continue
        timing = json.loads(report.read_text())
        ag = agreement(np.fromfile(pred, "<i4")[:n_ref], ref)
        steady = timing["images"] / max(timing["stages"]["pipeline"], 1e-9)
        entry.update({
            "decoder": timing["decoder"], "device": timing["device"], "stages": timing["stages"],
            "first_batch_s": timing["first_batch_s"], "images_per_s_end_to_end": round(a.count / entry["wall_s"], 1),
            "images_per_s_steady": round(steady, 1), "agreement": f"{ag.matches}/{ag.total}",
            "agreement_rate": round(ag.rate, 5),
            "speedup_vs_fp32_path": round(steady / res["reference"]["images_per_s"], 1),
            "projected_10k_s": round(timing["stages"]["total"] - timing["stages"]["pipeline"] + 10000 / steady, 1),
        })
        entry["targets_met"] = {
            "images_per_s": steady >= TARGETS["images_per_s"],
            "first_batch_s": (timing["first_batch_s"] or 1e9) <= TARGETS["first_batch_s"],
            "agreement": ag.rate >= TARGETS["agreement"],
            "speedup_vs_fp32_path": entry["speedup_vs_fp32_path"] >= TARGETS["speedup_vs_fp32_path"],
        }
        save()
    save()
    print(json.dumps({c["backend"] + ":" + c["precision"]: c.get("images_per_s_steady", c.get("skipped", c.get("error")))
                      for c in res["configs"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
