"""Re-inspection: re-score a request's top candidates with extra views of their images.

A caller may cap how many candidate images per request are re-inspected visually at
query time. `ReinspectBudget` is the one place such a limit is enforced: every candidate
image that is decoded and re-embedded for a request is taken from it first, and taking
more than the limit raises `ReinspectLimitError` (a bug, never a silent cut).

Views of a candidate (`candidate_views`, PIL, the reference decoder's `open_rgb`; each
resized with the spec's interpolation to the tower's S x S), in this order, the first
`crops` of them:

1. the whole image squashed to S x S (what the centre crop cut off at the sides);
2. the first square along the long side (left or top), 3. the last one (right or bottom);
4. a centre crop of 80 % of the short side (a closer look), 5. the mirrored centre crop.

The stored gallery row is the CLIP centre crop itself; the re-inspected embedding is
normalise(mean(stored row, view embeddings)), i.e. test-time multi-crop averaging. How
the pipeline turns it into a score: evaluator.cir.query (same scorer, new vector).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import numpy as np
import torch
import torch.nn.functional as F

VIEWS = ("squash", "start", "end", "zoom80", "mirror")
_FILTERS = {"bicubic": 3, "bilinear": 2, "nearest": 0}   # PIL.Image.Resampling values


class ReinspectLimitError(RuntimeError):
    """Code tried to re-inspect more candidates for one request than the limit allows."""


class ReinspectBudget:
    """Per-request counter of re-inspected candidates; raises past `per_request` (<= `limit`)."""

    def __init__(self, per_request: int, limit: int | None = None):
        if per_request < 0 or (limit is not None and per_request > limit):
            raise ValueError(f"per_request must lie in 0..{limit}, got {per_request}")
        self.per_request = per_request
        self.used: dict[Hashable, int] = {}

    def take(self, request: Hashable, n: int) -> None:
        """Count `n` more candidates for `request`; raise if that passes the limit."""
        have = self.used.get(request, 0)
        if n < 0 or have + n > self.per_request:
            raise ReinspectLimitError(f"request {request!r}: {have} + {n} candidates would pass the "
                                      f"re-inspection limit of {self.per_request} per request")
        self.used[request] = have + n

    @property
    def max_used(self) -> int:
        return max(self.used.values(), default=0)

    @property
    def total(self) -> int:
        return sum(self.used.values())


def candidate_views(blob: bytes, size: int, crops: int, interpolation: str = "bicubic") -> np.ndarray:
    """[crops, S, S, 3] uint8: the first `crops` of VIEWS of one encoded image."""
    from engine.decoders.pil import open_rgb

    if not 1 <= crops <= len(VIEWS):
        raise ValueError(f"crops must lie in 1..{len(VIEWS)}, got {crops}")
    im = open_rgb(blob)
    w, h = im.size
    s = min(w, h)
    z = max(1, round(0.8 * s))
    boxes = {"squash": (0, 0, w, h),
             "start": (0, 0, s, s),
             "end": (w - s, h - s, w, h),
             "zoom80": ((w - z) // 2, (h - z) // 2, (w - z) // 2 + z, (h - z) // 2 + z),
             "mirror": ((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)}
    out = np.empty((crops, size, size, 3), np.uint8)
    for i, name in enumerate(VIEWS[:crops]):
        v = im.resize((size, size), _FILTERS[interpolation], box=boxes[name])
        if name == "mirror":
            v = v.transpose(0)   # PIL.Image.Transpose.FLIP_LEFT_RIGHT
        out[i] = np.asarray(v, np.uint8)
    return out


class Reinspector:
    """Multi-view embeddings of gallery rows, decoded and embedded on demand (cached per call)."""

    def __init__(self, read: Callable[[int], bytes], encode: Callable, size: int, crops: int,
                 budget: ReinspectBudget, interpolation: str = "bicubic", cache_rows: int = 50_000):
        self.read, self.encode, self.size, self.crops = read, encode, size, crops
        self.budget, self.interpolation, self.cache_rows = budget, interpolation, cache_rows
        self.cache: dict[int, torch.Tensor | None] = {}     # gallery row -> [D] views' sum (None: unreadable)
        self.failed: dict[int, str] = {}

    def embed(self, request: Hashable, rows: list[int], stored: torch.Tensor) -> torch.Tensor:
        """[C, D] unit rows: normalise(mean(stored [C, D], views)) for the gallery `rows` of one request.
        A candidate whose image cannot be read keeps its stored row (said once on stderr)."""
        self.budget.take(request, len(rows))
        todo = [r for r in dict.fromkeys(rows) if r not in self.cache]
        if len(self.cache) + len(todo) > self.cache_rows:
            self.cache.clear()   # bounded memory: a later request may decode the same image again
        pix, owners = [], []
        for r in todo:
            try:
                pix.append(candidate_views(self.read(r), self.size, self.crops, self.interpolation))
                owners.append(r)
            except Exception as e:  # noqa: BLE001 - one unreadable candidate keeps its stored row
                self.cache[r] = None
                self.failed[r] = f"{type(e).__name__}: {e}"
                print(f"[reinspect] gallery row {r}: cannot read its image ({self.failed[r]}); "
                      "it keeps its stored embedding", file=sys.stderr)
        if pix:
            emb = self.encode(np.concatenate(pix)).float()                # [len(owners) * crops, D]
            emb = emb.view(len(owners), self.crops, -1).sum(1)             # [len(owners), D]
            for r, e in zip(owners, emb):
                self.cache[r] = e
        out = stored.float().clone()
        for i, r in enumerate(rows):
            views = self.cache.get(r)
            if views is not None:
                out[i] = (out[i] + views.to(out.device)) / (1 + self.crops)
        return F.normalize(out, dim=-1)
