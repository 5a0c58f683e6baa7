"""Re-inspection: re-score a request's top candidates with extra views of their images.

A caller may cap how many candidate images per request are re-inspected visually at
query time. `ReinspectBudget` is the one place such a limit is enforced: every candidate
image that is decoded and re-embedded for a request is taken from it first, and taking
more than the limit raises `ReinspectLimitError` (a bug, never a silent cut).

Views are made by the decoder that built the gallery (engine.decoders, by name: dali-cpu,
dali-gpu or pil), each view a variant of the CLIP spec, so the view pipeline is the
gallery's own: `view_spec(spec, "centre")` is the spec itself and reproduces the stored
row (tested: cosine > 0.999). The first `crops` of VIEWS are used:

1. `mirror`: the centre crop, mirrored (the stored view's twin);
2. `squash`: the whole image squashed to S x S (what the centre crop cut off at the sides);
3. `zoom80`: the centre 80 % of the short side, resized to S (a closer look);
4. `squash-mirror`, 5. `zoom80-mirror`.

A geometry is decoded once per image (mirroring is a flip of the decoded pixels), so
crops = 1, 2, 3..5 cost 1, 2, 3 decodes of each image (measured with dali-cpu on one core,
640 x 480 JPEGs: ~5.5 ms per decode; docs/retrieval_quality.md has the estimate at scale). The re-inspected embedding is
normalise(stored row + sum of the view embeddings), i.e. test-time multi-view averaging.

`Reinspector.embed_many` serves every request of a batch at once: each request's
candidates are taken from the budget first (nothing is read past the limit), then the
images not in the cache are read on reader threads, decoded by the decoder's own thread
pool (the thread budget, engine.threads) and embedded in batches that mix requests.
How the pipeline turns the rows into scores: engine.retrieval.query.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable

import numpy as np
import torch
import torch.nn.functional as F

from engine.core.spec import Spec
from engine.presets.retrieval import RETRIEVAL

VIEWS = ("mirror", "squash", "zoom80", "squash-mirror", "zoom80-mirror")
ZOOM = RETRIEVAL.reinspect_zoom   # zoom80: the share of the short side kept


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


def view_spec(spec: Spec, view: str) -> Spec:
    """The decoder spec that makes `view` (a VIEWS name or `centre`, the stored row's view)."""
    geometry = "centre" if view in ("centre", "mirror") else view.removesuffix("-mirror")
    if geometry == "centre":
        return spec
    if geometry == "squash":
        return dataclasses.replace(spec, crop_mode="squash", crop_pct=1.0)
    if geometry == "zoom80":
        return dataclasses.replace(spec, crop_mode="center", crop_pct=spec.crop_pct * ZOOM)
    raise ValueError(f"unknown view {view!r}; one of centre, {', '.join(VIEWS)}")


def view_groups(views: tuple[str, ...]) -> dict[str, list[bool]]:
    """geometry -> [mirrored?] per view of that geometry, in order (one decode per geometry)."""
    out: dict[str, list[bool]] = {}
    for v in views:
        geometry = "centre" if v in ("centre", "mirror") else v.removesuffix("-mirror")
        out.setdefault(geometry, []).append(v == "mirror" or v.endswith("-mirror"))
    return out


def _mirrored(arr):
    """[m, S, S, 3] uint8 flipped left-right (numpy or torch)."""
    if isinstance(arr, np.ndarray):
        return np.ascontiguousarray(arr[:, :, ::-1])
    return arr.flip(2)


def _cat(parts):
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


@dataclasses.dataclass(frozen=True)
class ViewDecoding:
    """How a Reinspector decodes and embeds views: `decoder`, the engine decoder name the gallery
    was built with; images per tower call; reader threads; the decoder's process isolation; the
    multi-view rows kept cached per call."""
    decoder: str = "pil"
    batch_size: int = RETRIEVAL.image_batch["cpu"]
    readers: int = RETRIEVAL.image_readers
    isolate: bool = False
    cache_rows: int = RETRIEVAL.reinspect_cache_rows


class Reinspector:
    """Multi-view embeddings of gallery rows, decoded and embedded on demand (cached per call).

    read(row) -> encoded bytes; encode(uint8 [B, S, S, 3]) -> [B, D] unit rows; `spec` the
    CLIP image spec; `decoding` how views are decoded (ViewDecoding); `views` the views by name
    (default: the first `crops` of VIEWS)."""

    def __init__(self, read: Callable[[int], bytes], encode: Callable, spec: Spec, crops: int,
                 budget: ReinspectBudget, decoding: ViewDecoding = ViewDecoding(),
                 views: tuple[str, ...] | None = None):
        if views is None and not 1 <= crops <= len(VIEWS):
            raise ValueError(f"crops must lie in 1..{len(VIEWS)}, got {crops}")
        self.read, self.encode, self.spec, self.budget = read, encode, spec, budget
        self.views = tuple(views) if views is not None else VIEWS[:crops]
        self.crops = len(self.views)
        self.decoder_name, self.batch_size = decoding.decoder, decoding.batch_size
        self.readers, self.isolate = decoding.readers, decoding.isolate
        self.cache_rows = decoding.cache_rows
        self.cache: dict[int, torch.Tensor | None] = {}     # gallery row -> [D] views' sum (None: unreadable)
        self.failed: dict[int, str] = {}
        self._decoders: dict[str, object] = {}
        self.decoded = 0                                      # images decoded (each geometry counts once)

    def _decoder(self, geometry: str):
        if geometry not in self._decoders:
            from engine.decoders import make_decoder

            spec = view_spec(self.spec, "centre" if geometry == "centre" else geometry)
            self._decoders[geometry] = make_decoder(self.decoder_name, spec, self.batch_size, isolate=self.isolate)
        return self._decoders[geometry]

    def close(self) -> None:
        for d in self._decoders.values():
            close = getattr(d, "close", None)
            if close is not None:
                close()
        self._decoders.clear()

    def view_sums(self, rows: list[int]) -> dict[int, torch.Tensor | None]:
        """{row: [D] float32 sum of its view embeddings, or None when unreadable} for `rows`
        (no budget: embed_many takes it); also fills the cache."""
        from engine.retrieval.embed import embed_images

        uniq = list(dict.fromkeys(rows))
        todo = [r for r in uniq if r not in self.cache]
        if len(self.cache) + len(todo) > self.cache_rows:
            self.cache.clear()   # bounded memory: a later request may decode the same image again
            todo = uniq
        acc: dict[int, torch.Tensor] = {}
        bad: dict[int, str] = {}
        for geometry, flips in (view_groups(self.views).items() if todo else ()):
            def encode(arr, flips=flips):
                x = _cat([_mirrored(arr) if f else arr for f in flips]) if len(flips) > 1 else (
                    _mirrored(arr) if flips[0] else arr)
                e = self.encode(x).float()                                   # [len(flips) * m, D]
                return e.view(len(flips), -1, e.shape[-1]).sum(0)            # [m, D]

            for b in embed_images(self.read, todo, self._decoder(geometry), encode, self.batch_size,
                                  self.readers):
                k = 0
                for j, row in enumerate(b.items):
                    if not b.ok[j]:
                        bad.setdefault(row, b.failed[row])
                        continue
                    e = torch.from_numpy(b.emb[k].astype(np.float32))
                    acc[row] = acc[row] + e if row in acc else e
                    k += 1
                self.decoded += len(b.items)
        for r in todo:
            if r in bad:
                self.cache[r] = None
                self.failed[r] = bad[r]
                print(f"[reinspect] gallery row {r}: cannot read its image ({bad[r]}); "
                      "it keeps its stored embedding", file=sys.stderr)
            else:
                self.cache[r] = acc[r]
        return {r: self.cache.get(r) for r in rows}

    def embed_many(self, requests: list[tuple[Hashable, list[int]]], stored: list[torch.Tensor]
                   ) -> list[torch.Tensor]:
        """[C_i, D] unit rows normalise(stored_i + views) per (request, gallery rows) pair, stored_i
        [C_i, D] the rows' stored embeddings. Every request's count is taken from the budget before
        any image is read; the union of the rows is decoded and embedded together. A candidate
        whose image cannot be read keeps its stored row (said once on stderr)."""
        for key, rows in requests:
            self.budget.take(key, len(rows))
        sums = self.view_sums([r for _, rows in requests for r in rows])
        out = []
        for (_, rows), st in zip(requests, stored):
            o = st.float().clone()
            for i, r in enumerate(rows):
                v = sums.get(r)
                if v is not None:
                    o[i] = o[i] + v.to(o.device)
            out.append(F.normalize(o, dim=-1))
        return out

    def embed(self, request: Hashable, rows: list[int], stored: torch.Tensor) -> torch.Tensor:
        """embed_many for one request."""
        return self.embed_many([(request, rows)], [stored])[0]
