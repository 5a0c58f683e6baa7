"""The untimed preparation step: checkpoint -> artifact directory.

    python -m engine.build --model NAME --checkpoint FILE --out DIR [--device cpu|cuda]
        [--precision fp32|bf16|fp16|fp8] [--backend NAME] [--batch-size N|auto]
        [--input-size N] [--crop-mode center|squash] [--crop-pct F] [--model-kwargs JSON]
        [--no-guard] [--calibration-source photos|renders] [--calibration-images DIR]
        [--guard-budget N] [--guard-safety F] [--recheck-batch N|auto]

Below FP32 the network follows the mixed-precision policy (engine.precision) and the
build is guarded by default (engine.guard): the low-precision graph also returns its
top-1/top-2 margin, a second FP32 graph of `--recheck-batch` images re-checks the rows
under tau, and tau is chosen here on natural photos that are not evaluation data
(engine.calibrate: scikit-image's bundled photos, or `--calibration-images DIR`) as the
smallest threshold whose estimated disagreements per 10,000 images, times a safety
factor, stay under `--guard-budget`. The build prints the budget, tau and the expected
re-checked fraction; renders only check that the low-precision graph is not broken.
`--no-guard` builds the raw low-precision form.

The artifact is written into a temporary sibling directory and renamed into place, so
an interrupted build never leaves a directory that looks complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import backends
from engine.artifact import Artifact, write_manifest
from engine.checkpoint import load_model
from engine.io import sha256_file
from engine.precision import describe as describe_policy
from engine.spec import CROP_MODES, PRECISIONS, Spec, resolve_spec

RECHECK_DIR = "recheck"   # the guard's FP32 graph, built by the same backend, inside the artifact


@dataclasses.dataclass
class GuardConfig:
    enabled: bool = True                  # below fp32: re-check near-ties in FP32
    calibration_images: Path | None = None  # a folder of the user's images; None: calibration_source
    calibration_count: int = 256
    safety: float = 2.0                   # factor on the estimated disagreements
    recheck_batch: int | str = 8          # static batch of the FP32 re-check graph, or "auto" (measured)
    recheck_backend: str | None = None    # backend of the re-check graph (default: the build's)
    budget: float = 10.0                  # estimated disagreements per 10,000 images tau must stay under
    calibration_source: str = "photos"    # photos (scikit-image's bundled photos) | renders
    smoke_count: int = 32                 # renders that check the low-precision graph is not broken


def build(spec: Spec, checkpoint: Path | None, out: Path, backend: str = backends.DEFAULT,
          device: str = "cpu", guard: GuardConfig | None = None, batch_sweep: dict | None = None) -> dict:
    """Build the artifact for `spec` with `backend` (a name in engine.backends) and return its manifest."""
    be = backends.get(backend)
    guard = guard or GuardConfig()
    guarded = guard.enabled and spec.precision != "fp32" and be.NEEDS_WEIGHTS
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA GPU on the build machine")
    if checkpoint is None and be.NEEDS_WEIGHTS:
        raise ValueError(f"backend {backend} needs --checkpoint")
    from engine.fp32 import set_fp32_math

    t0 = time.perf_counter()
    math = set_fp32_math()   # the calibration reference and the re-check graph: IEEE FP32 (ENGINE_TF32)
    net = load_model(spec, checkpoint) if be.NEEDS_WEIGHTS else None
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the run may be another (non-root) user
    try:
        extra = {"build": {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                 "precision_policy": describe_policy(spec.precision), "fp32_math": math}
        if batch_sweep:
            extra["build"]["batch_sweep"] = batch_sweep
        extra.update(be.save(net, spec, device, tmp, margin=guarded))
        if guarded:
            extra["guard"] = _build_guard(be, backend, net, spec, device, tmp, guard)
        extra["build"]["seconds"] = round(time.perf_counter() - t0, 3)
        ck_sha = sha256_file(checkpoint) if checkpoint is not None else None
        meta = write_manifest(tmp, spec, backend, device, checkpoint, ck_sha, extra)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "a")
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


SMOKE_AGREEMENT = 0.5   # raw low precision agreeing with FP32 on fewer renders than this: a broken build


def _build_guard(be, backend: str, net, spec: Spec, device: str, tmp: Path, cfg: GuardConfig) -> dict:
    """Choose tau with the compiled low-precision graph, then build the FP32 re-check graph."""
    from engine import calibrate
    from engine.model import wrap

    t0 = time.perf_counter()
    if cfg.calibration_images is not None:
        pixels, origin = calibrate.folder_pixels(cfg.calibration_images, spec, cfg.calibration_count)
    elif cfg.calibration_source == "renders":
        pixels, origin = calibrate.generated_pixels(spec, cfg.calibration_count)
    elif cfg.calibration_source == "photos":
        pixels, origin = calibrate.photo_pixels(spec, cfg.calibration_count)
    else:
        raise ValueError(f"calibration source must be one of {calibrate.SOURCES}, got {cfg.calibration_source!r}")
    view = Artifact(tmp, spec, backend, device, spec.precision, spec.batch_size, {}, {"guard": True})
    low = be.load(view, torch.device(device))                       # the graph the run will execute
    ref = wrap(net, dataclasses.replace(spec, precision="fp32"), device, margin=True)
    low_top1, margins = calibrate.classify(low, pixels, spec.batch_size, margin=True, device=device)
    ref_top1, ref_margins = calibrate.classify(ref, pixels, 16, margin=True, device=device)
    chosen = calibrate.choose_tau(low_top1, margins, ref_top1, ref_margins, cfg.budget, cfg.safety)
    smoke = _smoke(calibrate, low, ref, spec, device, cfg.smoke_count)
    rbatch, rsweep = cfg.recheck_batch, None
    if rbatch == "auto":
        rbatch, rsweep = measure_recheck_batch(net, spec, device, chosen["rechecked_fraction"])
        print(f"engine.build: re-check batch {rbatch} (measured: {rsweep['images_per_s']} images/s)", file=sys.stderr)
    rspec = dataclasses.replace(spec, precision="fp32", batch_size=rbatch)
    (tmp / RECHECK_DIR).mkdir()
    rbackend = cfg.recheck_backend or backend
    backends.get(rbackend).save(net, rspec, device, tmp / RECHECK_DIR, margin=False)
    print(f"engine.build: guard budget {cfg.budget:g} disagreements per 10,000 (safety x{cfg.safety:g}): "
          f"tau {chosen['tau']:.4f}, expected re-checked fraction {chosen['rechecked_fraction']:.1%} "
          f"(estimated {chosen['estimated_per_10k']:.2f} per 10,000; {chosen['images']} calibration images, "
          f"{chosen['disagreements']} raw disagreements; {origin['origin']})", file=sys.stderr)
    out = {**chosen, "recheck_batch": rbatch, "dir": RECHECK_DIR, "recheck_spec": rspec.to_dict(),
           "recheck_backend": rbackend, "calibration": origin, "smoke": smoke,
           "seconds": round(time.perf_counter() - t0, 3)}
    if rsweep:
        out["recheck_sweep"] = rsweep
    return out


def _smoke(calibrate, low, ref, spec: Spec, device: str, count: int) -> dict:
    """Raw low-precision vs FP32 top-1 on procedural renders: a build that disagrees on most is broken."""
    pixels, origin = calibrate.generated_pixels(spec, count)
    a, _ = calibrate.classify(low, pixels, spec.batch_size, margin=True, device=device)
    b, _ = calibrate.classify(ref, pixels, 16, margin=True, device=device)
    rate = float((a == b).mean())
    if rate < SMOKE_AGREEMENT:
        raise RuntimeError(f"the {spec.precision} graph agrees with FP32 on {rate:.0%} of {count} renders "
                           f"(under {SMOKE_AGREEMENT:.0%}): the low-precision build is broken")
    return {"renders": count, "raw_agreement": round(rate, 4), "origin": origin["origin"]}


RECHECK_BATCHES = {"cuda": (8, 16, 32, 64), "cpu": (4, 8, 16)}


def measure_recheck_batch(net, spec: Spec, device: str, fraction: float) -> tuple[int, dict]:
    """(re-check batch, record): the FP32 graph's images/s per candidate batch (eager, as
    measure_batch_size), then the batch with the least expected re-check time for 10,000
    images at the calibration's re-checked fraction: ceil(k / R) calls of R images each."""
    import math

    fp32 = dataclasses.replace(spec, precision="fp32")
    _, sweep = measure_batch_size(fp32, None, device, RECHECK_BATCHES.get(device, RECHECK_BATCHES["cpu"]), net=net)
    k = max(1, math.ceil(fraction * 10_000))
    cost = {int(b): math.ceil(k / int(b)) * int(b) / r for b, r in sweep["images_per_s"].items()}
    best = min(cost, key=cost.get)
    return best, {**sweep, "chosen": best, "expected_rechecks_per_10k": k,
                  "expected_seconds_per_10k": {str(b): round(v, 3) for b, v in cost.items()}}


