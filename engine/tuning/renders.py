"""Procedural renders of seeded "class templates": images that are not photos and not ImageNet.

A template is colour blobs over a background gradient with oriented stripes; each
render jitters it. Used for generated cohorts, for fitting a test head whose logits
look trained, and as the smoke check of a guarded low-precision build (the guard's tau
comes from natural photos: engine.tuning.calibrate).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Template:
    centers: np.ndarray   # [3, 2] blob centres in relative (x, y)
    radii: np.ndarray     # [3] relative radii
    colors: np.ndarray    # [3, 3] blob colours
    bg: np.ndarray        # [2, 3] gradient end colours
    angle: float          # gradient and stripe direction
    freq: float           # stripe cycles across the image
    amp: float            # stripe amplitude


def templates(k: int, seed: int) -> list[Template]:
    """`k` class templates, fixed by `seed`."""
    rng = np.random.default_rng(seed)
    return [Template(rng.uniform(0.15, 0.85, (3, 2)), rng.uniform(0.08, 0.3, 3), rng.uniform(0, 255, (3, 3)),
                     rng.uniform(0, 255, (2, 3)), float(rng.uniform(0, np.pi)), float(rng.uniform(1, 12)),
                     float(rng.uniform(10, 50)))
            for _ in range(k)]


def render(t: Template, w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """[h, w, 3] uint8 render of template `t` with per-image jitter.

    Built channel by channel ([3, h, w], each channel's loops over whole rows) from a coordinate
    row [1, w] and column [h, 1] that broadcast: the same operations on the same values, in the
    same order, as one [h, w, 3] array of full grids, so the same bytes (tests/test_cohort.py),
    in about a third of the time."""
    x = np.arange(w, dtype=np.float32)[None, :] / max(w - 1, 1)     # [1, w]
    y = np.arange(h, dtype=np.float32)[:, None] / max(h - 1, 1)     # [h, 1]
    d = np.cos(t.angle) * x + np.sin(t.angle) * y                   # [h, w]
    img = np.empty((3, h, w))                                        # float64, channels first
    for k in range(3):
        img[k] = t.bg[0][k] * (1 - d) + t.bg[1][k] * d
    img += t.amp * np.sin(2 * np.pi * t.freq * d + rng.uniform(0, 2 * np.pi))
    shift = rng.normal(0, 0.03, (3, 2))
    for (cx, cy), r, c in zip(t.centers + shift, t.radii * rng.uniform(0.9, 1.1, 3), t.colors):
        m = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))   # [h, w]
        keep = 1 - m
        for k in range(3):
            img[k] *= keep
            img[k] += c[k] * m
    offset = rng.uniform(-12, 12)
    noise = rng.normal(0, 4, (h, w, 3))                              # drawn in [h, w, 3] order
    noise += offset
    img += noise.transpose(2, 0, 1)
    return np.ascontiguousarray(np.clip(img, 0, 255, out=img).astype(np.uint8).transpose(1, 2, 0))
