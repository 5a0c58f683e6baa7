"""How many calibration images: the calibration's time against the re-check time it saves a run.

The guard's tau is chosen on a sample (engine.tuning.calibrate.choose_tau), and a small sample's
margin-error tail is taken at its upper confidence bound: the fewer images, the larger tau, and
the larger the share of a run's images re-checked in FP32. Each calibration image costs the build
one FP32 and one low-precision inference now; each re-checked image costs a run one FP32 inference.

A pilot of the first `calibration_count` images (both precisions, their rates measured) gives the
margins and the margin errors; for a count n the projection is choose_tau on the pilot with its
bound sized for n images (`bound_images`): f(n), the expected re-checked fraction. The count is

    n* = argmin over n in [pilot, cap] of  n x (t_fp32 + t_low)  +  R x f(n) x t_recheck

with t_fp32, t_low and t_recheck the seconds per image measured by the build, R the expected run
size (the caller's `--run-images`), and the cap the smallest of the deadline's share for
calibration (engine.tuning.reference cuts what does not fit it) and the source's variety (the
preset's `calibration_max_images`). The record holds the whole table.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from engine.tuning import calibrate
from engine.tuning.reference import Window

STEP = 1.25          # the counts weighed: the pilot, then x STEP each, then the cap


@dataclasses.dataclass(frozen=True)
class Pilot:
    """The first calibration images under both precisions: [n] top-1 and margins of each."""
    low_top1: np.ndarray
    low_margins: np.ndarray
    ref_top1: np.ndarray
    ref_margins: np.ndarray

    def __len__(self) -> int:
        return len(self.low_margins)


@dataclasses.dataclass(frozen=True)
class Rates:
    """Seconds per image, as the build measured them here."""
    fp32_s: float        # reading one calibration image and its FP32 reference pass
    low_s: float         # its low-precision pass
    recheck_s: float     # one re-checked image in a run (the FP32 graph)


def projected(pilot: Pilot, n: int, rule: calibrate.TauRule) -> dict:
    """choose_tau on the pilot with its tail bound sized for n calibration images."""
    return calibrate.choose_tau(pilot.low_top1, pilot.low_margins, pilot.ref_top1, pilot.ref_margins, rule,
                                bound_images=n)


def counts(lo: int, cap: int) -> list[int]:
    """The counts weighed: lo, lo x STEP, ... below cap, and cap."""
    out, n = [], max(lo, 1)
    while n < cap:
        out.append(n)
        n = max(n + 1, int(round(n * STEP)))
    return out + [max(cap, lo)]


@dataclasses.dataclass(frozen=True)
class Trade:
    """What the count is traded for: the run's expected size in images, the most images the
    calibration may take and why that many, and the rule tau is chosen with."""
    run_images: int
    cap: int
    rule: calibrate.TauRule
    cap_why: str = ""


def choose_count(pilot: Pilot, rates: Rates, trade: Trade) -> dict:
    """The count with the least calibration + expected re-check seconds (module docstring), and the table."""
    run_images, cap, rule = trade.run_images, trade.cap, trade.rule
    if run_images < 0 or min(rates.fp32_s, rates.low_s, rates.recheck_s) < 0:
        raise ValueError(f"the trade needs a run size and rates >= 0, got {run_images}, {rates}")
    rows = []
    for n in counts(len(pilot), cap):
        g = projected(pilot, n, rule)
        cal = n * (rates.fp32_s + rates.low_s)
        rec = run_images * g["rechecked_fraction"] * rates.recheck_s
        rows.append({"count": n, "tau": round(g["tau"], 6), "rechecked_fraction": round(g["rechecked_fraction"], 6),
                     "calibration_s": round(cal, 3), "recheck_s": round(rec, 3), "total_s": round(cal + rec, 3)})
    best = min(rows, key=lambda r: (r["total_s"], r["count"]))
    return {"count": best["count"], "tau": best["tau"], "rechecked_fraction": best["rechecked_fraction"],
            "calibration_s": best["calibration_s"], "recheck_s": best["recheck_s"], "pilot": len(pilot),
            "cap": cap, "cap_why": trade.cap_why, "run_images": run_images,
            "seconds_per_image": {"fp32": round(rates.fp32_s, 6), "low": round(rates.low_s, 6),
                                  "recheck": round(rates.recheck_s, 6)},
            "confidence": rule.confidence, "table": rows,
            "rule": "the count with the least count x (fp32 + low seconds per image) + run_images x "
                    "projected re-checked fraction x re-check seconds per image, between the pilot and "
                    "the cap (engine.tuning.calibration_trade)"}


def extended(fit, ref, low, stream: calibrate.Stream, window: Window, trade: Trade, batch: int = 16):
    """(reference, trade record): the pilot `fit` (engine.tuning.reference.Reference of the FP32 graph
    `ref`) classified by the low-precision margin graph `low` (timed), the count traded (choose_count,
    capped by what fits the window's seconds from now and by `trade.cap`, the source's most), then the
    FP32 reference extended over the stream to that count (engine.tuning.reference.fitted, cut by the
    same seconds)."""
    from engine.tuning import reference

    seconds, clock, device, max_images = window.seconds, window.clock, window.device, trade.cap
    t0 = clock()
    n0 = len(fit.pixels)
    low_top1, low_margins = calibrate.classify(low, fit.pixels, batch, margin=True, device=device)
    low_s = (clock() - t0) / max(n0, 1)
    rates = Rates(fit.seconds_per_image, low_s, fit.fp32_seconds_per_image)
    pilot = Pilot(low_top1, low_margins, fit.top1, fit.margins)
    left = seconds - (clock() - t0)
    per = rates.fp32_s + rates.low_s
    by_share = n0 + (int(left / per) if per > 0 else max_images)
    cap = max(n0, min(by_share, max_images))
    why = (f"the {seconds:.0f} s the deadline's share left for calibration" if by_share < max_images
           else f"the source's variety (calibration_max_images {max_images})")
    record = choose_count(pilot, rates, dataclasses.replace(trade, cap=cap, cap_why=why))
    if record["count"] <= n0:
        return fit, record
    more = reference.fitted(ref, stream, record["count"] - n0,
                            reference.Window(seconds - (clock() - t0), clock, device,
                                             later=rates.low_s / rates.fp32_s if rates.fp32_s > 0 else 0.0),
                            batch=batch)
    if len(more.pixels) == 0:            # the source ended with the pilot (a folder of that many images)
        record["taken"] = n0
        return fit, record
    origin = {**more.origin, "asked": record["count"], "pilot": n0}
    origin.pop("fit", None)
    if "fit" in more.origin:
        origin["fit"] = more.origin["fit"]
    out = reference.Reference(np.concatenate([fit.pixels, more.pixels]), np.concatenate([fit.top1, more.top1]),
                              np.concatenate([fit.margins, more.margins]), origin, more.cut or fit.cut,
                              more.seconds_per_image, more.fp32_seconds_per_image)
    record["taken"] = len(out.pixels)
    return out, record
