"""The overlapped classification pipeline: reader threads -> decode -> static-batch inference.

Batch n+1 is read and decoded while batch n infers (`depth` batches in flight; 0 runs
decode and inference in turn, for machines where both would fight over the same
cores). The last partial batch is padded (the compiled graph has one static shape),
never dropped. Images nothing can read keep a zero image in their slot, so every item
still gets a prediction.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from engine.presets import shared

READERS = shared("pipeline_readers")   # reader threads and batches in flight when a caller gives none
DEPTH = shared("pipeline_depth")


@dataclass
class Result:
    top1: np.ndarray                                  # [N] int32
    failed: dict[int, str] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    timeline: list[dict] = field(default_factory=list)
    first_batch_at: float | None = None               # clock value when the first batch finished


class ReadAhead:
    """Items 0..n-1 read in order on `readers` threads ahead of the consumer, bounded by bytes.

    `read_one(i) -> (bytes | None, error | None)`. At most `max_files` items are read and not
    yet taken; a read starts only while the bytes read and not taken, plus the largest file
    seen so far for each read in flight, stay within `max_bytes`, or when nothing at all is
    outstanding (a file larger than the budget is read alone; the first file too, before any
    size is known). `take(i)` blocks until item i is read; items are taken in order.
    """

    def __init__(self, read_one: Callable[[int], tuple], n: int, readers: int, max_files: int, max_bytes: int):
        self._read_one, self.n = read_one, n
        self.readers, self.max_files, self.max_bytes = max(1, readers), max(1, max_files), max_bytes
        self._cond = threading.Condition()
        self._done: dict[int, tuple] = {}
        self._held = 0          # bytes read and not taken
        self._flight = 0        # reads running
        self._largest = 0       # largest file read so far (0: none yet)
        self._next = 0          # next item to start reading
        self._taken = 0         # next item the consumer takes
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="reader")
        with self._cond:
            self._fill()

    def _fill(self) -> None:
        """Start every read the budget allows (called with the lock held)."""
        while (not self._closed and self._next < self.n and self._flight < self.readers
               and self._next - self._taken < self.max_files
               and (self._next == self._taken
                    or (self._largest and self._held + (self._flight + 1) * self._largest <= self.max_bytes))):
            self._flight += 1
            self._pool.submit(self._work, self._next)
            self._next += 1

    def _work(self, i: int) -> None:
        try:
            got = self._read_one(i)
        except BaseException as e:  # noqa: BLE001 - read_one catches what a read raises; this is a last resort
            got = (None, f"{type(e).__name__}: {e}")
        size = len(got[0]) if got[0] else 0
        with self._cond:
            self._flight -= 1
            self._done[i] = got
            self._held += size
            self._largest = max(self._largest, size, 1)
            self._fill()
            self._cond.notify_all()

    def take(self, i: int) -> tuple:
        with self._cond:
            while i not in self._done:
                self._cond.wait()
            got = self._done.pop(i)
            self._held -= len(got[0]) if got[0] else 0
            self._taken = i + 1
            self._fill()
        return got

    def close(self) -> None:
        """No new reads; waits for the running ones (each bounded by the file size cap)."""
        with self._cond:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


def _concat(parts: list):
    """One batch from its chunks (numpy or torch)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


def _decode_into(decoder, chunk: list[tuple], parts: list, failed: dict, clock, busy: dict) -> None:
    """Decode `chunk` [(bytes | None, read error | None)]; its array goes to `parts`, its reasons
    (a read error before the decoder's "not read") to `failed`, numbered from the batch's start."""
    t = clock()
    arr, f = decoder.decode([d for d, _ in chunk])
    busy["decode"] += clock() - t
    first = sum(len(p) for p in parts)          # row of the chunk's first image in the batch
    parts.append(arr)
    failed.update({first + j: why for j, why in f.items()})
    failed.update({first + j: err for j, (_, err) in enumerate(chunk) if err is not None})


