"""engine.core.geometry.window must reproduce torchvision's Resize + CenterCrop numbers exactly.

The reference numbers come from the transforms timm itself builds for the spec
(`create_transform(..., use_prefetcher=True)`): its Resize's size goes through
torchvision's `_compute_resized_output_size` (and a real PIL resize), its CenterCrop
runs on a tensor whose values are pixel coordinates, so the crop offsets read back.
"""
from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms.functional import _compute_resized_output_size

from engine.core.geometry import resize_size, window
from engine.core.spec import Spec

SIZES = (112, 224, 448)          # network input side S
CROP_PCTS = (1.0, 0.875, 0.9)
MODES = ("center", "squash")
# odd sizes, 1-px differences, sizes equal to S / floor(S / pct), small and very large
EDGES = (150, 151, 223, 224, 225, 255, 256, 257, 333, 447, 448, 449, 497, 512, 800, 801)
EXTREME = [(800, 150), (150, 800), (801, 151), (1000, 150), (150, 1000), (2000, 333), (31, 4000), (1, 1), (1, 2)]


def _random_pairs(k: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(w), int(h)) for w, h in rng.integers(1, 1601, (k, 2))]


@lru_cache(maxsize=None)
def _spec(size: int, mode: str, pct: float) -> Spec:
    return Spec(model="eva02_test", input_size=size, crop_mode=mode, crop_pct=pct)


@lru_cache(maxsize=None)
def _timm_tf(size: int, mode: str, pct: float):
    import timm.data

    s = _spec(size, mode, pct)
    return timm.data.create_transform(input_size=(3, size, size), is_training=False, interpolation=s.interpolation,
                                      mean=s.mean, std=s.std, crop_pct=pct, crop_mode=mode, use_prefetcher=True)


def _torchvision_window(w: int, h: int, size: int, mode: str, pct: float) -> tuple[int, int, int, int, bool]:
    """(resize_w, resize_h, top, left, resized) from the torchvision ops timm's transform runs."""
    resize, crop = _timm_tf(size, mode, pct).transforms[:2]
    assert type(resize).__name__ == "Resize" and type(crop).__name__ == "CenterCrop"
    want = [resize.size] if isinstance(resize.size, int) else list(resize.size)
    rh, rw = _compute_resized_output_size((h, w), want, resize.max_size)
    # [1, rh, rw] int32 views holding each pixel's y and x (expanded: nothing is materialised)
    ys = torch.arange(rh, dtype=torch.int32).view(1, rh, 1).expand(1, rh, rw)
    xs = torch.arange(rw, dtype=torch.int32).view(1, 1, rw).expand(1, rh, rw)
    cy, cx = TF.center_crop(ys, list(crop.size)), TF.center_crop(xs, list(crop.size))
    assert tuple(cy.shape) == tuple(cx.shape) == (1, size, size)
    top, left = int(cy[0, 0, 0]), int(cx[0, 0, 0])
    # the crop is a contiguous window: last pixel is (top + S - 1, left + S - 1)
    assert (int(cy[0, -1, -1]), int(cx[0, -1, -1])) == (top + size - 1, left + size - 1)
    return rw, rh, top, left, (rh, rw) != (h, w)


def _check(w: int, h: int, size: int, mode: str, pct: float) -> None:
    win = window(w, h, _spec(size, mode, pct))
    assert (win.resize_w, win.resize_h, win.top, win.left, win.resized) == _torchvision_window(w, h, size, mode, pct), \
        (w, h, size, mode, pct)
    assert win.size == size
    assert resize_size(w, h, _spec(size, mode, pct)) == (win.resize_w, win.resize_h)


@pytest.mark.parametrize("size, mode, pct", list(itertools.product(SIZES, MODES, CROP_PCTS)))
def test_window_equals_torchvision_on_edge_grid(size, mode, pct):
    s = _spec(size, mode, pct)
    edges = sorted(set(EDGES) | {size - 1, size, size + 1, s.scale_size - 1, s.scale_size, s.scale_size + 1})
    for w, h in itertools.product(edges, edges):
        _check(w, h, size, mode, pct)
    for w, h in EXTREME:
        _check(w, h, size, mode, pct)


@pytest.mark.parametrize("size, mode, pct", list(itertools.product(SIZES, MODES, CROP_PCTS)))
def test_window_equals_torchvision_on_random_sizes(size, mode, pct):
    for w, h in _random_pairs(300, seed=size):
        _check(w, h, size, mode, pct)


def test_sizes_equal_to_the_target_are_not_resized():
    for size, mode in itertools.product(SIZES, MODES):
        win = window(size, size, _spec(size, mode, 1.0))
        assert (win.resize_w, win.resize_h, win.top, win.left, win.resized) == (size, size, 0, 0, False)
    # center mode: only the short side must equal the target
    win = window(448, 600, _spec(448, "center", 1.0))
    assert (win.resize_w, win.resize_h, win.top, win.left, win.resized) == (448, 600, 76, 0, False)


def test_rounding_is_truncation_and_bankers_rounding():
    # long side: int(448 * 801 / 449) = int(799.2...) = 799 (truncated)
    assert resize_size(449, 801, _spec(448, "center", 1.0)) == (448, 799)
    # (799 - 448) / 2 = 175.5 -> round half to even = 176; (449 - 448)/2 = 0.5 -> 0
    assert window(449, 801, _spec(448, "center", 1.0)).top == 176
    assert window(449, 448, _spec(448, "center", 1.0)).left == 0


def test_resize_sizes_equal_a_real_pil_resize():
    """torchvision's resize on a PIL image lands on the same size (and skips the same no-op resizes)."""
    pairs = list(itertools.product((150, 223, 448, 449, 800), (151, 224, 448, 512, 799))) + EXTREME[:6]
    for (w, h), mode, pct in itertools.product(pairs, MODES, (1.0, 0.875)):
        win = window(w, h, _spec(448, mode, pct))
        img = Image.new("L", (w, h))
        out = TF.resize(img, _timm_tf(448, mode, pct).transforms[0].size, interpolation=TF.InterpolationMode.NEAREST)
        assert out.size == (win.resize_w, win.resize_h), (w, h, mode, pct)
        assert (out is img) == (not win.resized), (w, h, mode, pct)


def _render(w: int, h: int, seed: int) -> Image.Image:
    from evaluator.synthetic.cohort import render, templates

    t = templates(3, seed)[seed % 3]
    return Image.fromarray(render(t, w, h, np.random.default_rng(seed)))


@pytest.mark.parametrize("w, h", [(300, 200), (201, 333), (800, 150), (449, 449), (112, 112), (640, 481)])
@pytest.mark.parametrize("size, mode, pct", [(112, "center", 1.0), (112, "squash", 1.0), (112, "center", 0.875),
                                             (224, "center", 0.9), (224, "squash", 0.875)])
def test_pil_resize_and_crop_at_window_equals_timm_transform(w, h, size, mode, pct):
    img = _render(w, h, seed=w + h)
    win = window(w, h, _spec(size, mode, pct))
    want = _timm_tf(size, mode, pct)(img)               # [3, S, S] uint8
    assert want.dtype == torch.uint8 and tuple(want.shape) == (3, size, size)
    got = img.resize((win.resize_w, win.resize_h), Image.BICUBIC) if win.resized else img
    got = got.crop((win.left, win.top, win.left + size, win.top + size))
    got = np.asarray(got).transpose(2, 0, 1)            # [3, S, S] uint8
    assert np.array_equal(got, want.numpy())
