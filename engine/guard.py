"""The margin guard: an FP32 re-check of the images a low-precision graph nearly tied on.

The low-precision graph returns top-1 and its margin (top-1 minus top-2 logit, FP32).
Where the margin is under tau, rounding may have swapped the two leading classes, so
those images go through a second, FP32 graph (a static small batch, padded) and take
its answer. The re-check runs on the batch's pixels right after the batch: no extra
pass over files. tau is chosen at build time (engine.calibrate).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class GuardStats:
    images: int = 0          # images the guard looked at
    rechecked: int = 0       # of those, re-run in FP32
    changed: int = 0         # of those, whose top-1 the FP32 graph changed
    seconds: float = 0.0     # wall time of the re-checks (synchronised)
    calls: int = 0           # FP32 graph calls (each a padded static batch)
    margins: list[float] = field(default_factory=list)  # margins of the re-checked images (first 1000)

    def report(self, tau: float, batch: int) -> dict:
        return {"tau": tau, "recheck_batch": batch, "images": self.images, "rechecked": self.rechecked,
                "fraction": round(self.rechecked / self.images, 6) if self.images else 0.0,
                "changed": self.changed, "seconds": round(self.seconds, 4), "calls": self.calls}


class Guard:
    """Re-runs low-margin rows of a batch through `recheck(x [R, S, S, 3] uint8) -> int32 [R]`."""

    def __init__(self, recheck, tau: float, batch: int):
        if tau < 0 or batch < 1:
            raise ValueError(f"guard needs tau >= 0 and a batch >= 1, got {tau}, {batch}")
        self.recheck, self.tau, self.batch = recheck, float(tau), batch
        self.stats = GuardStats()

    def apply(self, x: torch.Tensor, top1: torch.Tensor, margin: torch.Tensor, valid: int | None = None
              ) -> torch.Tensor:
        """top1 [B] int32 with every row whose margin < tau replaced by the FP32 answer.

        x: [B, S, S, 3] uint8 on the graphs' device; rows at and past `valid` are padding.
        """
        n = x.shape[0] if valid is None else valid
        low = torch.nonzero(margin[:n] < self.tau).flatten()          # [k] rows to re-check (syncs)
        self.stats.images += n
        if low.numel() == 0:
            return top1
        t0 = time.perf_counter()
        top1 = top1.clone()
        for lo in range(0, low.numel(), self.batch):
            rows = low[lo:lo + self.batch]
            chunk = x.new_zeros((self.batch,) + tuple(x.shape[1:]))    # [R, S, S, 3]: the static shape
            chunk[: rows.numel()] = x[rows]
            out = self.recheck(chunk)
            out = out[0] if isinstance(out, (list, tuple)) else out
            fixed = out[: rows.numel()].to(top1.device, top1.dtype)
            self.stats.changed += int((fixed != top1[rows]).sum())
            top1[rows] = fixed
            self.stats.calls += 1
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.rechecked += low.numel()
        if len(self.stats.margins) < 1000:
            self.stats.margins += [round(float(v), 4) for v in margin[low].tolist()]
        return top1
