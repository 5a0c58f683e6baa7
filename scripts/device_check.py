"""One-shot GPU check of the contest path, most valuable numbers first, JSON after every step.

    python3 scripts/device_check.py --out DIR [--limit-s 330] [--count 2000] [--ref-count 500]
        [--batch-size 64] [--tiny --device cpu]

Steps (each timed, each skipped with a reason when the time left cannot hold it):
 1. env          GPU, versions, which optional stacks are importable (DALI, TensorRT, open_clip, ...)
 2. cohort       generated JPEGs (no ImageNet data)
 3. checkpoint   EVA-02-L/448 whose head is fit on generated renders (trained-looking logits)
 4. aot_bf16     guarded AOT bf16 build, started in the background, while ...
 5. reference    ... the naive FP32 path (PIL + timm eager, batch 1) answers the first --ref-count rows
 6. abi_aot_bf16 the ABI end to end with it: images/s, agreement, GPU busy time, fixed costs,
                 CUDA graph status (a failed capture is an alarm), the guard's re-checks; then
                 the same artifact raw (ENGINE_GUARD=0): `guard` puts raw agreement, guarded
                 agreement, the re-checked fraction and the re-check seconds side by side
 7. eager_*      bf16, fp16 and fp8 through the eager backend (no compile), each guarded, end to
                 end, each also raw (the same side-by-side record)
 8. batch_sweep  policy bf16 inference alone at several batch sizes (CUDA events)
 9. attention    SDPA backends (flash, efficient, cudnn, math) at EVA-02-L's shape
10. topk         python -m kernels.topk: the CuPy kernel against torch.topk
11. gpu_tests    pytest -m gpu -rA, interrupted with SIGINT at its limit
Without a GPU (and without --device cpu) it writes a JSON that says so and exits 0 in seconds.
`--tiny --device cpu` runs every step's code on the tiny test model (a CPU test does this).
Outputs: DIR/device_check.json, DIR/gpu_tests.txt, DIR/logs.tar.gz (at most 8 files, plain names).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LIB_PROBES = {"dali": "nvidia.dali", "tensorrt": "tensorrt", "torch_tensorrt": "torch_tensorrt",
              "open_clip": "open_clip", "cupy": "cupy", "torchao": "torchao"}
LARGE = ("eva02_large_patch14_448.mim_m38m_ft_in22k_in1k", {}, 448)


class Check:
    """The result document, saved after every step; steps run against one deadline."""

    def __init__(self, out: Path, limit_s: float):
        self.out, self.t0, self.limit_s = out, time.perf_counter(), limit_s
        self.doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "status": "running", "steps": {},
                          "alarms": []}
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.out / "device_check.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.out / "device_check.json")

    def step(self, name: str, fn, need_s: float = 0.0) -> dict | None:
        """Run fn() -> dict as step `name` unless fewer than need_s seconds are left; record it either way."""
        if self.left() < need_s:
            self.doc["steps"][name] = {"skipped": f"{self.left():.0f} s left, the step needs ~{need_s:.0f} s"}
            self.save()
            return None
        t = time.perf_counter()
        try:
            res = fn() or {}
        except Exception as e:  # noqa: BLE001 - a failed step is recorded, the next one still runs
            res = {"error": f"{type(e).__name__}: {e}"[:600]}
        res["seconds"] = round(time.perf_counter() - t, 2)
        self.doc["steps"][name] = res
        self.save()
        print(f"device_check: {name}: {json.dumps(res)[:300]}", file=sys.stderr, flush=True)
        return res

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """A subprocess with its output in logs/NAME.log; TimeoutExpired becomes rc 124."""
        log = self.logs / f"{name}.log"
        try:
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
        except subprocess.TimeoutExpired as e:
            log.write_text(f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}")
            return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout:.0f} s")
        log.write_text(r.stdout + r.stderr)
        return r


def env_info(device: str) -> dict:
    import importlib.util

    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "device": device,
            "libs": {k: importlib.util.find_spec(m) is not None for k, m in LIB_PROBES.items()}}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
    return info


def judge(c: Check, name: str, art: Path, cohort: Path, ref, n_ref: int, count: int, env_extra=None) -> dict:
    """Run the ABI on the cohort with `art`; agreement on the reference rows and the run's own report."""
    import numpy as np

    from evaluator.contest.agreement import agreement

    pred, report = c.out / f"pred_{name}.i32", c.logs / f"timing_{name}.json"
    env = {**os.environ, "ENGINE_ARTIFACT": str(art), "CONTEST_REPORT": str(report), **(env_extra or {})}
    t = time.perf_counter()
    r = c.run(f"run_{name}", [str(REPO / "scripts" / "run"), str(cohort / "manifest.tsv"), str(cohort), str(pred)],
              timeout=c.left(), env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        return {"error": f"scripts/run failed ({r.returncode}): {r.stderr.strip()[-400:]}"}
    timing = json.loads(report.read_text())
    got = np.fromfile(pred, "<i4")
    pred.unlink()
    ag = agreement(got[:n_ref], ref)
    rt = timing.get("runtime") or {}
    steady = timing["images"] / max(timing["stages"]["pipeline"], 1e-9)
    res = {"wall_s": round(wall, 3), "images_per_s_end_to_end": round(count / wall, 1),
           "images_per_s_steady": round(steady, 1), "agreement": f"{ag.matches}/{ag.total}",
           "agreement_rate": round(ag.matches / max(ag.total, 1), 5), "decoder": timing.get("decoder"),
           "cuda_graph": rt.get("cuda_graph"), "gpu_busy_s": rt.get("gpu_busy_s"), "guard": rt.get("guard"),
           "stages": timing["stages"], "first_batch_s": timing.get("first_batch_s"),
           "projected_10k_s": round(timing["stages"]["total"] - timing["stages"]["pipeline"] + 10000 / steady, 1)}
    if str(res["cuda_graph"]).startswith("failed"):
        c.doc["alarms"].append(f"{name}: CUDA graph capture failed: {res['cuda_graph']}")
    return res


def judge_guarded(c: Check, name: str, art: Path, cohort: Path, ref, n_ref: int, count: int) -> dict:
    """judge() of a guarded artifact, then of the same artifact raw (ENGINE_GUARD=0), and the
    guard's figures side by side: does it pay for itself on this device?"""
    res = judge(c, name, art, cohort, ref, n_ref, count)
    g = res.get("guard")
    if "error" in res or not isinstance(g, dict):
        return res
    raw = judge(c, f"{name}_raw", art, cohort, ref, n_ref, count, {"ENGINE_GUARD": "0"})
    if "error" in raw:
        res["guard_side_by_side"] = {"error": raw["error"]}
        return res
    res["guard_side_by_side"] = {
        "raw_agreement": raw["agreement"], "guarded_agreement": res["agreement"],
        "raw_agreement_rate": raw["agreement_rate"], "guarded_agreement_rate": res["agreement_rate"],
        "rechecked_fraction": g["fraction"], "recheck_seconds": g["seconds"], "recheck_calls": g["calls"],
        "recheck_batch": g["recheck_batch"], "changed": g["changed"], "tau": g["tau"],
        "raw_wall_s": raw["wall_s"], "guarded_wall_s": res["wall_s"],
        "raw_images_per_s_steady": raw["images_per_s_steady"], "guarded_images_per_s_steady": res["images_per_s_steady"]}
    if raw["agreement_rate"] > res["agreement_rate"]:
        c.doc["alarms"].append(f"{name}: the guard lowered agreement ({raw['agreement']} raw, {res['agreement']} guarded)")
    return res


def build_cmd(model_args: list[str], out: Path, device: str, backend: str, precision: str, batch: int,
              *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine.build", *model_args, "--out", str(out), "--device", device,
            "--backend", backend, "--precision", precision, "--batch-size", str(batch), *extra]


def batch_sweep(model: str, kwargs: dict, size: int, ckpt: Path, device: str, batches: list[int]) -> dict:
    """Policy-bf16 eager inference alone per batch size (engine.build's measurement)."""
    from engine.build import measure_batch_size
    from engine.spec import resolve_spec

    spec = resolve_spec(model, input_size=size, crop_mode="squash", crop_pct=1.0, precision="bf16",
                        model_kwargs=kwargs)
    best, sweep = measure_batch_size(spec, ckpt, device, batches)
    return {"images_per_s": sweep["images_per_s"], "best": str(best)}


def attention_backends(device: str, batch: int, tokens: int, heads: int = 16, dim: int = 64) -> dict:
    """SDPA time per backend at [batch, heads, tokens, dim] bf16 (math only on the CPU)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    q, k, v = (torch.randn(batch, heads, tokens, dim, device=device, dtype=dtype) for _ in range(3))
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"] if device == "cuda" else ["MATH"]
    out = {}
    for n in names:
        try:
            with sdpa_kernel([getattr(SDPBackend, n)]):
                F.scaled_dot_product_attention(q, k, v)
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(5):
                    F.scaled_dot_product_attention(q, k, v)
                if device == "cuda":
                    torch.cuda.synchronize()
                out[n.lower()] = round((time.perf_counter() - t) / 5 * 1000, 3)
        except (RuntimeError, AttributeError) as e:
            out[n.lower()] = f"unavailable: {str(e)[:120]}"
    timed = {k: v for k, v in out.items() if isinstance(v, float)}
    return {"shape": [batch, heads, tokens, dim], "ms": out, "fastest": min(timed, key=timed.get) if timed else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/device_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit-s", type=float, default=330.0, help="deadline for every step together")
    p.add_argument("--count", type=int, default=2000, help="generated JPEGs")
    p.add_argument("--ref-count", type=int, default=500, help="rows the naive FP32 path answers")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny test model (rehearsal of every step on the CPU)")
    p.add_argument("--gpu-tests-s", type=float, default=90.0)
    p.add_argument("--calibration-count", type=int, default=256, help="images each guarded build chooses tau on")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    c = Check(a.out, a.limit_s)
    import torch

    c.doc["env"] = env_info(a.device)
    if a.device == "cuda" and not torch.cuda.is_available():
        c.doc["status"] = "no-gpu"
        c.doc["note"] = "torch sees no CUDA GPU: nothing measured (run with --tiny --device cpu to rehearse)"
        c.save()
        c.logs.rmdir()
        print("device_check: no CUDA GPU: wrote device_check.json saying so", file=sys.stderr)
        return 0
    try:
        return _steps(a, c)
    finally:
        with tarfile.open(a.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(c.logs, arcname="logs")
        subprocess.run(["rm", "-rf", str(c.logs)], check=False)
        c.doc["status"] = "alarm" if c.doc["alarms"] else "done"
        c.save()


def _steps(a: argparse.Namespace, c: Check) -> int:
    import numpy as np

    from evaluator.synthetic.cohort import (
        TINY_INPUT,
        TINY_KWARGS,
        TINY_MODEL,
        make_cohort,
        make_tiny_checkpoint,
    )

    model, kwargs, size = (TINY_MODEL, TINY_KWARGS, TINY_INPUT) if a.tiny else LARGE
    c.doc.update({"model": model, "input_size": size, "count": a.count, "batch_size": a.batch_size})
    work = c.out / "work"
    cohort, ckpt = work / "cohort", work / "model.safetensors"
    c.step("cohort", lambda: make_cohort(cohort, a.count, seed=0, workers=max(1, (os.cpu_count() or 2) - 1))
           and {"images": a.count})
    if not (cohort / "manifest.tsv").is_file():
        return 1
    c.step("checkpoint", lambda: {"recipe": make_tiny_checkpoint(ckpt, seed=0, renders=4 if a.tiny else 6,
                                                                   input_size=size, model=model,
                                                                   model_kwargs=kwargs, device=a.device)})
    if not ckpt.is_file():
        return 1
    model_args = ["--model", model, "--input-size", str(size), "--crop-mode", "squash", "--crop-pct", "1.0",
                  "--model-kwargs", json.dumps(kwargs), "--checkpoint", str(ckpt)]
    calib = ["--calibration-count", str(a.calibration_count)]
    from engine import backends

    main_backend = backends.DEFAULT
    aot_art = work / "art_aot_bf16"
    # the compiled build runs in the background while the naive reference answers its rows
    log = open(c.logs / "build_aot_bf16.log", "w")  # noqa: SIM115 - closed once the build is waited for
    t_build = time.perf_counter()
    build = subprocess.Popen(build_cmd(model_args, aot_art, a.device, main_backend, "bf16", a.batch_size, *calib,
                                       "--recheck-batch", "auto",
                                       "--recheck-backend", next(b for b in backends.BACKENDS if b != main_backend
                                                                 and not backends.get(b).COMPILED
                                                                 and backends.get(b).NEEDS_WEIGHTS)),
                             cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    rows = (cohort / "manifest.tsv").read_text().splitlines(keepends=True)
    n_ref = min(a.ref_count, len(rows))
    (work / "ref_manifest.tsv").write_text("".join(rows[:n_ref]))

    def reference() -> dict:
        t = time.perf_counter()
        r = c.run("reference", [sys.executable, "-m", "evaluator.reference", str(work / "ref_manifest.tsv"),
                                str(cohort), str(work / "ref.i32"), *model_args, "--device", a.device], c.left())
        if r.returncode != 0:
            raise RuntimeError(f"reference failed: {r.stderr.strip()[-300:]}")
        wall = time.perf_counter() - t
        ref = np.fromfile(work / "ref.i32", "<i4")
        return {"images": n_ref, "wall_s": round(wall, 2), "images_per_s": round(n_ref / wall, 2),
                "distinct_top1": int(len(np.unique(ref[ref >= 0]))), "path": "PIL + timm eager FP32, batch 1"}

    c.step("reference", reference)
    if not (work / "ref.i32").is_file():
        build.kill()
        return 1
    ref = np.fromfile(work / "ref.i32", "<i4")

    def wait_build() -> dict:
        try:
            rc = build.wait(timeout=max(c.left(), 1))
        except subprocess.TimeoutExpired:
            build.send_signal(signal.SIGINT)
            raise RuntimeError("the build did not finish before the deadline") from None
        finally:
            log.close()
        if rc != 0:
            raise RuntimeError(f"build failed ({rc}); see logs/build_aot_bf16.log")
        meta = json.loads((aot_art / "manifest.json").read_text())
        g = meta["guard"]
        return {"build_s": round(time.perf_counter() - t_build, 1), "tau": g["tau"],
                "budget_per_10k": g["budget_per_10k"], "estimated_per_10k": g["estimated_per_10k"],
                "expected_rechecked_fraction": g["rechecked_fraction"], "recheck_batch": g["recheck_batch"],
                "recheck_sweep": g.get("recheck_sweep"), "calibration": g["calibration"]["origin"],
                "calibration_disagreements": g["disagreements"], "backend": main_backend}

    if c.step("aot_bf16", wait_build) and (aot_art / "manifest.json").is_file():
        c.step("abi_aot_bf16", lambda: judge_guarded(c, "aot_bf16", aot_art, cohort, ref, n_ref, a.count), need_s=10)
    eager = next(b for b in backends.BACKENDS if not backends.get(b).COMPILED and backends.get(b).NEEDS_WEIGHTS)
    for prec in ("bf16", "fp16", "fp8"):
        def eager_step(prec=prec) -> dict:
            art = work / f"art_eager_{prec}"
            r = c.run(f"build_eager_{prec}", build_cmd(model_args, art, a.device, eager, prec, a.batch_size, *calib),
                      c.left())
            if r.returncode != 0:
                raise RuntimeError(f"build failed: {r.stderr.strip()[-300:]}")
            return {"backend": eager, **judge_guarded(c, f"eager_{prec}", art, cohort, ref, n_ref, a.count)}
        c.step(f"eager_{prec}", eager_step, need_s=30)
    batches = [8, 16] if a.tiny else [32, 64, 80, 128]
    c.step("batch_sweep", lambda: batch_sweep(model, kwargs, size, ckpt, a.device, batches), need_s=20)
    tokens = (size // 14) ** 2 + 1
    c.step("attention", lambda: attention_backends(a.device, 2 if a.tiny else a.batch_size, tokens), need_s=10)

    def topk() -> dict:
        small = ["--queries", "64", "--gallery", "5000", "--reps", "2"] if a.tiny else []
        r = c.run("topk", [sys.executable, "-m", "kernels.topk", *small], c.left())
        if r.returncode not in (0, 1):
            raise RuntimeError(f"kernels.topk failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        out["validated"] = r.returncode == 0
        return out

    c.step("topk", topk, need_s=15)

    def gpu_tests() -> dict:
        limit = min(a.gpu_tests_s, c.left() - 5)
        cmd = ["timeout", "-s", "INT", str(int(limit)), sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "-q",
               "-p", "no:cacheprovider", "tests"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        (c.out / "gpu_tests.txt").write_text(r.stdout[-20000:] + r.stderr[-5000:])
        tail = (r.stdout.strip().splitlines() or [""])[-1]
        return {"exit": r.returncode, "summary": tail, "interrupted": r.returncode in (124, 130, 2) and "passed" not in tail}

    c.step("gpu_tests", gpu_tests, need_s=20)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 1 if c.doc["alarms"] else 0


if __name__ == "__main__":
    sys.exit(main())
