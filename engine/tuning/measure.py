"""The real measurements behind engine.tuning.autotune: each
candidate's compiled graph timed and checked against FP32 on the calibration images (the network,
the images and the guard's budget come from the build's context, engine.tuning.context).

Timing follows the usual rules: the graph is warmed up first (lazy inits, autotuned
kernels, a first-call allocation), every clock read is synchronised with the device, and
the rate is the batch over the median of several timed calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import backends
from engine.classify.artifact import Artifact
from engine.core.model import wrap
from engine.core.spec import Spec
from engine.presets import shared
from engine.tuning import calibrate
from engine.tuning.autotune import Agreement, Candidate

if TYPE_CHECKING:
    from engine.tuning.context import BuildContext

MIN_CALLS, MIN_SECONDS, WARMUP = shared("timing_calls"), shared("timing_min_s"), shared("timing_warmup")
MAX_CALLS = shared("timing_max_calls")


def measurable_precisions(device: str) -> tuple[list[str], dict[str, str]]:
    """(precisions the search measures here, {precision: why not} for the others): those the device
    runs natively (engine.core.precision.native_precisions), and on the CPU int8 where its graph can
    be built (engine.core.int8.unavailable: the switch, the CPU's INT8 dot products, torchao)."""
    from engine.core.int8 import unavailable
    from engine.core.precision import native_precisions

    out, skipped = native_precisions(device)
    if device == "cpu":
        why = unavailable(device)
        if why:
            skipped["int8"] = why
        else:
            out.append("int8")
    return out, skipped


def importable_backends(device: str) -> tuple[list[str], dict[str, str]]:
    """The registry's backends `--backend auto` measures (AUTO) that can build here, and why the
    others that would cannot (their `unavailable(device)`)."""
    out, skipped = [], {}
    for name in backends.BACKENDS:
        mod = backends.get(name)
        if not getattr(mod, "AUTO", False):
            continue
        why = mod.unavailable(device) if hasattr(mod, "unavailable") else None
        if why:
            skipped[f"backend {name}"] = why
        else:
            out.append(name)
    return out, skipped


@contextlib.contextmanager
def own_inductor_cache(folder: Path | None):
    """Inductor's cache in `folder` for the block (None: left where it is): what a compile grows there
    lies inside the search's work folder and goes with it. The Triton kernel cache stays where the
    build's environment points (kernels, small beside the weights a compiled object holds)."""
    if folder is None:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    folder.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(folder)):
        yield


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rate(fn, x: torch.Tensor, device: str, clock=time.perf_counter, warmup: int = WARMUP, calls: int = MIN_CALLS,
         seconds: float = MIN_SECONDS) -> float:
    """images/s of fn on batch x: after `warmup` calls, the batch over the median call time of at
    least `calls` calls and `seconds` seconds, each call synchronised."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn(x)
        _sync(device)
        times: list[float] = []
        start = clock()
        while len(times) < calls or clock() - start < seconds:
            t = clock()
            fn(x)
            _sync(device)
            times.append(clock() - t)
            if len(times) >= MAX_CALLS:
                break
    return x.shape[0] / statistics.median(times)


@dataclasses.dataclass
class Handle:
    fn: object                      # fn(uint8 [B, S, S, 3]) -> top-1 (, margin)
    folder: Path | None             # the backend's files (None: eager, nothing written)
    extras: dict                    # the backend's manifest extras
    cache: Path | None = None       # the compile's own Inductor cache (removed with a losing candidate)


class Measurer:
    """engine.tuning.autotune.Measurer on the real network of the build's context: its calibration
    reference's pixels [N, S, S, 3] are the images, its top-1 and margins the FP32 graph's on them;
    compiled candidates are written under `workdir/<name>`."""

    def __init__(self, ctx: BuildContext, workdir: Path):
        self.net, self.spec, self.device = ctx.net, ctx.spec, ctx.device
        cal = ctx.calibration
        self.pixels, self.ref_top1, self.ref_margins = cal.pixels, cal.top1, cal.margins
        self.workdir, self.budget = workdir, ctx.guard.budget
        self.alpha = ctx.preset.verify_alpha
        self.rule = calibrate.TauRule(ctx.guard.budget, ctx.guard.safety, ctx.preset.guard_confidence)
        rbatch = ctx.guard.recheck_batch
        self.recheck_batch = rbatch if isinstance(rbatch, int) else ctx.preset.recheck_batch
        self._recheck_rate: float | None = None
        self._screens: dict[tuple[str, int], float] = {}
        s = self.spec.input_size
        self._x = {}
        self._shape = lambda b: (b, s, s, 3)

    def _batch(self, b: int) -> torch.Tensor:
        if b not in self._x:   # real calibration pixels, so the timed graph sees natural inputs
            x = np.resize(self.pixels, self._shape(b)).astype(np.uint8)
            self._x[b] = torch.from_numpy(x).to(self.device)
        return self._x[b]

    def _spec(self, c_precision: str, b: int) -> Spec:
        return dataclasses.replace(self.spec, precision=c_precision, batch_size=b)

    def screen(self, precision: str, batch_size: int) -> float:
        if precision == "int8":
            # int8 has no eager form (it is quantized from the FP32 graph for the compile): the FP32
            # network's screen stands in, so int8 is compiled at the batches FP32 is
            return self._screens.get(("fp32", batch_size)) or self.screen("fp32", batch_size)
        self._screens[(precision, batch_size)] = self._screen(precision, batch_size)
        return self._screens[(precision, batch_size)]

    def _screen(self, precision: str, batch_size: int) -> float:
        m = wrap(self.net, self._spec(precision, batch_size), self.device, margin=precision != "fp32")
        # a screen only orders the compiles: one warm-up and two timed calls (an emulated precision
        # can take seconds a call)
        return rate(m, self._batch(batch_size), self.device, warmup=1, calls=2, seconds=0.0)

    def compile(self, c: Candidate) -> Handle:
        """The candidate's graph in `workdir/<name>`; a compiling backend's Inductor cache in
        `workdir/.inductor/<name>` (this build's own, removed with the candidate when it loses)."""
        spec = self._spec(c.precision, c.batch_size)
        margin = c.precision != "fp32"
        be = backends.get(c.backend)
        name = c.name.replace("/", "_").replace("+", "_")
        folder = self.workdir / name
        folder.mkdir(parents=True)
        kwargs = {"options": c.options} if c.options != "default" else {}
        if c.precision in getattr(be, "QUANTIZED", ()):   # int8: activation ranges from the calibration images
            kwargs["calibration"] = self.pixels
        cache = self.workdir / ".inductor" / name if getattr(be, "COMPILES", False) else None
        h = Handle(None, folder, {}, cache)
        try:
            with own_inductor_cache(cache):
                h.extras = be.save(self.net, spec, self.device, folder, margin=margin, **kwargs)
            view = Artifact(folder, spec, c.backend, self.device, c.precision, c.batch_size, {},
                            {"guard": True} if margin else {})
            h.fn = be.load(view, torch.device(self.device))
        except BaseException:
            self.discard(h)          # what a failed compile wrote goes with it
            raise
        return h

    def discard(self, h: Handle) -> None:
        """A losing candidate's files and its Inductor cache, removed."""
        import shutil

        for p in (h.folder, h.cache):
            if p is not None and p.is_relative_to(self.workdir):
                shutil.rmtree(p, ignore_errors=True)
        h.fn = None   # the loaded graph's memory goes with the last reference

    def time(self, h: Handle, c: Candidate) -> float:
        fn = h.fn
        if c.cuda_graphs:
            from engine.classify.runtime import _capture

            fn, status = _capture(fn, self._shape(c.batch_size), torch.device(self.device))
            if status != "captured":
                raise RuntimeError(f"CUDA graph capture {status}")
        return rate(fn, self._batch(c.batch_size), self.device)

    def agree(self, h: Handle, c: Candidate) -> Agreement:
        n = len(self.pixels)
        if c.precision == "fp32":
            top1, _ = calibrate.classify(h.fn, self.pixels, c.batch_size, margin=False, device=self.device)
            wrong = int((top1 != self.ref_top1).sum())
            allowed = calibrate.allowed_disagreements(self.budget, n, self.alpha)   # the end-to-end check's gate
            return Agreement(1 - wrong / n, wrong <= allowed,
                             f"{wrong} of {n} calibration images disagree with the FP32 graph" if wrong > allowed
                             else "")
        top1, margins = calibrate.classify(h.fn, self.pixels, c.batch_size, margin=True, device=self.device)
        g = calibrate.choose_tau(top1, margins, self.ref_top1, self.ref_margins, self.rule)
        guarded = np.where(margins < g["tau"], self.ref_top1, top1)   # the guard's FP32 answers below tau
        agreement = float((guarded == self.ref_top1).mean())
        holds = g["estimated_per_10k"] <= self.budget
        why = "" if holds else (f"no tau holds the budget: {g['estimated_per_10k']:.1f} basis points of estimated "
                                f"disagreements > {self.budget:g}")
        return Agreement(agreement, holds, why, g["tau"], g["rechecked_fraction"], g["estimated_per_10k"], g)

    def recheck_rate(self) -> float:
        """images/s of the guard's FP32 re-check graph at its batch on this device (the FP32 policy
        network, eager: its GEMMs are the cost a compile leaves), measured once and kept."""
        if self._recheck_rate is None:
            b = self.recheck_batch
            m = wrap(self.net, self._spec("fp32", b), self.device)
            self._recheck_rate = rate(m, self._batch(b), self.device)
        return self._recheck_rate