AUTO_BATCHES = {"cuda": (32, 40, 50, 64, 80, 100, 128), "cpu": (8, 16, 32)}  # 10,000 = 125 x 80: divisors pad less


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number or auto, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def measure_batch_size(spec: Spec, checkpoint: Path | None, device: str, candidates=None,
                       net=None) -> tuple[int, dict]:
    """(fastest batch, images/s per batch) of the policy network in eager mode on `device`;
    each candidate timed after one warm-up, synchronised. Recorded in the artifact.
    `net`: the FP32 network already loaded (else it is loaded from `checkpoint`)."""
    from engine.model import wrap

    net = net if net is not None else load_model(spec, checkpoint)
    rates = {}
    with torch.inference_mode():
        for b in candidates or AUTO_BATCHES.get(device, AUTO_BATCHES["cpu"]):
            m = wrap(net, dataclasses.replace(spec, batch_size=b), device)
            x = torch.randint(0, 256, (b, spec.input_size, spec.input_size, 3), dtype=torch.uint8, device=device)
            m(x)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(2):
                m(x)
            if device == "cuda":
                torch.cuda.synchronize()
            rates[b] = 2 * b / (time.perf_counter() - t)
    best = max(rates, key=rates.get)
    return best, {"chosen": best, "images_per_s": {str(k): round(v, 1) for k, v in rates.items()},
                  "how": "eager policy network, 2 timed calls per batch after a warm-up"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.cli import ArgumentParser, HelpFormatter

    p = ArgumentParser(prog="python -m engine.build", description=__doc__.split("\n\n")[0],
                       formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="timm name, e.g. eva02_large_patch14_448.mim_m38m_ft_in22k_in1k")
    p.add_argument("--checkpoint", type=Path, help="local .safetensors / .pth / .bin (every backend but null needs one)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--backend", choices=tuple(backends.BACKENDS), default=backends.DEFAULT)
    p.add_argument("--batch-size", type=_batch_size,
                   help="static batch; auto: the fastest of a short measured sweep on the build device")
    p.add_argument("--input-size", type=int)
    p.add_argument("--crop-mode", choices=CROP_MODES)
    p.add_argument("--crop-pct", type=float)
    p.add_argument("--interpolation")
    p.add_argument("--num-classes", type=int)
    p.add_argument("--model-kwargs", type=json.loads, help="extra timm constructor kwargs as JSON")
    g = p.add_argument_group("margin guard (precisions below fp32)")
    g.add_argument("--no-guard", dest="guard", action="store_false", help="build the raw low-precision form")
    g.add_argument("--calibration-source", choices=("photos", "renders"), default="photos",
                   help="images to choose tau on: crops of scikit-image's bundled photos, or procedural renders")
    g.add_argument("--calibration-images", type=Path,
                   help="folder of your own images (not evaluation data) to choose tau on, instead")
    g.add_argument("--calibration-count", type=int, default=256, help="calibration images used")
    g.add_argument("--guard-budget", type=float, default=10.0,
                   help="estimated disagreements per 10,000 images that tau must keep under")
    g.add_argument("--guard-safety", type=float, default=2.0, help="factor on the estimated disagreements")
    g.add_argument("--recheck-batch", type=_batch_size, default=8,
                   help="static batch of the FP32 re-check graph; auto: measured on the build device")
    g.add_argument("--recheck-backend", choices=tuple(backends.BACKENDS), default=None,
                   help="backend of the re-check graph (default: --backend)")
    a = p.parse_args(argv)
    if a.calibration_count < 16 or a.guard_safety < 1 or a.guard_budget <= 0:
        p.error("--calibration-count must be >= 16, --guard-safety >= 1 and --guard-budget > 0")
    if a.recheck_batch == "auto" and a.checkpoint is None:
        p.error("--recheck-batch auto measures the model: it needs --checkpoint")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        auto = a.batch_size == "auto"
        spec = resolve_spec(a.model, precision=a.precision, batch_size=None if auto else a.batch_size,
                            input_size=a.input_size, crop_mode=a.crop_mode, crop_pct=a.crop_pct,
                            interpolation=a.interpolation, num_classes=a.num_classes, model_kwargs=a.model_kwargs)
        sweep = None
        if auto:
            if a.checkpoint is None:
                raise ValueError("--batch-size auto measures the model: it needs --checkpoint")
            best, sweep = measure_batch_size(spec, a.checkpoint, a.device)
            spec = dataclasses.replace(spec, batch_size=best)
            print(f"engine.build: batch size {best} (measured: {sweep['images_per_s']} images/s)", file=sys.stderr)
        guard = GuardConfig(a.guard, a.calibration_images, a.calibration_count, a.guard_safety, a.recheck_batch,
                            a.recheck_backend, a.guard_budget, a.calibration_source)
        meta = build(spec, a.checkpoint, a.out, backend=a.backend, device=a.device, guard=guard, batch_sweep=sweep)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"engine.build: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(a.out), "backend": meta["backend"], "device": meta["device"],
                      "precision": meta["precision"], "batch_size": meta["batch_size"],
                      "seconds": meta["build"]["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
