"""The artifact's decoder, chosen as the build's other choices are: measured against the reference.

A fast decoder's pixels differ from PIL's by an IDCT rounding or a chroma upsampling step; on
an image whose FP32 top-1 is a near-tie that is enough to change the answer before any
precision is lowered. Most of all they differ in their resize: a run's JPEGs come at their
natural sizes, and each decoder brings them to the model's input with its own resampling and
crop. The build measures it the way the run decodes: JPEG crops of scikit-image's bundled photos
at natural sizes (`natural_jpegs`: from half to two and a half times the input side, aspect 1:2
to 2:1, quality 75-95; procedural renders where scikit-image is missing), decoded, resized and
cropped by the decoder and by PIL, both classified by the FP32 graph. A flip is an image whose
two answers differ; an image the decoder cannot read counts as one. (Images already at the input
size would skip every decoder's resize, the one step where they differ most.)

Order (`order`): the device's fast decoder first (`ENGINE_DECODER` pins where the order
starts), then its FALLBACK chain, PIL last (the reference: no flips by definition). The first
decoder that starts and whose flip rate d (basis points of the images, 1 = 0.01 %) is under
the disagreement budget B is taken; precision gets what it leaves, B - d (the guard's tau and
the search's agreement are held to that). One that breaks the budget, or cannot start, is one
stderr line. The artifact's manifest records the decoder (`decoder`), and `scripts/run`
decodes with it.

The end-to-end check of the artifact (engine.tuning.auto.verify_artifact) then holds the
decoder's flips and precision's together to B, with engine.tuning.calibrate.allowed_disagreements.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
from collections.abc import Callable, Sequence

import numpy as np

from engine.decoders.registry import FALLBACK
from engine.tuning.calibrate import BASIS_POINTS, REFERENCE_BATCH

REFERENCE = "pil"
NATURAL_SEED = 2             # the decoder check's crops: another draw than the calibration crops' (seed 1)
NATURAL_SIDES = (0.5, 2.5)   # a natural image's width, in input sides (log-uniform): smaller and larger
NATURAL_ASPECT = 2.0         # its aspect, log-uniform in [1 / this, this]
NATURAL_QUALITY = (75, 96)   # its JPEG quality, uniform in [lo, hi)

# pixels [n, S, S, 3] uint8 -> FP32 top-1 [n]
Classify = Callable[[np.ndarray], np.ndarray]


def _say(msg: str) -> None:
    print(f"engine.build: {msg}", file=sys.stderr, flush=True)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:200]


def natural_jpegs(spec, count: int, seed: int = NATURAL_SEED) -> tuple[list[bytes], dict]:
    """(count JPEG files at natural sizes, their record): crops of scikit-image's bundled photos
    (engine.tuning.calibrate.photo_sources; procedural renders where scikit-image is missing), each
    resized to a width of NATURAL_SIDES input sides and an aspect within NATURAL_ASPECT, then
    encoded at a quality in NATURAL_QUALITY. Every decoder resizes and crops them itself."""
    from PIL import Image

    from engine.tuning import calibrate

    rng = np.random.default_rng(seed)
    try:
        photos = calibrate.photo_sources()
        keys, origin = sorted(photos), "scikit-image bundled photos"
    except calibrate.CalibrationError:
        photos, keys, origin = None, [], "procedural renders (scikit-image is not installed)"
    temps = None
    out, sizes = [], []
    for i in range(count):
        w = max(16, int(round(spec.input_size * np.exp(rng.uniform(*np.log(NATURAL_SIDES))))))
        h = max(16, int(round(w / np.exp(rng.uniform(-np.log(NATURAL_ASPECT), np.log(NATURAL_ASPECT))))))
        if photos is not None:
            px = photos[keys[i % len(keys)]]
            hh, ww = px.shape[:2]
            # the largest region of the photo at aspect w:h, scaled by 50-100 %, placed at random
            scale = rng.uniform(0.5, 1.0)
            cw = max(8, int(min(ww, hh * w / h) * scale))
            ch = max(8, int(min(hh, ww * h / w) * scale))
            y, x = int(rng.integers(0, hh - ch + 1)), int(rng.integers(0, ww - cw + 1))
            img = Image.fromarray(px[y:y + ch, x:x + cw]).resize((w, h), Image.Resampling.LANCZOS)
        else:
            from engine.tuning.renders import render, templates

            temps = temps if temps is not None else templates(100, seed + 2000)
            img = Image.fromarray(render(temps[int(rng.integers(len(temps)))], w, h, rng))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=int(rng.integers(*NATURAL_QUALITY)))
        out.append(buf.getvalue())
        sizes.append((w, h))
    side = [max(s) for s in sizes] or [0]
    return out, {"origin": f"{origin}, crops at natural sizes, seed {seed}", "images": len(out),
                 "input_side": spec.input_size, "sides": [int(min(side)), int(max(side))],
                 "smaller_than_input": sum(1 for w, h in sizes if max(w, h) < spec.input_size),
                 "larger_than_input": sum(1 for w, h in sizes if min(w, h) > spec.input_size)}


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
    images: dict | None = None    # natural_jpegs' record of the files measured

    def record(self) -> dict:
        return {"name": self.name, "budget_per_10k": self.budget, "images": self.images,
                "precision_budget_per_10k": round(self.precision_budget, 4), "tried": self.tried,
                "rule": "the first decoder (fast first, PIL last) whose FP32 flips against FP32 on PIL's "
                        "pixels, on JPEGs at natural sizes each decoder resizes itself, in basis points, "
                        "are under the budget; precision gets the rest "
                        "(engine.tuning.decoder_choice)"}


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
        except Exception as e:  # noqa: BLE001 - a decoder that fails on the check's files is not taken
            why = _why(e)
            tried.append({"decoder": name, "holds": False, "why": f"failed: {why}"})
            _say(f"decoder {name} failed on the check's images ({why}); measuring the next")
            continue
        finally:
            getattr(dec, "close", lambda: None)()
        rec["holds"] = rec["per_10k"] < budget
        tried.append(rec)
        if rec["holds"]:
            return Choice(name, budget, budget - rec["per_10k"], tried)
        nxt = names[names.index(name) + 1] if names.index(name) + 1 < len(names) else REFERENCE
        _say(f"decoder {name} changes the FP32 answer on {rec['flips']} of {rec['images']} natural-size images "
             f"({rec['per_10k']:.0f} basis points, budget {budget:g}): "
             + ("the artifact decodes with pil, the reference" if nxt == REFERENCE else f"measuring {nxt} next"))
    tried.append({"decoder": REFERENCE, "images": len(blobs), "flips": 0, "per_10k": 0.0, "holds": True})
    return Choice(REFERENCE, budget, budget, tried)


def for_build(net, spec, device: str, budget: float, count: int, first: str | None = None,
              make: Callable[[str], tuple[object, str | None]] | None = None) -> Choice:
    """The build's decoder: `count` JPEGs at natural sizes (natural_jpegs), each decoder of
    `order(device, first)` against PIL under the FP32 graph of `net`, each through its own resize.
    `make(name)`: (decoder, None) or (None, why not); default: `start` in this process."""
    from engine.core.model import wrap
    from engine.tuning import calibrate

    fp32 = wrap(net, dataclasses.replace(spec, precision="fp32"), device)

    def classify(px: np.ndarray) -> np.ndarray:
        return calibrate.classify(fp32, px, REFERENCE_BATCH, margin=False, device=device)[0]

    blobs, images = natural_jpegs(spec, count)
    choice = choose(order(device, first), blobs, classify, budget, make or (lambda name: start(name, spec, REFERENCE_BATCH)))
    return dataclasses.replace(choice, images=images)