def decoded_batches(read, n, bsz, decoder, readers: int = READERS, ahead_batches: int = DEPTH,
                    clock: Callable[[], float] = time.perf_counter, busy: dict | None = None,
                    timeline: list | None = None, max_bytes: int | None = None) -> Iterator[tuple]:
    """Yields (batch index, lo, hi, uint8 [hi-lo, S, S, 3], {row in batch: reason}, ready) for items 0..n-1.

    `read(i)` runs on reader threads, up to `ahead_batches` batches ahead of the decoder and
    within `max_bytes` of encoded bytes (ENGINE_READAHEAD_BYTES, see ReadAhead); a batch whose
    files hold more than `max_bytes` goes to the decoder in chunks of at most that (one file
    at least), so memory follows the byte budget, not the file count. `busy` (seconds per
    stage) and `timeline` (decode intervals) are filled when given.

    A GPU decoder (one with a `stream`) does all its work for a batch on that stream, the
    chunks' concatenation included; `ready` is the event after it (engine.core.gpu_streams), to be
    taken over by the consumer with `take_batch`. A host decoder's `ready` is None.
    """
    if max_bytes is None:
        from engine import settings

        max_bytes = settings.readahead_bytes()
    busy = {"read": 0.0, "decode": 0.0} if busy is None else busy
    timeline = [] if timeline is None else timeline

    def read_one(i: int) -> tuple[bytes | None, str | None]:
        t = clock()
        try:
            return read(i), None
        except Exception as e:  # noqa: BLE001 - a file that cannot be read fails alone
            return None, f"{type(e).__name__}: {e}"
        finally:
            busy["read"] += clock() - t  # summed over reader threads

    stream = getattr(decoder, "stream", None)       # a GPU decoder's own stream
    ahead = ReadAhead(read_one, n, readers, bsz * (ahead_batches + 1), max_bytes)
    try:
        for b in range((n + bsz - 1) // bsz):
            lo, hi = b * bsz, min(n, (b + 1) * bsz)
            parts, failed, chunk, chunk_bytes, start = [], {}, [], 0, clock()
            with _on_stream(stream):
                for i in range(lo, hi):
                    got = ahead.take(i)
                    size = len(got[0]) if got[0] else 0
                    if chunk and chunk_bytes + size > max_bytes:
                        _decode_into(decoder, chunk, parts, failed, clock, busy)
                        chunk, chunk_bytes = [], 0
                    chunk.append(got)
                    chunk_bytes += size
                _decode_into(decoder, chunk, parts, failed, clock, busy)
                chunk = []
                arr = _concat(parts)
                ready = _hand_over(stream)
            timeline.append({"stage": "decode", "batch": b, "start": start, "end": clock()})
            yield b, lo, hi, arr, failed, ready
    finally:
        ahead.close()


def _on_stream(stream):
    """The producer's stream as this thread's current one (a GPU decoder), else nothing."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def _hand_over(stream):
    if stream is None:
        return None
    from engine.core.gpu_streams import hand_over

    return hand_over(stream)


def take_batch(arr, ready):
    """The consumer's side of a decoded batch: on the device, wait for its producer's event and keep
    it alive for this thread's stream (engine.core.gpu_streams.take_over); a host batch as it is."""
    if ready is None:
        return arr
    from engine.core.gpu_streams import take_over

    return take_over(arr, ready)


LEAVE_S = 0.5   # how long a consumer that stops waits for the decode worker


def in_thread(gen: Iterator, depth: int) -> Iterator:
    """Run generator `gen` in a worker thread, `depth` items ahead of the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():           # a consumer that left is not waited for
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def work() -> None:
        try:
            for item in gen:
                if not put(item):
                    return
            put(done)
        except BaseException as e:  # noqa: BLE001 - hand the error to the consumer
            put(e)

    worker = threading.Thread(target=work, name="decode", daemon=True)
    worker.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # the worker stops at its next item; one busy in a long decode is not waited for past
        # LEAVE_S (it is a daemon; an isolated decoder's child leaves with the process), so a
        # signal ends the run at once whatever the decoder is doing
        stop.set()
        worker.join(LEAVE_S)


def classify(read: Callable[[int], bytes], n: int, decoder, runtime, readers: int = READERS, depth: int = DEPTH,
             clock: Callable[[], float] = time.perf_counter, progress: Callable[[int], None] | None = None
             ) -> Result:
    """Top-1 for items 0..n-1. `read(i)` returns the encoded bytes or raises (the item then fails)."""
    bsz = runtime.batch_size
    res = Result(np.zeros(n, np.int32))
    run = getattr(runtime, "run_async", runtime.run)
    guarded = getattr(runtime, "guard", None) is not None  # the guard skips the padding rows of the last batch
    gathered = []  # per batch: (lo, hi, int32 [B] on the device); copied to the host once, at the end
    busy = {"read": 0.0, "decode": 0.0, "inference": 0.0}
    batches = decoded_batches(read, n, bsz, decoder, readers, max(depth, 1), clock, busy, res.timeline)
    if depth > 0:
        batches = in_thread(batches, depth)
    try:
        for b, lo, hi, arr, failed, ready in batches:
            arr = take_batch(arr, ready)   # a GPU decoder's batch: inference's stream waits for its event
            if hi - lo < bsz:
                arr = _pad(arr, bsz)  # pad the last batch: the compiled graph has a static shape
            t = clock()
            pred = run(arr, hi - lo) if guarded else run(arr)  # [B] int32, on the run's device
            t2 = clock()
            busy["inference"] += t2 - t
            res.timeline.append({"stage": "inference", "batch": b, "start": t, "end": t2})
            if res.first_batch_at is None:
                res.first_batch_at = t2
            if getattr(pred, "is_cuda", False) or guarded:
                gathered.append((lo, hi, pred))  # on the GPU: no sync per batch; guarded: final after finish()
            else:
                res.top1[lo:hi] = np.asarray(pred)[: hi - lo]
            res.failed.update({lo + j: why for j, why in failed.items()})
            if progress is not None:
                progress(hi)
    finally:
        batches.close()  # an error here must not leave the decode worker and readers running
    t = clock()
    if guarded:
        runtime.finish()  # the guard's last re-checks write into the gathered answers
    for lo, hi, pred in gathered:
        res.top1[lo:hi] = pred.cpu().numpy()[: hi - lo]
    busy["inference"] += clock() - t  # the wait for the device's last batches
    res.stages = busy
    return res


def _pad(arr, bsz: int):
    """[m, ...] -> [bsz, ...] with zeros after row m (numpy or torch)."""
    m = arr.shape[0]
    if isinstance(arr, np.ndarray):
        padded = np.zeros((bsz,) + arr.shape[1:], arr.dtype)
    else:
        import torch

        padded = torch.zeros((bsz,) + tuple(arr.shape[1:]), dtype=arr.dtype, device=arr.device)
    padded[:m] = arr
    return padded
