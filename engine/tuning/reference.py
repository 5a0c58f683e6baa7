"""The FP32 calibration reference, timed against the calibration phase's share of the build's deadline.

The calibration images come from a source read only as far as it is needed (engine.tuning.calibrate.Stream).
Batch by batch, each is read and classified by the FP32 graph; the seconds per image measured so far
(reading it, its FP32 pass, and the `later` passes the phase still makes for it: the decoder's check
reads and classifies one natural-size JPEG per calibration image, twice; the count trade's extension
its low-precision pass), as the last batch took them, decide whether one more
batch fits the share. So the
first batch measures the rate, a machine slower than planned takes fewer images, and one that slows
down midway stops early. The first batch is the guard's minimum (calibrate.MIN_IMAGES): never fewer.
A cut is one line ("calibration: 64 of 256 images fit the 40 s left for it at 1.6 images/s") and the
record (`origin`) counts the images actually used; every later pass over the calibration images (the
search's agreement, the guard's tau) reads those and no more. `seconds_per_image` and
`fp32_seconds_per_image` are the rates the count trade (engine.tuning.calibration_trade) weighs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from engine.tuning import calibrate


@dataclasses.dataclass
class Reference:
    pixels: np.ndarray              # [n, S, S, 3] uint8, the calibration images used
    top1: np.ndarray                # [n] the FP32 graph's top-1
    margins: np.ndarray             # [n] its top-1 minus top-2 logit
    origin: dict                    # the source's record: count n, asked, and the fit when cut
    cut: str | None = None          # the line that says what the share cut (None: nothing)
    seconds_per_image: float = 0.0  # reading one image and its FP32 pass, as the last batch took them
    fp32_seconds_per_image: float = 0.0   # its FP32 pass alone


@dataclasses.dataclass(frozen=True)
class Window:
    """The time a reference pass may take: `seconds` from now on `clock`, on `device`, counting
    `later` more passes of the phase over each image taken."""
    seconds: float
    clock: Callable[[], float]
    device: str
    later: float = 0.0


def fitted(ref, stream: calibrate.Stream, count: int, window: Window,
           batch: int = calibrate.REFERENCE_BATCH) -> Reference:
    """The FP32 reference `ref` (a margin graph) over as many of `count` images of `stream` as fit
    the window's seconds, counting its `later` more passes over each image; at least the first batch
    (the guard's minimum), whatever it costs."""
    seconds, clock, device, later = window.seconds, window.clock, window.device, window.later
    t0 = clock()
    first = min(count, max(batch, calibrate.MIN_IMAGES))
    pixels, top1, margins = [], [], []
    taken, spent_per_image = 0, 0.0      # spent_per_image: seconds to read and classify one image, lately
    fp32_per_image = 0.0                 # of which the FP32 pass
    ended = False                        # the source had no more images

    def owed() -> float:                 # the phase's seconds for what is taken: spent, and the later passes
        return (clock() - t0) + later * spent_per_image * taken

    while taken < count:
        k = first if taken == 0 else min(batch, count - taken)
        if taken and owed() + (1 + later) * spent_per_image * k > seconds:
            break
        t = clock()
        px = stream.take(k)
        if len(px) == 0:
            ended = True
            break
        t_read = clock()
        t1, m = calibrate.classify(ref, px, batch, margin=True, device=device)
        fp32_per_image = (clock() - t_read) / len(px)
        pixels.append(px)
        top1.append(t1)
        margins.append(m)
        taken += len(px)
        spent_per_image = (clock() - t) / len(px)     # the last batch's: the first one's warm-up forgotten
        if len(px) < k:
            ended = True
            break
    stream.at_least(min(count, calibrate.MIN_IMAGES))
    origin = {**stream.origin(), "asked": count}
    if not pixels:                       # a source that had ended before this call (an extension of it)
        pixels, top1, margins = [np.zeros((0, 0, 0, 3), np.uint8)], [np.zeros(0, np.int64)], [np.zeros(0, np.float32)]
    out = Reference(np.concatenate(pixels), np.concatenate(top1), np.concatenate(margins), origin,
                    seconds_per_image=spent_per_image, fp32_seconds_per_image=fp32_per_image)
    if taken < count and not ended:
        rate = 1.0 / ((1 + later) * spent_per_image) if spent_per_image > 0 else float("inf")
        if taken <= first and owed() > seconds:
            out.cut = (f"calibration: {taken} of {count} images (the guard's minimum) need about {owed():.0f} s at "
                       f"{rate:.2g} images/s, over the {seconds:.0f} s left for it")
        else:
            out.cut = (f"calibration: {taken} of {count} images fit the {seconds:.0f} s left for it at "
                       f"{rate:.2g} images/s")
        origin["fit"] = {"seconds": round(seconds, 1), "images_per_s": round(rate, 3), "later_passes": later}
    return out
