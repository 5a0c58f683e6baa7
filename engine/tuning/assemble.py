"""Assembling an artifact in its folder: the backend's graph, below FP32 the margin guard (tau
chosen on the calibration images, the FP32 re-check graph), then the manifest.

engine.build decides what to build (a fixed spec, or the measured choice of
engine.tuning.auto) and calls `assemble` with the build's context (engine.tuning.context.BuildContext:
the network, device, guard, work folder and manifest extras); the timing helpers for the batch sizes
live here too.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine import backends
from engine.classify.artifact import Artifact, write_manifest
from engine.core.spec import Spec
from engine.io import sha256_file
from engine.presets import PRESETS, Preset, preset, shared
from engine.tuning import calibrate
from engine.tuning.context import GuardConfig

if TYPE_CHECKING:
    from engine.tuning.context import BuildContext

RECHECK_DIR = "recheck"   # the guard's FP32 graph, built by the same backend, inside the artifact


def assemble(ctx: BuildContext, backend: str, spec: Spec, extra: dict | None = None, saved: dict | None = None,
             chosen_guard: tuple | None = None) -> dict:
    """The artifact's files and manifest in `ctx.work`: the backend's graph (`saved`: its manifest extras,
    when the search already wrote its files there), below fp32 the guard, then manifest.json.
    `extra`: the manifest's extras (None: the context's)."""
    from engine.core.precision import describe as describe_policy

    be = backends.get(backend)
    guarded = ctx.guard.enabled and spec.precision != "fp32" and be.NEEDS_WEIGHTS
    extra = {**(ctx.extra if extra is None else extra), "precision_policy": describe_policy(spec.precision)}
    extra.update(saved if saved is not None else be.save(ctx.net, spec, ctx.device, ctx.work, margin=guarded,
                                                         **quantized_args(be, spec, ctx.guard)))
    if guarded:
        extra["guard"] = build_guard(ctx, backend, spec, chosen_guard)
    extra["build"] = {**extra["build"], "seconds": round(time.perf_counter() - ctx.t0, 3)}
    ck_sha = sha256_file(ctx.checkpoint) if ctx.checkpoint is not None else None
    return write_manifest(ctx.work, spec, backend, ctx.device, ctx.checkpoint, ck_sha, extra)


def quantized_args(be, spec: Spec, guard: GuardConfig) -> dict:
    """save()'s calibration images for a precision the backend quantizes (int8: activation ranges
    observed on the guard's calibration source, never evaluation data); {} for the others.
    `guard`: with the preset's values filled in."""
    if spec.precision not in getattr(be, "QUANTIZED", ()):
        return {}
    return {"calibration": calibration_pixels(spec, guard)[0]}


SMOKE_AGREEMENT = shared("smoke_agreement")   # raw low precision agreeing with FP32 on fewer renders than this: a broken build


def calibration_stream(spec: Spec, cfg: GuardConfig) -> calibrate.Stream:
    """The guard's calibration source, read as far as it is needed (engine.tuning.reference times it)."""
    if cfg.calibration_images is not None:
        return calibrate.folder_stream(cfg.calibration_images, spec, cfg.calibration_check)
    if cfg.calibration_source == "renders":
        return calibrate.generated_stream(spec)
    if cfg.calibration_source == "photos":
        return calibrate.photo_stream(spec)
    raise ValueError(f"calibration source must be one of {calibrate.SOURCES}, got {cfg.calibration_source!r}")


def calibration_pixels(spec: Spec, cfg: GuardConfig) -> tuple:
    """(pixels [N, S, S, 3] uint8, origin record) of the guard's calibration source, all `calibration_count`."""
    s = calibration_stream(spec, cfg)
    pixels = s.take(cfg.calibration_count)
    s.at_least(calibrate.MIN_IMAGES)
    return pixels, s.origin()


