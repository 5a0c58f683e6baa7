"""The artifact's decoder, chosen as the build's other choices are: measured against the reference.

A fast decoder's pixels differ from PIL's by an IDCT rounding or a chroma upsampling step; on
an image whose FP32 top-1 is a near-tie that is enough to change the answer before any
precision is lowered. The build measures it the way the run decodes: the calibration images
written as JPEG files (quality 95, `jpeg_blobs`), decoded by the decoder and by PIL, both
classified by the FP32 graph. A flip is an image whose two answers differ; an image the
decoder cannot read counts as one.

Order (`order`): the device's fast decoder first (`ENGINE_DECODER` pins where the order
starts), then its FALLBACK chain, PIL last (the reference: no flips by definition). The first
decoder that starts and whose flip rate d (basis points of the images, 1 = 0.01 %) is under
the disagreement budget B is taken; precision gets what it leaves, B - d (the guard's tau and
the search's agreement are held to that). One that breaks the budget, or cannot start, is one
stderr line. The artifact's manifest records the decoder (`decoder`), and `scripts/run`
decodes with it.

The end-to-end check of the artifact (engine.build.auto.verify_artifact) then holds the
decoder's flips and precision's together to B, with engine.build.calibrate.allowed_disagreements.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
from collections.abc import Callable, Sequence

import numpy as np

from engine.build.calibrate import BASIS_POINTS, REFERENCE_BATCH
from engine.decoders.registry import FALLBACK

JPEG_QUALITY = 95            # the verification files: a camera's quality, PIL's encoder
REFERENCE = "pil"

# pixels [n, S, S, 3] uint8 -> FP32 top-1 [n]
Classify = Callable[[np.ndarray], np.ndarray]


def _say(msg: str) -> None:
    print(f"engine.build: {msg}", file=sys.stderr, flush=True)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:200]


def jpeg_blobs(pixels: np.ndarray, n: int) -> list[bytes]:
    """The first n of pixels [N, S, S, 3] uint8 as JPEG files (quality JPEG_QUALITY, PIL's encoder)."""
    from PIL import Image

    out = []
    for i in range(min(n, len(pixels))):
        buf = io.BytesIO()
        Image.fromarray(pixels[i]).save(buf, "JPEG", quality=JPEG_QUALITY)
        out.append(buf.getvalue())
    return out


def rate_bp(count: int, n: int) -> float:
    """count of n images, in basis points."""
    return BASIS_POINTS * count / n if n else 0.0


def order(device: str, first: str | None = None) -> list[str]:
    """The decoders to try: `first` (default: the device's fast one), its FALLBACK chain, PIL last."""
    from engine.decoders import default_decoder

    name, out = first or default_decoder(device), []
    while name is not None and name not in out:
        out.append(name)
        name = FALLBACK.get(name)
    return out if out[-1] == REFERENCE else out + [REFERENCE]


def decoded(dec, blobs: list[bytes], batch: int) -> tuple[np.ndarray, set[int]]:
    """(pixels [n, S, S, 3] uint8 on the host, rows it could not read) of `dec` over `blobs`,
    in chunks of its batch; a GPU decoder works on its own stream, waited for here."""
    parts, failed = [], set()
    stream = getattr(dec, "stream", None)
    for lo in range(0, len(blobs), batch):
        if stream is not None:
            import torch

            ctx = torch.cuda.stream(stream)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            px, bad = dec.decode(blobs[lo:lo + batch])
        if stream is not None:
            stream.synchronize()
        parts.append(px.cpu().numpy() if hasattr(px, "cpu") else np.asarray(px))
        failed.update(lo + i for i in bad)
    return np.concatenate(parts), failed


def flips(dec, blobs: list[bytes], classify: Classify, want: np.ndarray, batch: int = REFERENCE_BATCH) -> dict:
    """The decoder's own disagreements: FP32 on its pixels against FP32 on PIL's (`want` [n])."""
    px, failed = decoded(dec, blobs, batch)
    got = classify(px)
    bad = (got != want)
    bad[list(failed)] = True
    n = len(blobs)
    return {"decoder": getattr(dec, "name", "?"), "images": n, "flips": int(bad.sum()),
            "unreadable": len(failed), "per_10k": round(rate_bp(int(bad.sum()), n), 3)}


def start(name: str, spec, batch: int) -> tuple[object | None, str | None]:
    """(decoder `name` in this process, None), or (None, why it cannot start here): a package or
    device it lacks, an error building it, or a fallback to another decoder."""
    from engine.decoders import make_decoder, start_problem

    why = start_problem(name)
    if why is not None:
        return None, why
    try:
        dec = make_decoder(name, spec, batch, None, isolate=False)
    except Exception as e:  # noqa: BLE001 - a driver or pipeline error: this decoder is not measured
        return None, _why(e)
    if getattr(dec, "name", name) != name:
        return None, f"it fell back to {dec.name}"
    return dec, None


@dataclasses.dataclass
class Choice:
    """The decoder taken, and what it leaves of the budget to precision."""
    name: str
    budget: float                 # the disagreement budget B, basis points
    precision_budget: float       # B - the decoder's flip rate
    tried: list[dict]             # one record per decoder measured or skipped, in order

    def record(self) -> dict:
        return {"name": self.name, "budget_per_10k": self.budget,
                "precision_budget_per_10k": round(self.precision_budget, 4), "tried": self.tried,
                "rule": "the first decoder (fast first, PIL last) whose FP32 flips against FP32 on PIL's "
                        "pixels, in basis points, are under the budget; precision gets the rest "
                        "(engine.build.decoder_choice)"}


def choose(names: Sequence[str], blobs: list[bytes], classify: Classify, budget: float,
           make: Callable[[str], tuple[object, str | None]]) -> Choice:
    """The first of `names` whose flip rate on `blobs` stays under `budget` (basis points); PIL,
    the reference, always holds. `make(name)` -> (decoder, None) or (None, why it cannot start)."""
    tried: list[dict] = []
    want = None
    for name in names:
        if name == REFERENCE:
            tried.append({"decoder": name, "images": len(blobs), "flips": 0, "per_10k": 0.0, "holds": True})
            return Choice(name, budget, budget, tried)
        dec, why = make(name)
        if dec is None:
            tried.append({"decoder": name, "holds": False, "why": f"cannot start: {why}"})
            _say(f"decoder {name} cannot start here ({why}); measuring the next")
            continue
        if want is None:
            pil, _ = make(REFERENCE)
            want = classify(decoded(pil, blobs, REFERENCE_BATCH)[0])     # [n] FP32 on PIL's pixels
        try:
            rec = flips(dec, blobs, classify, want)
        except Exception as e:  # noqa: BLE001 - a decoder that fails on the calibration files is not taken
            why = _why(e)
            tried.append({"decoder": name, "holds": False, "why": f"failed: {why}"})
            _say(f"decoder {name} failed on the calibration images ({why}); measuring the next")
            continue
        finally:
            getattr(dec, "close", lambda: None)()
        rec["holds"] = rec["per_10k"] < budget
        tried.append(rec)
        if rec["holds"]:
            return Choice(name, budget, budget - rec["per_10k"], tried)
        nxt = names[names.index(name) + 1] if names.index(name) + 1 < len(names) else REFERENCE
        _say(f"decoder {name} changes the FP32 answer on {rec['flips']} of {rec['images']} calibration images "
             f"({rec['per_10k']:.0f} basis points, budget {budget:g}): "
             + ("the artifact decodes with pil, the reference" if nxt == REFERENCE else f"measuring {nxt} next"))
    tried.append({"decoder": REFERENCE, "images": len(blobs), "flips": 0, "per_10k": 0.0, "holds": True})
    return Choice(REFERENCE, budget, budget, tried)


def for_build(net, spec, device: str, pixels: np.ndarray, budget: float, count: int, first: str | None = None,
              make: Callable[[str], tuple[object, str | None]] | None = None) -> Choice:
    """The build's decoder: the first `count` calibration images (pixels [N, S, S, 3] uint8) as JPEG
    files, each decoder of `order(device, first)` against PIL under the FP32 graph of `net`.
    `make(name)`: (decoder, None) or (None, why not); default: `start` in this process."""
    from engine.build import calibrate
    from engine.core.model import wrap

    fp32 = wrap(net, dataclasses.replace(spec, precision="fp32"), device)

    def classify(px: np.ndarray) -> np.ndarray:
        return calibrate.classify(fp32, px, REFERENCE_BATCH, margin=False, device=device)[0]

    blobs = jpeg_blobs(pixels, count)
    return choose(order(device, first), blobs, classify, budget, make or (lambda name: start(name, spec, REFERENCE_BATCH)))
