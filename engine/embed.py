"""Overlapped image embedding: reader threads -> decoder -> image tower, batch by batch.

Batch n+1 is read and decoded on a worker thread while batch n runs through the tower.
An item that cannot be read or decoded is reported in `failed`, never embedded, and
never stops the stream.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class EmbeddedBatch:
    items: list[int]                                   # the caller's item ids, in stream order
    emb: np.ndarray                                    # [m, D] float16 unit rows, one per ok item
    ok: np.ndarray                                     # [len(items)] bool: which items have a row
    failed: dict[int, str] = field(default_factory=dict)  # item id -> reason


def embed_images(read: Callable[[int], bytes], items: Sequence[int], decoder, encode: Callable,
                 batch_size: int, readers: int = 8, depth: int = 2) -> Iterator[EmbeddedBatch]:
    """Yield EmbeddedBatch for `items` in order. `read(item)` returns encoded bytes or raises;
    `encode(uint8 [m, S, S, 3]) -> [m, D]` unit rows (torch, any device)."""
    batches: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    chunks = [list(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]

    def read_one(item: int) -> tuple[bytes | None, str | None]:
        try:
            return read(item), None
        except Exception as e:  # noqa: BLE001 - a file that cannot be read fails alone
            return None, f"{type(e).__name__}: {e}"

    def produce() -> None:
        try:
            with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="reader") as pool:
                ahead = [pool.map(read_one, c) for c in chunks[: depth + 1]]  # read-ahead window
                for b, chunk in enumerate(chunks):
                    got = list(ahead.pop(0))
                    if b + depth + 1 < len(chunks):
                        ahead.append(pool.map(read_one, chunks[b + depth + 1]))
                    arr, failed = decoder.decode([g[0] for g in got])  # [m, S, S, 3] uint8
                    for j, (_, err) in enumerate(got):
                        if err is not None:
                            failed[j] = err
                    while not stop.is_set():
                        try:
                            batches.put((chunk, arr, failed), timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            batches.put(None)
        except BaseException as e:  # noqa: BLE001 - hand the error to the consumer
            batches.put(e)

    worker = threading.Thread(target=produce, name="embed-decode", daemon=True)
    worker.start()
    try:
        while True:
            got = batches.get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            chunk, arr, failed = got
            ok = np.ones(len(chunk), bool)
            ok[list(failed)] = False
            idx = np.flatnonzero(ok)
            if len(idx) == len(chunk):
                emb = encode(arr)
            elif len(idx):
                sel = idx if isinstance(arr, np.ndarray) else torch.as_tensor(idx, device=arr.device)
                emb = encode(arr[sel])
            else:
                emb = None
            rows = (np.zeros((0, 0), np.float16) if emb is None
                    else emb.to(device="cpu", dtype=torch.float16).numpy())  # [m, D]
            yield EmbeddedBatch(chunk, rows, ok, {chunk[j]: r for j, r in failed.items()})
    finally:
        stop.set()
        worker.join(timeout=5)

