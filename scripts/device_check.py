"""One-shot GPU check of the contest path: most valuable facts first, whatever happens.

    python3 scripts/device_check.py --out DIR [--limit-s 560] [--count 2000] [--ref-count 500]
        [--batch-size N] [--calibration-count 64] [--gpu-tests-s 90] [--tiny --device cpu]

Steps, in the order the JSON records them; each is timed, reads "running" while under way,
and is skipped with a reason when the time left cannot hold it:
 1. env            machine, GPU, versions
 2. packages       which optional packages import (scikit-image, DALI, TensorRT, torch-tensorrt,
                   open_clip, CuPy, torchvision) and whether torchvision decodes JPEGs on CUDA
 3. checkpoint     the contest's model (evaluator.contest.task: EVA-02-L/448) whose head is fit on
                   generated renders (trained-looking logits)
 4. aot_bf16       the guarded AOT bf16 build, started in the background with a short calibration
                   (scikit-image's photos, or renders when scikit-image is absent); while it compiles:
 5. fp8_gemm       the engine's FP8 linear against its FP32 twin and bf16 at EVA-02-L's shapes
                   (1025 tokens x batch rows), ms and TFLOP/s
 6. graph_capture  CUDA-graph capture while another thread allocates, per capture_error_mode
 7. decoder_race   decoding into recycled buffers under a queued consumer vs a synchronous decode
 8. attention      SDPA backends at EVA-02-L's shape
 9. topk           python -m kernels.topk: the CuPy kernel against torch.topk
10. cohort         generated JPEGs (no ImageNet data)
11. reference      the naive FP32 path (PIL + timm eager, batch 1) on the first --ref-count rows;
                   then the check waits for the build (aot_bf16 records the wait)
12. abi_aot_bf16   the ABI end to end (scripts/run): images/s, agreement, decoder, GPU busy time,
                   fixed costs, CUDA graph status (a failed capture is an alarm), the guard's re-checks
13. abi_aot_bf16_no_graphs  the same with ENGINE_CUDA_GRAPHS=0: identical answers, the graphs' gain
14. abi_aot_bf16_raw        the same raw (ENGINE_GUARD=0), side by side with the guarded run
15. gpu_tests      pytest -m gpu -rA, interrupted with SIGINT at its limit
16. eager_*        bf16, fp16 and fp8 eager builds, each end to end guarded and raw
17. batch_sweep    policy bf16 inference alone at the device preset's batch sizes (engine/presets.py)
The JSON's not_exercised lists what of the scored setup (ARM64 + Hopper, the Dockerfile's Python,
requirements/lock.txt) this run did not exercise. Work files (checkpoint, artifacts, cohort,
predictions) live in a private folder under $TMPDIR, removed at the end and on SIGTERM/SIGINT
(after the JSON is saved). Outputs, small and plain: DIR/device_check.json (rewritten after every
step), DIR/device_check.log (each step's output, tail-kept), DIR/gpu_tests.txt.
Without a GPU (and without --device cpu) it writes a JSON that says so and exits 0 in seconds.
`--tiny --device cpu` runs every step's code on the tiny test model (a CPU test does this).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from device_probes import batch_sweep, env_info, not_exercised, scored_setup  # noqa: E402 - scripts/ is this file's folder

from engine.presets import preset  # noqa: E402 - after the path setup
from evaluator.contest.task import COHORT_IMAGES, DEFAULT_MODEL  # noqa: E402

LARGE = (DEFAULT_MODEL, {}, 448)
LOG_TAIL = 200_000          # bytes of each step's output kept in DIR/device_check.log
LOG_MAX = 12 << 20          # the combined log stays under the 16 MiB a returned file may have
ABI_NEED_S = 40             # the guarded ABI run on 2,000 images, fixed costs included
BUILD_NEED_S = 60           # least time left worth starting the background build in (then an ABI run)


class Interrupted(BaseException):
    """SIGTERM or SIGINT: save what is known, clean up, exit (not an Exception: no step catches it)."""


def _on_signal(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


class Check:
    """The result document, saved after every step; steps run against one deadline; children
    write into a private work folder, and the tail of each one's output goes into one log."""

    def __init__(self, out: Path, limit_s: float):
        self.out, self.t0, self.limit_s = out, time.perf_counter(), limit_s
        self.doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "status": "running", "limit_s": limit_s,
                          "steps": {}, "alarms": []}
        self.work: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}     # children still running, by log name

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.t0)

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 1)

    def save(self) -> None:
        self.doc["elapsed_s"] = self.elapsed()
        tmp = self.out / "device_check.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.out / "device_check.json")

    def make_work(self) -> Path:
        self.work = Path(tempfile.mkdtemp(prefix="device_check_"))    # under $TMPDIR, never under DIR
        (self.work / "logs").mkdir()
        (self.work / "tmp").mkdir()
        self.doc["work_dir"] = str(self.work)
        return self.work

    def step(self, name: str, fn, need_s: float = 0.0) -> dict | None:
        """Run fn() -> dict as step `name` unless fewer than need_s seconds are left; record it either way."""
        if self.left() < need_s:
            self.doc["steps"][name] = {"skipped": f"{self.left():.0f} s left, the step needs ~{need_s:.0f} s"}
            self.save()
            return None
        self.doc["steps"][name] = {"running": f"since {self.elapsed()} s"}
        self.save()
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

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        """cmd in its own process group, stdout and stderr into work/logs/NAME.{out,err}; children get
        TMPDIR inside the work folder, so whatever they leave there goes with it (compile caches stay
        where the environment puts them: scripts/device_check.sh sets them as scripts/run does)."""
        assert self.work is not None
        logs = self.work / "logs"
        full = {**os.environ, "TMPDIR": str(self.work / "tmp"), **(env or {})}
        with open(logs / f"{name}.out", "wb") as o, open(logs / f"{name}.err", "wb") as e:
            p = subprocess.Popen(cmd, cwd=REPO, env=full, stdout=o, stderr=e, process_group=0)
        self.procs[name] = p
        return p

    def finish(self, name: str, p: subprocess.Popen, rc: int | None) -> subprocess.CompletedProcess:
        """The ended child's output, its tail appended to DIR/device_check.log."""
        self.procs.pop(name, None)
        assert self.work is not None
        out, err = ((self.work / "logs" / f"{name}.{s}").read_text(errors="replace") for s in ("out", "err"))
        self.append_log(name, f"exit {rc}", out + err)
        return subprocess.CompletedProcess(p.args, rc if rc is not None else -1, out, err)

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """start() and wait; at `timeout` the child is stopped and the exit status reads 124."""
        p = self.start(name, cmd, env)
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            stop(p)
            rc = 124
        return self.finish(name, p, rc)

    def probe(self, name: str, args: list[str], timeout: float, env: dict | None = None) -> dict:
        """One of scripts/device_probes.py's probes in its own process: its JSON line."""
        r = self.run(name, [sys.executable, str(REPO / "scripts" / "device_probes.py"), *args],
                     min(timeout, self.left()), env)
        if r.returncode != 0:
            raise RuntimeError(f"probe failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def append_log(self, name: str, header: str, text: str) -> None:
        log = self.out / "device_check.log"
        if log.is_file() and log.stat().st_size > LOG_MAX:
            return
        data = text.encode(errors="replace")
        cut = f"[... {len(data) - LOG_TAIL} bytes cut ...]\n".encode() if len(data) > LOG_TAIL else b""
        with open(log, "ab") as f:
            f.write(f"==== {name} ({header}, at {self.elapsed()} s) ====\n".encode() + cut + data[-LOG_TAIL:] + b"\n")

    def teardown(self, stopped: str | None) -> None:
        """Stop the children, mark unfinished steps, list what was not exercised, save, remove the work folder."""
        for name, p in list(self.procs.items()):
            stop(p)
            self.finish(name, p, p.returncode)
        for name, s in self.doc["steps"].items():
            if "running" in s:
                why = stopped or "stopped as the check ended"
                self.doc["steps"][name] = {"interrupted": f"{why} at {self.elapsed()} s", "was": s["running"]}
        self.doc["cut_by_deadline"] = [n for n, s in self.doc["steps"].items() if "s left, " in s.get("skipped", "")]
        try:
            self.doc["not_exercised"] = not_exercised(self.doc, scored_setup(REPO))
        except Exception as e:  # noqa: BLE001 - the rest of the document still gets saved
            self.doc["not_exercised"] = [f"unknown ({type(e).__name__}: {e})"]
        self.doc["status"] = f"stopped ({stopped})" if stopped else "alarm" if self.doc["alarms"] else "done"
        self.save()
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.doc["work_dir_removed"] = not self.work.exists()
            self.save()


def stop(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to p's process group (compile workers too), SIGKILL after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass


def judge(c: Check, name: str, art: Path, cohort: Path, ref, n_ref: int, count: int, env_extra=None):
    """Run the ABI on the cohort with `art`: (the run's figures and agreement on the reference rows,
    its predictions)."""
    import numpy as np

    from evaluator.contest.agreement import agreement

    assert c.work is not None
    pred, report = c.work / f"pred_{name}.i32", c.work / f"timing_{name}.json"
    env = {"ENGINE_ARTIFACT": str(art), "CONTEST_REPORT": str(report), **(env_extra or {})}
    t = time.perf_counter()
    r = c.run(f"run_{name}", [str(REPO / "scripts" / "run"), str(cohort / "manifest.tsv"), str(cohort), str(pred)],
              timeout=c.left(), env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"scripts/run failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    timing = json.loads(report.read_text())
    got = np.fromfile(pred, "<i4")
    ag = agreement(got[:n_ref], ref)
    rt, stages = timing.get("runtime") or {}, timing.get("stages") or {}
    pipeline = stages.get("pipeline") or 1e-9
    steady = timing.get("images", count) / pipeline
    res = {"wall_s": round(wall, 3), "images_per_s_end_to_end": round(count / wall, 1),
           "images_per_s_steady": round(steady, 1), "agreement": f"{ag.matches}/{ag.total}",
           "agreement_rate": round(ag.matches / max(ag.total, 1), 5), "decoder": timing.get("decoder"),
           "decoder_notes": [ln[:200] for ln in r.stderr.splitlines() if "[engine] decoder" in ln][:4],
           "cuda_graph": rt.get("cuda_graph"), "gpu_busy_s": rt.get("gpu_busy_s"), "guard": rt.get("guard"),
           "stages": stages, "first_batch_s": timing.get("first_batch_s"),
           "projected_10k_s": round((stages.get("total") or 0) - pipeline + COHORT_IMAGES / steady, 1)}
    if str(res["cuda_graph"]).startswith("failed"):
        c.doc["alarms"].append(f"{name}: CUDA graph capture failed: {res['cuda_graph']}")
    return res, got


def side_by_side(c: Check, name: str, guarded: dict, raw: dict) -> dict:
    """The guard's figures beside the raw run's: does it pay for itself on this device?"""
    g = guarded.get("guard") if isinstance(guarded.get("guard"), dict) else {}
    if raw["agreement_rate"] > guarded["agreement_rate"]:
        c.doc["alarms"].append(f"{name}: the guard lowered agreement ({raw['agreement']} raw, "
                               f"{guarded['agreement']} guarded)")
    return {"raw_agreement": raw["agreement"], "guarded_agreement": guarded["agreement"],
            "raw_agreement_rate": raw["agreement_rate"], "guarded_agreement_rate": guarded["agreement_rate"],
            "rechecked_fraction": g.get("fraction"), "recheck_seconds": g.get("seconds"),
            "recheck_calls": g.get("calls"), "recheck_batch": g.get("recheck_batch"), "changed": g.get("changed"),
            "tau": g.get("tau"), "raw_wall_s": raw["wall_s"], "guarded_wall_s": guarded["wall_s"],
            "raw_images_per_s_steady": raw["images_per_s_steady"],
            "guarded_images_per_s_steady": guarded["images_per_s_steady"]}


def build_cmd(model_args: list[str], out: Path, device: str, backend: str, precision: str, batch: int,
              *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine.build", *model_args, "--out", str(out), "--device", device,
            "--backend", backend, "--precision", precision, "--batch-size", str(batch), *extra]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/device_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit-s", type=float, default=560.0,
                   help="deadline for every step together (default: a 600 s window, less start-up and teardown)")
    p.add_argument("--count", type=int, default=2000, help="generated JPEGs")
    p.add_argument("--ref-count", type=int, default=500, help="rows the naive FP32 path answers")
    p.add_argument("--batch-size", type=int, help="the builds' static batch (default: the device preset's, "
                                                  "engine/presets.py)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny test model (rehearsal of every step on the CPU)")
    p.add_argument("--gpu-tests-s", type=float, default=90.0)
    p.add_argument("--calibration-count", type=int, default=64, help="images each guarded build chooses tau on")
    a = p.parse_args(argv)
    a.batch_size = a.batch_size or preset(a.device).static_batch_size
    a.out.mkdir(parents=True, exist_ok=True)
    c = Check(a.out, a.limit_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    stopped, rc = None, 1
    try:
        import torch

        c.step("env", lambda: env_info(a.device))
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
    import importlib.util

    import numpy as np

    from engine import backends
    from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL, make_tiny_checkpoint

    assert c.work is not None
    work, dev, cuda = c.work, a.device, a.device == "cuda"
    model, kwargs, size = (TINY_MODEL, TINY_KWARGS, TINY_INPUT) if a.tiny else LARGE
    c.doc.update({"model": model, "tiny": a.tiny, "input_size": size, "count": a.count, "batch_size": a.batch_size})
    pk = c.step("packages", lambda: {"packages": c.probe("packages", ["packages", "--device", dev], 120)}) or {}
    skimage = (pk.get("packages") or {}).get("scikit-image", {}).get("ok", importlib.util.find_spec("skimage") is not None)

    cohort, ckpt = work / "cohort", work / "model.safetensors"
    c.step("checkpoint", lambda: {"recipe": make_tiny_checkpoint(ckpt, seed=0, renders=4 if a.tiny else 6,
                                                                   input_size=size, model=model,
                                                                   model_kwargs=kwargs, device=dev)})
    if not ckpt.is_file():
        return 1
    model_args = ["--model", model, "--input-size", str(size), "--crop-mode", "squash", "--crop-pct", "1.0",
                  "--model-kwargs", json.dumps(kwargs), "--checkpoint", str(ckpt)]
    source = "photos" if skimage else "renders"
    calib = ["--calibration-count", str(a.calibration_count), "--calibration-source", source]
    main_backend = backends.DEFAULT
    eager = next(b for b in backends.BACKENDS if not backends.get(b).COMPILED and backends.get(b).NEEDS_WEIGHTS)
    aot_art = work / "art_aot_bf16"
    built_with = {"backend": main_backend, "calibration_source": source, "calibration_count": a.calibration_count,
                  **({} if skimage else {"calibration_note": "scikit-image absent: calibrated on renders"})}
    build = None
    if c.left() < BUILD_NEED_S:
        c.doc["steps"]["aot_bf16"] = {"skipped": f"{c.left():.0f} s left, the build and a run need ~{BUILD_NEED_S} s"}
    else:   # the compiled build runs in the background while the GPU probes, the cohort and the reference run
        build = c.start("build_aot_bf16", build_cmd(model_args, aot_art, dev, main_backend, "bf16", a.batch_size,
                                                    *calib, "--recheck-batch", "auto", "--recheck-backend", eager,
                                                    "--run-images", str(COHORT_IMAGES)))
        c.doc["steps"]["aot_bf16"] = {"running": f"in the background since {c.elapsed()} s", **built_with}
    t_build = time.perf_counter()
    c.save()

    rows = 1025 * a.batch_size if cuda else 64
    c.step("fp8_gemm", lambda: c.probe("fp8", ["fp8", "--device", dev, "--rows", str(rows)], 180), need_s=20)

    def graph_capture() -> dict:
        if not cuda:
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
        shape = ["--batch", "32", "--rounds", "24", "--size", "448"] if cuda else \
            ["--batch", "4", "--rounds", "6", "--size", str(size)]
        res = c.probe("decoder_race", ["decoder_race", "--device", dev, *shape], 120, {"ENGINE_DECODER_ISOLATE": "0"})
        broken = [n for n, d in res.get("decoders", {}).items() if not d.get("protocol_holds")]
        if broken:
            c.doc["alarms"].append(f"decoder_race: recycled buffers changed under a queued reader: {broken}")
        return res

    c.step("decoder_race", decoder_race, need_s=20)
    tokens = (size // 14) ** 2 + 1
    c.step("attention", lambda: c.probe("attention", ["attention", "--device", dev, "--batch",
                                                      str(2 if a.tiny else a.batch_size), "--tokens", str(tokens)], 90),
           need_s=10)

    def topk() -> dict:
        small = ["--queries", "64", "--gallery", "5000", "--reps", "2"] if a.tiny else []
        r = c.run("topk", [sys.executable, "-m", "kernels.topk", *small], min(120, c.left()))
        if r.returncode not in (0, 1):
            raise RuntimeError(f"kernels.topk failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        out["validated"] = r.returncode == 0
        return out

    c.step("topk", topk, need_s=15)
    def make_cohort() -> dict:
        # a child process: the parent holds a CUDA context, and a fork of it must not render
        workers = max(1, (os.cpu_count() or 2) - 1)
        r = c.run("cohort", [sys.executable, "-c", "import sys; from pathlib import Path; "
                             "from evaluator.synthetic.cohort import make_cohort; make_cohort(Path(sys.argv[1]), "
                             "int(sys.argv[2]), seed=0, workers=int(sys.argv[3]))", str(cohort), str(a.count),
                             str(workers)], c.left())
        if r.returncode != 0:
            raise RuntimeError(f"cohort failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        return {"images": a.count, "workers": workers}

    c.step("cohort", make_cohort)
    if not (cohort / "manifest.tsv").is_file():
        return 1
    lines = (cohort / "manifest.tsv").read_text().splitlines(keepends=True)
    n_ref = min(a.ref_count, len(lines))
    (work / "ref_manifest.tsv").write_text("".join(lines[:n_ref]))

    def reference() -> dict:
        t = time.perf_counter()
        r = c.run("reference", [sys.executable, "-m", "evaluator.reference", str(work / "ref_manifest.tsv"),
                                str(cohort), str(work / "ref.i32"), *model_args, "--device", dev], c.left())
        if r.returncode != 0:
            raise RuntimeError(f"reference failed: {r.stderr.strip()[-300:]}")
        wall = time.perf_counter() - t
        ref = np.fromfile(work / "ref.i32", "<i4")
        return {"images": n_ref, "wall_s": round(wall, 2), "images_per_s": round(n_ref / wall, 2),
                "distinct_top1": int(len(np.unique(ref[ref >= 0]))), "path": "PIL + timm eager FP32, batch 1"}

    c.step("reference", reference)
    if not (work / "ref.i32").is_file():
        return 1
    ref = np.fromfile(work / "ref.i32", "<i4")

    def wait_build() -> dict:
        assert build is not None
        t_wait = time.perf_counter()
        try:    # past left - ABI_NEED_S the ABI could not run anyway: the time goes to the GPU tests
            rc = build.wait(timeout=max(c.left() - ABI_NEED_S, 1))
        except subprocess.TimeoutExpired:
            stop(build)
            c.finish("build_aot_bf16", build, None)
            raise RuntimeError(f"the build did not finish within {time.perf_counter() - t_build:.0f} s") from None
        r = c.finish("build_aot_bf16", build, rc)
        if rc != 0:
            raise RuntimeError(f"build failed ({rc}): {r.stderr.strip()[-300:]}")
        g = json.loads((aot_art / "manifest.json").read_text()).get("guard") or {}
        return {"build_s": round(time.perf_counter() - t_build, 1), "waited_s": round(time.perf_counter() - t_wait, 1),
                **built_with, "tau": g.get("tau"), "budget_per_10k": g.get("budget_per_10k"),
                "estimated_per_10k": g.get("estimated_per_10k"), "expected_rechecked_fraction": g.get("rechecked_fraction"),
                "recheck_batch": g.get("recheck_batch"), "recheck_sweep": g.get("recheck_sweep"),
                "calibration": (g.get("calibration") or {}).get("origin"), "calibration_disagreements": g.get("disagreements")}

    preds: dict = {}

    def abi(name: str, env: dict | None = None):
        def fn() -> dict:
            res, preds[name] = judge(c, name, aot_art, cohort, ref, n_ref, a.count, env)
            return res
        return fn

    def no_graphs() -> dict:
        assert guarded is not None
        res = abi("aot_bf16_no_graphs", {"ENGINE_CUDA_GRAPHS": "0"})()
        same = bool(np.array_equal(preds["aot_bf16"], preds["aot_bf16_no_graphs"]))
        if not same:
            c.doc["alarms"].append("abi_aot_bf16_no_graphs: answers differ from the run with CUDA graphs")
        return {**res, "identical": same,
                "graphs_gain_steady": round(guarded["images_per_s_steady"] / max(res["images_per_s_steady"], 1e-9), 3),
                "graphs_saved_wall_s": round(res["wall_s"] - guarded["wall_s"], 3)}

    def raw_run() -> dict:
        assert guarded is not None
        raw = abi("aot_bf16_raw", {"ENGINE_GUARD": "0"})()
        return {**raw, "guard_side_by_side": side_by_side(c, "aot_bf16", guarded, raw)}

    built = build is not None and c.step("aot_bf16", wait_build) and (aot_art / "manifest.json").is_file()
    guarded = c.step("abi_aot_bf16", abi("aot_bf16"), need_s=ABI_NEED_S) if built else None
    if not built:
        c.doc["steps"]["abi_aot_bf16"] = {"skipped": "no artifact: the build did not finish"}
    for name, fn in (("abi_aot_bf16_no_graphs", no_graphs), ("abi_aot_bf16_raw", raw_run)):
        if guarded and "error" not in guarded:
            c.step(name, fn, need_s=30)
        else:
            c.doc["steps"][name] = {"skipped": "no guarded ABI run to compare with"}

    def gpu_tests() -> dict:
        limit = min(a.gpu_tests_s, c.left() - 5)
        r = c.run("gpu_tests", ["timeout", "-s", "INT", str(int(limit)), sys.executable, "-m", "pytest", "-m", "gpu",
                                "-rA", "-q", "-p", "no:cacheprovider", "tests"], limit + 15)
        (c.out / "gpu_tests.txt").write_text(r.stdout[-20000:] + r.stderr[-5000:])
        tail = (r.stdout.strip().splitlines() or [""])[-1]
        return {"exit": r.returncode, "summary": tail, "interrupted": r.returncode in (124, 130, 2) and "passed" not in tail}

    c.step("gpu_tests", gpu_tests, need_s=20)
    for prec in ("bf16", "fp16", "fp8"):
        def eager_step(prec=prec) -> dict:
            art = work / f"art_eager_{prec}"
            r = c.run(f"build_eager_{prec}", build_cmd(model_args, art, dev, eager, prec, a.batch_size, *calib),
                      c.left())
            if r.returncode != 0:
                raise RuntimeError(f"build failed: {r.stderr.strip()[-300:]}")
            res, _ = judge(c, f"eager_{prec}", art, cohort, ref, n_ref, a.count)
            if isinstance(res.get("guard"), dict) and c.left() > 20:
                raw, _ = judge(c, f"eager_{prec}_raw", art, cohort, ref, n_ref, a.count, {"ENGINE_GUARD": "0"})
                res["guard_side_by_side"] = side_by_side(c, f"eager_{prec}", res, raw)
            shutil.rmtree(art, ignore_errors=True)      # ~2 GB each at EVA-02-L scale
            return {"backend": eager, **res}
        c.step(f"eager_{prec}", eager_step, need_s=60)
    batches = list(preset(dev).batch_sizes)
    c.step("batch_sweep", lambda: batch_sweep(model, kwargs, size, ckpt, dev, batches), need_s=20)
    return 1 if c.doc["alarms"] else 0


if __name__ == "__main__":
    sys.exit(main())
