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
    """[h, w, 3] uint8 render of template `t` with per-image jitter."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    x, y = x / max(w - 1, 1), y / max(h - 1, 1)
    d = np.cos(t.angle) * x + np.sin(t.angle) * y
    img = t.bg[0] * (1 - d[..., None]) + t.bg[1] * d[..., None]
    img += (t.amp * np.sin(2 * np.pi * t.freq * d + rng.uniform(0, 2 * np.pi)))[..., None]
    shift = rng.normal(0, 0.03, (3, 2))
    for (cx, cy), r, c in zip(t.centers + shift, t.radii * rng.uniform(0.9, 1.1, 3), t.colors):
        m = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        img = img * (1 - m) + c * m
    img += rng.uniform(-12, 12) + rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)
