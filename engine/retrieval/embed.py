"""Overlapped image embedding: reader threads -> decoder -> image tower, batch by batch.

Batch n+1 is read and decoded on a worker thread while batch n runs through the tower.
An item that cannot be read or decoded is reported in `failed`, never embedded, and
never stops the stream. Each item carries the name of the decoder that decoded it: an
isolated decoder gives way to the PIL reference when its own cannot start or keeps
failing, so a build records what decoded its rows, not what it asked for.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.presets.retrieval import RETRIEVAL


@dataclass
class EmbeddedBatch:
    items: list[int]                                   # the caller's item ids, in stream order
    emb: np.ndarray                                    # [m, D] float16 unit rows, one per ok item
    ok: np.ndarray                                     # [len(items)] bool: which items have a row
    failed: dict[int, str] = field(default_factory=dict)  # item id -> reason
    decoders: list[str] = field(default_factory=list)     # [len(items)] the decoder of each item


class DecoderLog:
    """`decoder` with a log of which decoder (its `.name` once each call returns) decoded the
    stream's images, by position; everything else is the decoder's own. The decode worker calls
    decode in stream order, so positions are cumulative counts of the blobs it was given."""

    def __init__(self, decoder):
        self.decoder = decoder
        self._ends: list[int] = []       # stream position after each decode call
        self._names: list[str] = []      # ... and the decoder's name then

    def decode(self, blobs, *args, **kwargs):
        out = self.decoder.decode(blobs, *args, **kwargs)
        self._ends.append((self._ends[-1] if self._ends else 0) + len(blobs))
        self._names.append(self.decoder.name)
        return out

    def name_at(self, pos: int) -> str:
        """The decoder that decoded the image at stream position `pos` (already decoded)."""
        return self._names[bisect.bisect_right(self._ends, pos)]

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def embed_images(read: Callable[[int], bytes], items: Sequence[int], decoder, encode: Callable,
                 batch_size: int, readers: int = RETRIEVAL.image_readers,
                 depth: int = RETRIEVAL.decode_ahead) -> Iterator[EmbeddedBatch]:
    """Yield EmbeddedBatch for `items` in order. `read(item)` returns encoded bytes or raises;
    `encode(uint8 [m, S, S, 3]) -> [m, D]` unit rows (torch, any device)."""
    from engine.classify.pipeline import decoded_batches, in_thread, take_batch
    from engine.core.gpu_streams import upload

    items = list(items)
    log = DecoderLog(decoder)
    batches = decoded_batches(lambda i: read(items[i]), len(items), batch_size, log, readers, max(depth, 1))
    if depth > 0:
        batches = in_thread(batches, depth)  # batch n+1 decodes while batch n runs through the tower
    try:
        for _, lo, hi, arr, failed, ready in batches:
            arr = take_batch(arr, ready)   # a GPU decoder's batch: this stream waits for its event
            chunk = items[lo:hi]
            ok = np.ones(len(chunk), bool)
            ok[list(failed)] = False
            idx = np.flatnonzero(ok)
            if len(idx) == len(chunk):
                emb = encode(arr)
            elif len(idx):
                sel = idx if isinstance(arr, np.ndarray) else upload(idx, arr.device)   # pinned: no sync
                emb = encode(arr[sel])
            else:
                emb = None
            rows = (np.zeros((0, 0), np.float16) if emb is None
                    else emb.to(device="cpu", dtype=torch.float16).numpy())  # [m, D]
            yield EmbeddedBatch(chunk, rows, ok, {chunk[j]: r for j, r in failed.items()},
                                [log.name_at(p) for p in range(lo, hi)])
    finally:
        batches.close()  # stops the decode worker and the readers
