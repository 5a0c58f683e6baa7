"""Resize sizes and crop windows computed exactly as torchvision does.

Every backend (PIL reference, DALI CPU/GPU) takes its numbers from here, so the
only remaining difference between backends is the decoder and the resampling kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.spec import Spec


@dataclass(frozen=True)
class Window:
    resize_w: int   # size after the resize (== source size when no resize happens)
    resize_h: int
    top: int        # crop offset into the resized image
    left: int
    size: int       # square crop side (the network input)
    resized: bool   # False when torchvision would skip the resize (size unchanged)


def resize_size(w: int, h: int, spec: Spec) -> tuple[int, int]:
    """(new_w, new_h) of timm's eval Resize for a w x h image."""
    s = spec.scale_size
    if spec.crop_mode == "squash":
        return s, s
    # torchvision _compute_resized_output_size with an int size: short side -> s,
    # long side truncated with int(), not rounded
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = s, int(s * long / short)
    return (new_short, new_long) if w <= h else (new_long, new_short)


def window(w: int, h: int, spec: Spec) -> Window:
    """Full resize + CenterCrop geometry for a w x h source image."""
    rw, rh = resize_size(w, h, spec)
    s = spec.input_size
    if rw < s or rh < s:
        # only reachable with crop_pct > 1; torchvision would pad, which we do not support
        raise ValueError(f"resized image {rw}x{rh} is smaller than the crop {s}")
    # torchvision center_crop: int(round(...)) with Python's banker's rounding
    top = int(round((rh - s) / 2.0))
    left = int(round((rw - s) / 2.0))
    return Window(rw, rh, top, left, s, resized=(rw, rh) != (w, h))
