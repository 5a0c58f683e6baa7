"""One-shot GPU check of the contest path: the most valuable facts first, whatever happens.

    python3 scripts/device_check.py --out DIR [--limit-s 500] [--count 2000] [--ref-count 500]
        [--batch-size N] [--calibration-count 64] [--search-budget-s 90] [--gpu-tests-s 90]
        [--tiny --device cpu]

The steps run in PLAN's order (below, with what each tells): the driver, the CUDA headers, the
eager bf16 ABI figure and its agreement, the AOT build and its CUDA-graph ABI figure, and only
then the search, the probes and the rest. Each is timed, reads "running" while under way, is
written the moment it ends into DIR/device_check.json and as a line of DIR/results.jsonl (both
whole and fsynced: a kill, even SIGKILL, keeps every result reached), has its own timeout (its
share of --limit-s, at most the time left) and is skipped with a reason when the time left
cannot hold it. Two run in the background: the cohort's rendering (from the start) and the
guarded AOT bf16 build (from the checkpoint on), whose phases (export, lowering, C++ compile,
load, first call) land in DIR/aot_phases.json as each ends and whose CUDA_HOME is the image's
layout when its headers compile.
The JSON ends with `not_run` (steps of the plan that never started) and `not_exercised` (what
of the scored setup, ARM64 + Hopper, the Dockerfile's Python and requirements/lock.txt, this
run did not exercise). Work files (checkpoint, artifacts, cohort, predictions) live in a
private folder under $TMPDIR, removed at the end and on SIGTERM/SIGINT (after the JSON is
saved). Outputs, small and plain: DIR/device_check.json, DIR/results.jsonl, DIR/aot_phases.json,
DIR/device_check.log (each child's output, tail-kept), DIR/gpu_tests.txt. Without a GPU (and
without --device cpu) it writes a JSON that says so and exits 0 in seconds. `--tiny --device cpu` runs every step's code on the
tiny test model (a CPU test does this; another stops it early and reads what it kept).
The harness (result document, deadlines, children, the judged ABI run) is scripts/device_harness.py;
the driver, CUDA_HOME and timed-AOT-build facts scripts/device_aot.py; the probes scripts/device_probes.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from device_aot import cuda_home, driver  # noqa: E402 - scripts/ is this file's folder
from device_harness import (  # noqa: E402
    Check,
    Interrupted,
    agree,
    build_cmd,
    judge,
    last_error,
    on_signal,
    side_by_side,
    stop,
)
from device_probes import batch_sweep, env_info  # noqa: E402

from engine.presets import preset  # noqa: E402 - after the path setup
from evaluator.contest.task import COHORT_IMAGES, DEFAULT_MODEL  # noqa: E402

LARGE = (DEFAULT_MODEL, {}, 448)
ABI_NEED_S = 40             # the guarded ABI run on 2,000 images, fixed costs included
BUILD_NEED_S = 60           # least time left worth starting the background build in (then an ABI run)
SEARCH_EXIT_S = 15          # the search's deadline is its step's time less this (verification's end, exit)

# The steps in the order they start: (name, share of --limit-s its timeout is, what it tells).
# On one H200 in 500 s: driver, env and cuda_home in the first ~10 s; the checkpoint by ~75 s,
# when the AOT build starts in the background (the long pole: it gets the head start); the
# first ABI figure (eager bf16) and its agreement by ~190 s; then the wait for the AOT build and
# its CUDA-graph ABI figure; only then the measured search and the probes, then the rest, each
# cut by what the limit leaves.
PLAN = (
    ("driver", 0.03, "driver version and compute mode (nvidia-smi, else torch), before anything loads"),
    ("env", 0.1, "machine, GPU, versions"),
    ("cuda_home", 0.1, "the image's CUDA_HOME layout (the CUDA wheels' nvidia/cuNN folder): do AOTInductor's "
                       "CUDA headers compile there (else the missing header, and the toolkit the build falls back to)"),
    ("cohort", 0.25, "generated JPEGs, rendered in the background from here on (no ImageNet data)"),
    ("checkpoint", 0.3, "the contest's model (EVA-02-L/448) with a head fit on generated renders"),
    ("aot_bf16", 1.0, "the guarded AOT bf16 build, in the background from here on, phases timed (export, "
                      "Inductor lowering, C++ compile, load, first call) into DIR/aot_phases.json as each ends; "
                      "waited for right after the reference"),
    ("eager_bf16", 0.2, "the guarded eager bf16 build (the artifact of the first ABI figure)"),
    ("abi_eager_bf16", 0.15, "the first ABI figure: scripts/run end to end on the cohort, images/s, decoder, "
                             "fixed costs; its agreement is added once the reference has answered"),
    ("reference", 0.15, "the naive FP32 path (PIL + timm eager, batch 1) on the first --ref-count rows"),
    ("abi_aot_bf16", 0.15, "the ABI end to end on the AOT artifact: images/s, agreement, CUDA graphs, re-checks"),
    ("search", 0.35, "the measured search (engine.build, precision/backend/batch auto), its deadline what is left"),
    ("packages", 0.1, "which optional packages import (DALI, TensorRT, open_clip, ...), torchvision's CUDA decode"),
    ("fp8_gemm", 0.1, "the engine's FP8 linear against its FP32 twin and bf16 at EVA-02-L's shapes"),
    ("graph_capture", 0.15, "CUDA-graph capture while another thread allocates, per capture_error_mode"),
    ("decoder_race", 0.1, "decoding into recycled buffers under a queued consumer vs a synchronous decode"),
    ("attention", 0.1, "SDPA backends at EVA-02-L's shape"),
    ("topk", 0.1, "python -m kernels.topk: the CuPy kernel against torch.topk"),
    ("abi_aot_bf16_no_graphs", 0.15, "the AOT ABI with ENGINE_CUDA_GRAPHS=0: identical answers, the graphs' gain"),
    ("abi_aot_bf16_raw", 0.15, "the AOT ABI raw (ENGINE_GUARD=0), side by side with the guarded run"),
    ("gpu_tests", 0.3, "pytest -m gpu -rA, interrupted with SIGINT at --gpu-tests-s"),
    ("eager_fp16", 0.25, "the eager fp16 build, end to end guarded and raw"),
    ("eager_fp8", 0.25, "the eager fp8 build, end to end guarded and raw"),
    ("eager_fp8-torchao", 0.25, "torchao's fp8 recipe, eager, end to end guarded and raw (beside the engine's)"),
    ("batch_sweep", 0.15, "policy bf16 inference alone at the device preset's batch sizes"),
)


def parser() -> argparse.ArgumentParser:
    steps = "\n".join(f"  {n:<23} {share:>4.0%}  {what}" for n, share, what in PLAN)
    from engine.cli import MAX_DEADLINE_S, ArgumentParser, HelpFormatter, finite_float, whole_number
    from engine.presets import shared

    seconds = finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True)
    p = ArgumentParser(prog="scripts/device_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter,
                                epilog=f"steps, in order (name, timeout as a share of --limit-s, what it tells):\n{steps}")
    p.add_argument("--out", type=Path, required=True,
                   help="result folder: device_check.json, results.jsonl, aot_phases.json, .log, gpu_tests.txt "
                        "(required; the .sh takes it as OUTDIR)")
    p.add_argument("--limit-s", type=seconds, default=500.0,
                   help="deadline for every step together, each step's timeout its share of it "
                        "(default: %(default)s: a 600 s command limit less the device's start-up, "
                        "imports and teardown)")
    p.add_argument("--count", type=whole_number(2, 10**6), default=2000, help="generated JPEGs the ABI runs answer (default: %(default)s)")
    p.add_argument("--ref-count", type=whole_number(1, 10**6), default=500,
                   help="rows the naive FP32 path answers, the agreement's rows (default: %(default)s)")
    p.add_argument("--batch-size", type=whole_number(1, 4096), default=None,
                   help="the builds' static batch (default: the device preset's, engine/presets/classification.py)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where everything runs")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny test model instead of EVA-02-L/448: a rehearsal of every step (default: off)")
    p.add_argument("--gpu-tests-s", type=seconds, default=90.0,
                   help="limit of pytest -m gpu, SIGINT at it (default: %(default)s)")
    p.add_argument("--calibration-count", type=whole_number(16, 10**6), default=shared("check_calibration_count"),
                   help="images each guarded build chooses tau on (default: %(default)s)")
    p.add_argument("--search-budget-s", type=seconds, default=shared("check_search_budget_s"),
                   help="engine.build's --search-budget-s in the measured search step (default: %(default)s)")
    p.add_argument("--system-cuda", type=Path, default=Path("/usr/local/cuda"),
                   help="CUDA toolkit the AOT build falls back to when the CUDA wheels' headers do not compile "
                        "(default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.batch_size = a.batch_size or preset(a.device).static_batch_size
    a.out.mkdir(parents=True, exist_ok=True)
    c = Check(a.out, a.limit_s, PLAN)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    stopped, rc = None, 1
    try:
        c.step("driver", driver)        # first, before torch: a subprocess query, in the JSON at once
        import torch

        c.lacks = (c.step("env", lambda: env_info(a.device)) or {}).get("torch_lacks") or {}
        if a.device == "cuda" and not torch.cuda.is_available():
            c.doc["status"] = "no-gpu"
            c.doc["note"] = "torch sees no CUDA GPU: nothing measured (run with --tiny --device cpu to rehearse)"
            c.save()
            print("device_check: no CUDA GPU: wrote device_check.json saying so", file=sys.stderr)
            return 0
        c.make_work()
        rc = _steps(a, c)
    except Interrupted as e:
        stopped, rc = str(e), 128 + signal.Signals[str(e)].value
        print(f"device_check: {e}: saving the JSON, stopping children, removing the work folder",
              file=sys.stderr, flush=True)
    except BaseException as e:
        stopped = f"{type(e).__name__}: {e}"[:300]
        raise
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)      # the teardown runs to its end
        if c.work is not None:
            c.teardown(stopped)
    return rc


def _steps(a: argparse.Namespace, c: Check) -> int:
    """The plan: first facts, an ABI figure while AOTInductor compiles, the AOT figure, then the rest."""
    from engine import backends
    from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

    assert c.work is not None
    model, kwargs, size = (TINY_MODEL, TINY_KWARGS, TINY_INPUT) if a.tiny else LARGE
    c.doc.update({"model": model, "tiny": a.tiny, "input_size": size, "count": a.count, "batch_size": a.batch_size})
    r = SimpleNamespace(a=a, work=c.work, dev=a.device, cuda=a.device == "cuda", model=model, kwargs=kwargs,
                        size=size, cohort=c.work / "cohort", ckpt=c.work / "model.safetensors", ref=None, preds={},
                        eager=next(b for b in backends.BACKENDS
                                   if not backends.get(b).COMPILED and backends.get(b).NEEDS_WEIGHTS))
    layout = c.step("cuda_home", lambda: cuda_home(a.system_cuda, merge_into=c.work / "cuda_home")) or {}
    r.cuda_env = {"CUDA_HOME": layout["cuda_home"]} if layout.get("cuda_home") else {}
    cohort = c.background("cohort", _cohort_cmd(r), images=a.count)
    c.step("checkpoint", lambda: _checkpoint(c, r))
    if not r.ckpt.is_file():
        return 1
    r.model_args = ["--model", model, "--input-size", str(size), "--crop-mode", "squash", "--crop-pct", "1.0",
                    "--model-kwargs", json.dumps(kwargs), "--checkpoint", str(r.ckpt)]
    r.source = "photos" if _has("skimage") else "renders"
    r.calib = ["--calibration-count", str(a.calibration_count), "--calibration-source", r.source]
    build = _start_aot(c, r)
    c.step("cohort", lambda: _wait_cohort(c, cohort, a.count))
    if not (r.cohort / "manifest.tsv").is_file():
        return 1
    _first_abi(c, r)
    _aot_figure(c, r, build)
    _search(c, r)
    _probes(c, r)
    _aot_compare(c, r)
    _rest(c, r)
    return 1 if c.doc["alarms"] else 0


def torch_version() -> str:
    import torch

    return torch.__version__


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _cohort_cmd(r) -> list[str]:
    # a child process: the parent will hold a CUDA context, and a fork of it must not render
    workers = max(1, (os.cpu_count() or 2) - 1)
    return [sys.executable, "-c", "import sys; from pathlib import Path; "
            "from evaluator.synthetic.cohort import make_cohort; make_cohort(Path(sys.argv[1]), "
            "int(sys.argv[2]), seed=0, workers=int(sys.argv[3]))", str(r.cohort), str(r.a.count), str(workers)]


def _wait_cohort(c: Check, p: subprocess.Popen, count: int) -> dict:
    try:
        rc = p.wait(timeout=max(c.budget(), 1))
    except subprocess.TimeoutExpired:
        stop(p)
        rc = 124
    res = c.finish("cohort", p, rc)
    if rc != 0:
        raise RuntimeError(f"cohort failed ({rc}): {last_error(res.stderr)}")
    return {"images": count}


def _checkpoint(c: Check, r) -> dict:
    """make_tiny_checkpoint in a child (its own timeout; the GPU memory it held is freed on exit)."""
    code = ("import json, sys; from pathlib import Path; from evaluator.synthetic.cohort import make_tiny_checkpoint; "
            "print(json.dumps(make_tiny_checkpoint(Path(sys.argv[1]), seed=0, renders=int(sys.argv[2]), "
            "input_size=int(sys.argv[3]), model=sys.argv[4], model_kwargs=json.loads(sys.argv[5]), "
            "device=sys.argv[6]), default=str))")
    res = c.run("checkpoint", [sys.executable, "-c", code, str(r.ckpt), "4" if r.a.tiny else "6", str(r.size),
                               r.model, json.dumps(r.kwargs), r.dev])
    if res.returncode != 0:
        r.ckpt.unlink(missing_ok=True)
        raise RuntimeError(f"checkpoint failed ({res.returncode}): {last_error(res.stderr)}")
    return {"recipe": json.loads(res.stdout.strip().splitlines()[-1])}


def _start_aot(c: Check, r) -> subprocess.Popen | None:
    """The guarded AOT bf16 build in the background, under scripts/device_aot.py's phase timers,
    with the CUDA_HOME the cuda_home step chose."""
    from engine import backends

    r.aot_art, r.phases = r.work / "art_aot_bf16", c.out / "aot_phases.json"     # phases land in DIR as they end
    r.built_with = {"backend": backends.DEFAULT, "calibration_source": r.source,
                    "calibration_count": r.a.calibration_count, "cuda_home": r.cuda_env.get("CUDA_HOME"),
                    "recheck_backend": r.eager,
                    **({} if r.source == "photos" else {"calibration_note": "scikit-image absent: calibrated on renders"})}
    if c.lacks.get("aot_bf16"):
        c.record("aot_bf16", {"skipped": c.lacks_note("aot_bf16")})
        print(f"device_check: aot_bf16: skipped: {c.lacks_note('aot_bf16')}", file=sys.stderr, flush=True)
        return None
    if c.left() < BUILD_NEED_S:
        c.record("aot_bf16", {"skipped": f"{c.left():.0f} s left, the build and a run need ~{BUILD_NEED_S} s"})
        return None
    cmd = [sys.executable, str(REPO / "scripts" / "device_aot.py"), "build", "--phases", str(r.phases), "--",
           *build_cmd(r.model_args, r.aot_art, r.dev, backends.DEFAULT, "bf16", r.a.batch_size, *r.calib,
                      "--recheck-batch", "auto", "--recheck-backend", r.eager, "--run-images",
                      str(COHORT_IMAGES))[3:]]                        # engine.build's own arguments
    r.t_build = time.perf_counter()
    return c.background("aot_bf16", cmd, r.cuda_env, **r.built_with)


def _first_abi(c: Check, r) -> None:
    """An ABI figure early: the eager bf16 build and one guarded run, then the reference rows
    and the agreement of that run on them."""
    import numpy as np

    art = r.work / "art_eager_bf16"

    def build() -> dict:
        res = c.run("build_eager_bf16", build_cmd(r.model_args, art, r.dev, r.eager, "bf16", r.a.batch_size,
                                                  *r.calib))
        if res.returncode != 0:
            raise RuntimeError(f"build failed ({res.returncode}): {last_error(res.stderr)}")
        g = json.loads((art / "manifest.json").read_text()).get("guard") or {}
        return {"backend": r.eager, "tau": g.get("tau"), "recheck_batch": g.get("recheck_batch")}

    def run() -> dict:
        res, r.preds["eager_bf16"] = judge(c, "eager_bf16", art, r.cohort, None, r.a.count)
        shutil.rmtree(art, ignore_errors=True)          # ~2.4 GB at EVA-02-L scale (weights + re-check)
        return res

    if c.step("eager_bf16", build) and (art / "manifest.json").is_file():
        c.step("abi_eager_bf16", run)
    lines = (r.cohort / "manifest.tsv").read_text().splitlines(keepends=True)
    n_ref = min(r.a.ref_count, len(lines))
    (r.work / "ref_manifest.tsv").write_text("".join(lines[:n_ref]))

    def reference() -> dict:
        t = time.perf_counter()
        res = c.run("reference", [sys.executable, "-m", "evaluator.reference", str(r.work / "ref_manifest.tsv"),
                                  str(r.cohort), str(r.work / "ref.i32"), *r.model_args, "--device", r.dev])
        if res.returncode != 0:
            raise RuntimeError(f"reference failed ({res.returncode}): {last_error(res.stderr)}")
        wall = time.perf_counter() - t
        r.ref = np.fromfile(r.work / "ref.i32", "<i4")
        if "eager_bf16" in r.preds:                       # the first ABI figure gets its agreement
            ag = agree(r.preds["eager_bf16"], r.ref)
            c.doc["steps"]["abi_eager_bf16"].update(ag)
            c.land("abi_eager_bf16", {**ag, "added": "the agreement, once the reference answered"})
        return {"images": n_ref, "wall_s": round(wall, 2), "images_per_s": round(n_ref / wall, 2),
                "distinct_top1": int(len(np.unique(r.ref[r.ref >= 0]))), "path": "PIL + timm eager FP32, batch 1"}

    c.step("reference", reference)


def _search(c: Check, r) -> None:
    """engine.build's measured search (precision, backend, batch size auto) on a short budget."""
    art = r.work / "art_search"

    def search() -> dict:
        # the build's own deadline is what this step has left, less its exit: past it engine.build
        # keeps the best verified candidate, so the limit cuts the search cleanly, not by a kill
        deadline = max(c.budget() - SEARCH_EXIT_S, 1.0)
        res = c.run("search", [sys.executable, "-m", "engine.build", *r.model_args, "--out", str(art),
                               "--device", r.dev, "--precision", "auto", "--backend", "auto", "--batch-size",
                               "auto", "--search-budget-s", str(min(r.a.search_budget_s, deadline)),
                               "--deadline-s", f"{deadline:.0f}", *r.calib], env=r.cuda_env)
        if res.returncode != 0:
            raise RuntimeError(f"search failed ({res.returncode}): {last_error(res.stderr)}")
        m = json.loads((art / "manifest.json").read_text())
        s = (m.get("build") or {}).get("search") or {}
        shutil.rmtree(art, ignore_errors=True)
        return {"budget_s": r.a.search_budget_s, "deadline_s": round(deadline), "chose": {k: m.get(k) for k in ("backend", "precision", "batch_size")},
                "cuda_graphs": m.get("cuda_graphs"), "fallback": s.get("fallback"), "verify": s.get("verify"),
                "candidates": (s.get("candidates") or [])[:24]}

    c.step("search", search, need_s=30)