def build_guard(ctx: BuildContext, backend: str, spec: Spec, chosen_guard: tuple | None = None) -> dict:
    """Choose tau with the compiled low-precision graph, then build the FP32 re-check graph.
    `chosen_guard`: (choose_tau's record, origin) when the search already chose tau with this graph."""
    import torch

    from engine.core.model import wrap

    t0 = time.perf_counter()
    cfg, device, tmp, net = ctx.guard, ctx.device, ctx.work, ctx.net
    view = Artifact(tmp, spec, backend, device, spec.precision, spec.batch_size, {}, {"guard": True})
    low = backends.get(backend).load(view, torch.device(device))   # the graph the run will execute
    ref = wrap(net, dataclasses.replace(spec, precision="fp32"), device, margin=True)
    if chosen_guard is not None:
        chosen, origin = chosen_guard
    else:
        pixels, origin = calibration_pixels(spec, cfg)
        low_top1, margins = calibrate.classify(low, pixels, spec.batch_size, margin=True, device=device)
        ref_top1, ref_margins = calibrate.classify(ref, pixels, calibrate.REFERENCE_BATCH, margin=True, device=device)
        chosen = calibrate.choose_tau(low_top1, margins, ref_top1, ref_margins, tau_rule(cfg, ctx.preset))
    smoke = smoke_check(calibrate, low, ref, spec, device, cfg.smoke_count)
    rbatch = cfg.recheck_batch
    rsweep = None
    if rbatch == "auto":
        rbatch, rsweep = measure_recheck_batch(net, spec, device, chosen["rechecked_fraction"], cfg.run_images)
        print(f"engine.build: re-check batch {rbatch} (measured: {rsweep['images_per_s']} images/s)", file=sys.stderr)
    rspec = dataclasses.replace(spec, precision="fp32", batch_size=rbatch)
    (tmp / RECHECK_DIR).mkdir()
    rbackend = cfg.recheck_backend or backend
    backends.get(rbackend).save(net, rspec, device, tmp / RECHECK_DIR, margin=False)
    print(f"engine.build: guard budget {cfg.budget:g} basis points of the images (safety x{cfg.safety:g}): "
          f"tau {chosen['tau']:.4f}, expected re-checked fraction {chosen['rechecked_fraction']:.1%} "
          f"(estimated {chosen['estimated_per_10k']:.2f} basis points; {chosen['images']} calibration images, "
          f"{chosen['disagreements']} raw disagreements; {origin['origin']})", file=sys.stderr)
    out = {**chosen, "recheck_batch": rbatch, "dir": RECHECK_DIR, "recheck_spec": rspec.to_dict(),
           "recheck_backend": rbackend, "calibration": origin, "smoke": smoke,
           "seconds": round(time.perf_counter() - t0, 3)}
    if rsweep:
        out["recheck_sweep"] = rsweep
    return out


def tau_rule(guard: GuardConfig, pre: Preset) -> calibrate.TauRule:
    """The guard's rule for tau: its budget and safety, the preset's tail confidence."""
    return calibrate.TauRule(guard.budget, guard.safety, pre.guard_confidence)


def smoke_check(calibrate, low, ref, spec: Spec, device: str, count: int) -> dict:
    """Raw low-precision vs FP32 top-1 on procedural renders: a build that disagrees on most is broken."""
    pixels, origin = calibrate.generated_pixels(spec, count)
    a, _ = calibrate.classify(low, pixels, spec.batch_size, margin=True, device=device)
    b, _ = calibrate.classify(ref, pixels, calibrate.REFERENCE_BATCH, margin=True, device=device)
    rate = float((a == b).mean())
    if rate < SMOKE_AGREEMENT:
        raise RuntimeError(f"the {spec.precision} graph agrees with FP32 on {rate:.0%} of {count} renders "
                           f"(under {SMOKE_AGREEMENT:.0%}): the low-precision build is broken")
    return {"renders": count, "raw_agreement": round(rate, 4), "origin": origin["origin"]}


RECHECK_BATCHES = {d: p.recheck_batches for d, p in PRESETS.items()}


def measure_recheck_batch(net, spec: Spec, device: str, fraction: float,
                          images: int | None = None) -> tuple[int, dict]:
    """(re-check batch, record): the FP32 graph's images/s per candidate batch (eager, as
    measure_batch_size), then the batch with the least expected re-check time. For a run of
    `images` images at the calibration's re-checked fraction, k = ceil(fraction x images) rows
    take ceil(k / R) calls of R images each; without `images` (a long run, its last call's
    padding negligible) the fastest batch."""
    import math

    fp32 = dataclasses.replace(spec, precision="fp32")
    _, sweep = measure_batch_size(fp32, None, device, RECHECK_BATCHES.get(device, RECHECK_BATCHES["cpu"]), net=net)
    rates = {int(b): r for b, r in sweep["images_per_s"].items()}
    if images is None:
        best = max(rates, key=rates.get)
        return best, {**sweep, "chosen": best, "run_images": None}
    k = max(1, math.ceil(fraction * images))
    cost = {b: math.ceil(k / b) * b / r for b, r in rates.items()}
    best = min(cost, key=cost.get)
    return best, {**sweep, "chosen": best, "run_images": images, "expected_rechecks": k,
                  "expected_seconds": {str(b): round(v, 3) for b, v in cost.items()}}


def measure_batch_size(spec: Spec, checkpoint: Path | None, device: str, candidates=None,
                       net=None) -> tuple[int, dict]:
    """(fastest batch, images/s per batch) of the policy network in eager mode on `device`;
    each candidate timed after one warm-up, synchronised. Recorded in the artifact.
    `net`: the FP32 network already loaded (else it is loaded from `checkpoint`)."""
    import torch

    from engine.core.checkpoint import load_model
    from engine.core.model import wrap

    net = net if net is not None else load_model(spec, checkpoint)
    rates = {}
    with torch.inference_mode():
        for b in candidates or preset(device).batch_sizes:
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
