"""The margin guard: an FP32 re-check of the images a low-precision graph nearly tied on.

The low-precision graph returns top-1 and its margin (top-1 minus top-2 logit, FP32).
Where the margin is under tau, rounding may have swapped the two leading classes, so
those images go through a second, FP32 graph and take its answer. tau is chosen at
build time for a stated disagreement budget (engine.tuning.calibrate.choose_tau).

Re-checks cost what they must: the rows to re-check are gathered across batches into
one buffer of the FP32 graph's static batch R and sent through it when the buffer is
full, and once more (padded) at `finish()`; k low rows in a whole run cost ceil(k / R)
calls, not one padded call per low-precision batch. The FP32 answers are written into
the top-1 tensors `apply` returned, so those are final only after `finish()`.

On CUDA nothing here waits for the GPU per batch: batch n's margins are copied to a
pinned host buffer behind an event, and read when batch n+1 arrives (its work is then
queued behind batch n's, so the wait costs no idle GPU); row indices go to the device
through pinned memory, and the `changed` count and the re-check time stay on the device
until the report. Low rows' pixels are copied into the re-check buffer as they are found;
the batch's pixel tensor is kept only until the next batch (the upload ring and the GPU
decoders hand over a fresh tensor for every batch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class GuardStats:
    images: int = 0          # images the guard looked at (padding rows excluded)
    rechecked: int = 0       # of those, re-run in FP32
    changed: int = 0         # of those, whose top-1 the FP32 graph changed
    seconds: float = 0.0     # time of the re-check calls (CUDA: event time on the device)
    calls: int = 0           # FP32 graph calls (each a full static batch; the last one padded)
    margins: list[float] = field(default_factory=list)  # margins of the re-checked images (first 1000)

    def report(self, tau: float, batch: int) -> dict:
        """The figures a timing report records; `fraction` is re-checked / images."""
        return {"tau": tau, "recheck_batch": batch, "images": self.images, "rechecked": self.rechecked,
                "fraction": round(self.rechecked / self.images, 6) if self.images else 0.0,
                "changed": self.changed, "seconds": round(self.seconds, 4), "calls": self.calls}


@dataclass
class _Batch:
    """A low-precision batch whose low-margin rows are not yet taken."""
    x: torch.Tensor          # [B, S, S, 3] uint8 pixels on the graphs' device
    top1: torch.Tensor       # [B] int32: the tensor `apply` returned (fixed in place later)
    host: torch.Tensor       # [n] float32 margins on the host (pinned on CUDA)
    ready: object            # CUDA event after the margin copy; None on the CPU


class Guard:
    """Re-runs low-margin rows through `recheck(x [R, S, S, 3] uint8) -> int32 [R]` (R = `batch`).

    `device`: where the graphs run. `deferred` (default: on CUDA) reads each batch's margins
    one batch late through a host buffer and an event (see the module docstring);
    `make_event` / `make_host` build those (defaults: torch.cuda.Event, pinned torch.empty).
    """

    def __init__(self, recheck, tau: float, batch: int, device: str | torch.device = "cpu",
                 deferred: bool | None = None, make_event=None, make_host=None):
        if tau < 0 or batch < 1:
            raise ValueError(f"guard needs tau >= 0 and a batch >= 1, got {tau}, {batch}")
        self.recheck, self.tau, self.batch = recheck, float(tau), batch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.deferred = self.cuda if deferred is None else deferred
        self._event = make_event or (lambda: torch.cuda.Event(enable_timing=False))
        self._timing_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._host = make_host or (lambda n: torch.empty(n, dtype=torch.float32, pin_memory=True))
        self.stats = GuardStats()
        self._pending: list[_Batch] = []          # CUDA: at most one batch awaiting its margins
        self._buf: torch.Tensor | None = None     # [R, S, S, 3] uint8: pixels of the rows waiting
        self._rows: list[tuple[torch.Tensor, int]] = []   # (top1, row) of each filled slot of _buf
        self._changed = None                       # CUDA: int64 [] changed count on the device
        self._timings: list = []                   # CUDA: (start, end) events around re-check calls

    def apply(self, x: torch.Tensor, top1: torch.Tensor, margin: torch.Tensor, valid: int | None = None
              ) -> torch.Tensor:
        """top1 [B] int32 (a copy), in which every row whose margin < tau gets the FP32 answer
        by the time `finish()` returns. x: [B, S, S, 3] uint8 on the graphs' device, left
        unchanged by the caller until the next apply; rows at and past `valid` are padding."""
        n = x.shape[0] if valid is None else valid
        self.stats.images += n
        top1 = top1.clone()                        # [B]: a graph may reuse its output buffer
        if self.deferred:
            host = self._host(n)
            host.copy_(margin[:n], non_blocking=True)   # [n] float32 -> pinned host, no wait
            ev = self._event()
            ev.record()
            for old in self._pending:              # the previous batch: its copy is long queued
                self._take(old)
            self._pending = [_Batch(x, top1, host, ev)]
        else:
            self._take(_Batch(x, top1, margin[:n].float(), None))
        return top1

    @torch.inference_mode()   # the answers were made under inference mode: fixed in place under it too
    def finish(self) -> None:
        """Take the last batch's rows and re-check whatever the buffer holds (one padded call)."""
        for old in self._pending:
            self._take(old)
        self._pending = []
        if self._rows:
            self._flush()

    def _take(self, b: _Batch) -> None:
        """Queue batch b's rows with margin < tau for re-checking; flush each full buffer."""
        low, m = self._low_rows(b)
        if len(low) == 0:
            return
        self.stats.rechecked += len(low)
        if len(self.stats.margins) < 1000:
            self.stats.margins += [round(float(v), 4) for v in m[low[:1000 - len(self.stats.margins)]]]
        if self._buf is None:
            self._buf = b.x.new_zeros((self.batch,) + tuple(b.x.shape[1:]))   # [R, S, S, 3]: the static shape
        rows = low.tolist()
        while rows:                                # copy the rows into the buffer's free slots now
            k = len(self._rows)
            take, rows = rows[: self.batch - k], rows[self.batch - k:]
            self._buf[self._index(list(range(k, k + len(take))))] = b.x[self._index(take)]
            self._rows += [(b.top1, r) for r in take]
            if len(self._rows) == self.batch:
                self._flush()

    def _low_rows(self, b: _Batch) -> tuple[np.ndarray, np.ndarray]:
        """(rows of b with margin < tau, b's margins [n]): the one read of device values, on the host."""
        if b.ready is not None:
            b.ready.synchronize()                  # the margin copy of an earlier batch: done by now
        m = b.host.numpy()                         # [n] float32
        return np.flatnonzero(m < self.tau), m

    def _index(self, rows: list[int]) -> torch.Tensor:
        """int64 [k] row indices on the graphs' device (through pinned memory on CUDA: no wait)."""
        idx = torch.tensor(rows, dtype=torch.int64)
        if self.cuda:
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        return idx

    def _flush(self) -> None:
        """One FP32 call on the buffered rows (padded to the static batch); answers scattered back."""
        rows, self._rows = self._rows, []
        chunk = self._buf                          # later writes to it queue behind this call (stream order)
        if len(rows) < self.batch:
            chunk[len(rows):] = 0                  # padding slots of the last call
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for slot, (top1, r) in enumerate(rows):
            g = groups.setdefault(id(top1), (top1, [], []))
            g[1].append(r)
            g[2].append(slot)
        if self.deferred:
            start, end = self._timing_event(), self._timing_event()
            start.record()
        else:
            t0 = time.perf_counter()
        out = self.recheck(chunk)
        out = out[0] if isinstance(out, (list, tuple)) else out            # [R] int32
        changed = None
        for top1, rs, slots in groups.values():
            ri, si = self._index(rs), self._index(slots)
            fixed = out[si].to(top1.dtype)
            diff = (fixed != top1[ri]).sum()
            changed = diff if changed is None else changed + diff
            top1[ri] = fixed
        if self.deferred:
            end.record()
            self._timings.append((start, end))
            self._changed = changed if self._changed is None else self._changed + changed
        else:
            self.stats.seconds += time.perf_counter() - t0
            self.stats.changed += int(changed)
        self.stats.calls += 1

    def report(self) -> dict:
        """finish(), then the stats as the timing report records them (CUDA: reads the device once)."""
        self.finish()
        if self._timings:
            self._timings[-1][1].synchronize()
            self.stats.seconds += sum(s.elapsed_time(e) for s, e in self._timings) / 1000
            self._timings = []
        if self._changed is not None:
            self.stats.changed += int(self._changed)
            self._changed = None
        return self.stats.report(self.tau, self.batch)