def _probes(c: Check, r) -> None:
    """The package probe and the GPU micro-probes, each in its own process, while AOTInductor compiles."""
    dev, size = r.dev, r.size
    c.step("packages", lambda: {"packages": c.probe("packages", ["packages", "--device", dev], 120)})
    # the CPU's _scaled_mm is a plain loop (seconds per layer at 64 rows): 16 rows check its error as well
    rows = 1025 * r.a.batch_size if r.cuda else 16
    c.step("fp8_gemm", lambda: c.probe("fp8", ["fp8", "--device", dev, "--rows", str(rows)], 180), need_s=20)

    def graph_capture() -> dict:
        if not r.cuda:
            return {"skipped": "no CUDA"}
        res: dict = {}
        for m in ("global", "thread_local"):     # each mode in its own process: a hang costs that mode only
            try:
                res[m] = c.probe(f"graph_capture_{m}", ["graph_capture", "--mode", m], 60)
            except RuntimeError as e:
                res[m] = {"error": str(e)[:300]}
        res["fails"] = [m for m in ("global", "thread_local")
                        if "error" in res[m] or res[m].get("failed") or res[m].get("replay_wrong")]
        return res

    c.step("graph_capture", graph_capture, need_s=20)

    def decoder_race() -> dict:
        shape = ["--batch", "32", "--rounds", "24", "--size", "448"] if r.cuda else \
            ["--batch", "4", "--rounds", "6", "--size", str(size)]
        res = c.probe("decoder_race", ["decoder_race", "--device", dev, *shape], 120, {"ENGINE_DECODER_ISOLATE": "0"})
        broken = [n for n, d in res.get("decoders", {}).items() if not d.get("protocol_holds")]
        if broken:
            c.doc["alarms"].append(f"decoder_race: recycled buffers changed under a queued reader: {broken}")
        return res

    c.step("decoder_race", decoder_race, need_s=20)
    tokens = (size // 14) ** 2 + 1
    c.step("attention", lambda: c.probe("attention", ["attention", "--device", dev, "--batch",
                                                      str(2 if r.a.tiny else r.a.batch_size), "--tokens", str(tokens)],
                                        90), need_s=10)

    def topk() -> dict:
        small = ["--rows", "64", "--cols", "5000", "--reps", "2"] if r.a.tiny else []
        res = c.run("topk", [sys.executable, "-m", "kernels.topk", "--json", *small], 120)
        if res.returncode not in (0, 1):
            raise RuntimeError(f"kernels.topk failed ({res.returncode}): {last_error(res.stderr)}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        out["validated"] = res.returncode == 0
        return out

    c.step("topk", topk, need_s=15)


def _wait_aot(c: Check, r, build: subprocess.Popen) -> dict:
    """The background AOT build waited for (at most until an ABI run would no longer fit), with its
    phases so far whatever happened (a failure names the CUDA_HOME it compiled with)."""
    t_wait = time.perf_counter()
    try:    # past left - ABI_NEED_S the ABI could not run anyway: the time goes to the rest
        rc = build.wait(timeout=max(c.left() - ABI_NEED_S, 1))
    except subprocess.TimeoutExpired:
        stop(build)
        rc = None
    res = c.finish("aot_bf16", build, rc)
    phases = json.loads(r.phases.read_text()) if r.phases.is_file() else {}
    out = {**r.built_with, "build_s": round(time.perf_counter() - r.t_build, 1),
           "waited_s": round(time.perf_counter() - t_wait, 1), "phases_s": phases.get("seconds"),
           "phases": phases.get("phases"), **({"cpp_compile": phases["cpp_compile"]} if "cpp_compile" in phases else {})}
    if rc is None:
        raise RuntimeError(f"the build did not finish within {out['build_s']:.0f} s; phases so far "
                           f"{json.dumps(out['phases_s'])}")
    if rc != 0:
        raise RuntimeError(f"build failed ({rc}) with CUDA_HOME={r.cuda_env.get('CUDA_HOME')}, phases "
                           f"{json.dumps(out['phases_s'])}: {last_error(res.stderr)}")
    g = json.loads((r.aot_art / "manifest.json").read_text()).get("guard") or {}
    return {**out, "tau": g.get("tau"), "budget_per_10k": g.get("budget_per_10k"),
            "estimated_per_10k": g.get("estimated_per_10k"), "expected_rechecked_fraction": g.get("rechecked_fraction"),
            "recheck_batch": g.get("recheck_batch"), "recheck_sweep": g.get("recheck_sweep"),
            "calibration": (g.get("calibration") or {}).get("origin"), "calibration_disagreements": g.get("disagreements")}


def _aot_abi(c: Check, r, name: str, env: dict | None = None):
    """A step function: the ABI on the AOT artifact, judged against the reference."""
    def fn() -> dict:
        res, r.preds[name] = judge(c, name, r.aot_art, r.cohort, r.ref, r.a.count, env)
        return res
    return fn


def _aot_figure(c: Check, r, build: subprocess.Popen | None) -> None:
    """The AOT build waited for, then its ABI figure (CUDA graphs on): before the search and the
    probes, so a cut window keeps it."""
    built = build is not None and c.step("aot_bf16", lambda: _wait_aot(c, r, build)) and \
        (r.aot_art / "manifest.json").is_file()
    r.guarded = None
    if built and r.ref is not None:
        r.guarded = c.step("abi_aot_bf16", _aot_abi(c, r, "aot_bf16"), need_s=ABI_NEED_S)
    else:
        c.record("abi_aot_bf16", {"skipped": "no artifact: the build did not finish" if not built
                                  else "no reference answers to judge against"})


def _aot_compare(c: Check, r) -> None:
    """The AOT ABI again without CUDA graphs and raw (no guard), each beside the guarded run."""
    import numpy as np

    guarded = r.guarded

    def no_graphs() -> dict:
        res = _aot_abi(c, r, "aot_bf16_no_graphs", {"ENGINE_CUDA_GRAPHS": "0"})()
        same = bool(np.array_equal(r.preds["aot_bf16"], r.preds["aot_bf16_no_graphs"]))
        if not same:
            c.doc["alarms"].append("abi_aot_bf16_no_graphs: answers differ from the run with CUDA graphs")
        return {**res, "identical": same,
                "graphs_gain_steady": round(guarded["images_per_s_steady"] / max(res["images_per_s_steady"], 1e-9), 3),
                "graphs_saved_wall_s": round(res["wall_s"] - guarded["wall_s"], 3)}

    def raw_run() -> dict:
        raw = _aot_abi(c, r, "aot_bf16_raw", {"ENGINE_GUARD": "0"})()
        return {**raw, "guard_side_by_side": side_by_side(c, "aot_bf16", guarded, raw)}

    for name, fn in (("abi_aot_bf16_no_graphs", no_graphs), ("abi_aot_bf16_raw", raw_run)):
        if not (guarded and "error" not in guarded):
            c.record(name, {"skipped": "no guarded ABI run to compare with"})
        elif name.endswith("no_graphs") and not r.cuda:
            c.record(name, {"skipped": "no CUDA: the CPU runs without graphs already"})
        else:
            c.step(name, fn, need_s=30)
    c.save()


def _rest(c: Check, r) -> None:
    """pytest -m gpu, the eager fp16 and fp8 builds end to end, the batch sweep: as time allows."""
    def gpu_tests() -> dict:
        if not r.cuda:
            return {"skipped": "no CUDA: every gpu-marked test would skip"}
        limit = min(r.a.gpu_tests_s, c.budget() - 5)
        res = c.run("gpu_tests", ["timeout", "-s", "INT", str(int(limit)), sys.executable, "-m", "pytest", "-m",
                                  "gpu", "-rA", "-q", "-p", "no:cacheprovider", "tests"], limit + 15)
        (c.out / "gpu_tests.txt").write_text(res.stdout[-20000:] + res.stderr[-5000:])
        tail = (res.stdout.strip().splitlines() or [""])[-1]
        return {"exit": res.returncode, "summary": tail,
                "interrupted": res.returncode in (124, 130, 2) and "passed" not in tail}

    c.step("gpu_tests", gpu_tests, need_s=20)
    for prec in ("fp16", "fp8", "fp8-torchao"):   # fp8-torchao: torchao's recipe beside the engine's own fp8
        lacking = (c.doc["steps"].get("fp8_gemm") or {}).get("lacks") if prec == "fp8" else None
        if lacking:                     # the probe found this torch's FP8 GEMM lacking here: the build would fail
            c.record(f"eager_{prec}", {"skipped": f"torch {torch_version()} lacks {lacking} on {r.dev}",
                                       "lacks": lacking})
            print(f"device_check: eager_{prec}: skipped: torch {torch_version()} lacks {lacking} on {r.dev}",
                  file=sys.stderr, flush=True)
            continue

        def eager_step(prec=prec) -> dict:
            art = r.work / f"art_eager_{prec}"
            res = c.run(f"build_eager_{prec}", build_cmd(r.model_args, art, r.dev, r.eager, prec, r.a.batch_size,
                                                         *r.calib))
            if res.returncode != 0:
                raise RuntimeError(f"build failed ({res.returncode}): {last_error(res.stderr)}")
            out, _ = judge(c, f"eager_{prec}", art, r.cohort, r.ref, r.a.count)
            if isinstance(out.get("guard"), dict) and c.budget() > 20:
                raw, _ = judge(c, f"eager_{prec}_raw", art, r.cohort, r.ref, r.a.count, {"ENGINE_GUARD": "0"})
                out["guard_side_by_side"] = side_by_side(c, f"eager_{prec}", out, raw)
            shutil.rmtree(art, ignore_errors=True)      # ~2 GB each at EVA-02-L scale
            return {"backend": r.eager, **out}
        c.step(f"eager_{prec}", eager_step, need_s=60)
    batches = list(preset(r.dev).batch_sizes)
    c.step("batch_sweep", lambda: batch_sweep(r.model, r.kwargs, r.size, r.ckpt, r.dev, batches), need_s=20)


if __name__ == "__main__":
    sys.exit(main())
