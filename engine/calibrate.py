"""Choosing the guard's tau at build time, on images that are not evaluation data.

Images: the procedural renders of engine.renders (default), or a folder the user names;
a folder that engine.dataset_flags flags as ImageNet-validation-like is refused. Each
image is preprocessed by the PIL reference path of the spec.

Both precisions classify every image: the compiled low-precision graph (top-1 and its
margin) and the FP32 reference. tau = safety x the largest low-precision margin at which
the two disagree (floored by the logit error bound, see `choose_tau`). The disagreement
curve (how many disagreements remain above each margin, how many images a threshold
re-checks) is recorded with it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from engine.spec import Spec

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
DEFAULT_COUNT = 256
MAX_FILE_BYTES = 64 << 20


class CalibrationError(ValueError):
    """The calibration images cannot be used."""


def generated_pixels(spec: Spec, count: int = DEFAULT_COUNT, seed: int = 1) -> tuple[np.ndarray, dict]:
    """([count, S, S, 3] uint8 renders through the reference preprocessing, record)."""
    import io

    from PIL import Image

    from engine.decoders.pil import decode_pil
    from engine.renders import render, templates

    rng = np.random.default_rng(seed)
    temps = templates(100, seed + 1000)       # another world of templates than the test cohorts'
    out = np.zeros((count, spec.input_size, spec.input_size, 3), np.uint8)
    h = hashlib.sha256()
    for i in range(count):
        w, hh = (int(v) for v in rng.integers(150, 600, 2))
        px = render(temps[int(rng.integers(len(temps)))], w, hh, rng)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "PNG")
        out[i] = decode_pil(buf.getvalue(), spec)
        h.update(out[i].tobytes())
    return out, {"origin": f"procedural renders (engine.renders), seed {seed}", "count": count,
                 "pixels_sha256": h.hexdigest()}


def folder_pixels(folder: Path, spec: Spec, count: int = DEFAULT_COUNT) -> tuple[np.ndarray, dict]:
    """([n, S, S, 3] uint8 of the first `count` images of `folder`, sorted by path; record).

    Refuses a folder whose file names or answer-like files look like ImageNet validation data.
    """
    from engine.dataset_flags import content_flags, name_flags
    from engine.decoders.pil import decode_pil

    folder = Path(folder)
    if not folder.is_dir():
        raise CalibrationError(f"calibration folder not found: {folder}")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    flags = []
    for p in files:
        rel = p.relative_to(folder).as_posix()
        flags += [f"{rel}: {f}" for f in name_flags(rel)]
        if p.suffix.lower() not in IMAGE_SUFFIXES:
            flags += [f"{rel}: {f}" for f in content_flags(p)]
    if flags:
        raise CalibrationError(f"{folder} looks like ImageNet validation data, which must never feed a build: "
                               + "; ".join(flags[:3]) + (f" (+{len(flags) - 3} more)" if len(flags) > 3 else ""))
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES][:count]
    pixels, h, used = [], hashlib.sha256(), []
    for p in images:
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        data = p.read_bytes()
        try:
            px = decode_pil(data, spec)
        except Exception:  # noqa: BLE001 - an unreadable file is skipped, and counted
            continue
        pixels.append(px)
        used.append(p)
        h.update(p.relative_to(folder).as_posix().encode() + b"\0" + hashlib.sha256(data).digest())
    if len(pixels) < 16:
        raise CalibrationError(f"{folder}: {len(pixels)} readable images; the guard needs at least 16")
    return np.stack(pixels), {"origin": f"folder {os.path.abspath(folder)}", "count": len(pixels),
                              "skipped": len(images) - len(pixels), "files_sha256": h.hexdigest()}


def classify(fn, pixels: np.ndarray, batch: int, margin: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Run a static-batch graph over [N, S, S, 3] pixels (last batch padded): top-1 [N] (and margins [N])."""
    import torch

    n = len(pixels)
    top1, margins = np.zeros(n, np.int64), np.zeros(n, np.float32)
    with torch.inference_mode():
        for lo in range(0, n, batch):
            chunk = np.zeros((batch,) + pixels.shape[1:], np.uint8)
            m = min(batch, n - lo)
            chunk[:m] = pixels[lo:lo + m]
            out = fn(torch.from_numpy(chunk))
            if margin:
                t, g = out[0], out[1]
                margins[lo:lo + m] = g[:m].float().cpu().numpy()
            else:
                t = out[0] if isinstance(out, (list, tuple)) else out
            top1[lo:lo + m] = t[:m].cpu().numpy()
    return top1, (margins if margin else None)


def choose_tau(low_top1: np.ndarray, margins: np.ndarray, ref_top1: np.ndarray, safety: float = 2.0,
               floor: float = 0.0) -> dict:
    """tau and the disagreement curve from the low-precision (top-1, margin) and the FP32 top-1.

    tau = safety x max(largest margin at which the two disagree, floor). The floor keeps
    tau above zero when the calibration set shows no disagreement at all (a clean set
    proves nothing about margins it never saw).
    """
    if safety < 1:
        raise ValueError(f"safety factor must be >= 1, got {safety}")
    disagree = low_top1 != ref_top1
    worst = float(margins[disagree].max()) if disagree.any() else 0.0
    tau = safety * max(worst, floor)
    grid = sorted({0.0, tau, worst, *np.quantile(margins, [0.01, 0.02, 0.05, 0.1, 0.2]).tolist()})
    curve = [{"threshold": round(float(t), 6),
              "rechecked_fraction": round(float((margins < t).mean()), 6),
              "disagreements_left": int((disagree & (margins >= t)).sum())} for t in grid]
    return {"tau": tau, "safety": safety, "floor": floor, "largest_disagreeing_margin": worst,
            "images": int(len(margins)), "disagreements": int(disagree.sum()),
            "rechecked_fraction": float((margins < tau).mean()), "curve": curve}
