"""How a GPU producer hands a batch to its consumer: its own stream, an event, nothing on the host.

A GPU decoder does its work (decode, resize, copies, uploads) on a stream of its own, on
its decode thread, and records an event after each batch. The consumer (inference, on
its thread's current stream) waits for that event on the device, not the host, and marks
the batch as used by its stream (`record_stream`), so the caching allocator does not give
the batch's memory to the producer's next batch before the kernels queued to read it have
run. Host arrays go up from pinned memory (an upload from pageable memory synchronises
the stream it is issued on). With this, `depth` batches are truly in flight.
"""
from __future__ import annotations

import numpy as np
import torch


def producer_stream(device: str | torch.device = "cuda") -> torch.cuda.Stream:
    """A stream of the producer's own, high priority: its short kernels and copies are scheduled
    between the inference graph's kernels instead of queueing behind them."""
    return torch.cuda.Stream(device=device, priority=-1)


def hand_over(stream) -> torch.cuda.Event:
    """An event after everything queued so far on the producer's `stream` (the batch is ready then)."""
    ready = torch.cuda.Event()
    ready.record(stream)
    return ready


def take_over(batch: torch.Tensor, ready) -> torch.Tensor:
    """The consumer's side: its current stream waits for `ready` (on the device) and keeps `batch`
    alive until its queued kernels have read it."""
    consumer = torch.cuda.current_stream(batch.device)
    consumer.wait_event(ready)
    batch.record_stream(consumer)
    return batch


def pinned(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of `t`, for an upload that does not synchronise."""
    return t.pin_memory()


def upload(array, device: torch.device) -> torch.Tensor:
    """Host array (numpy or a list of ints) -> the same values on `device`, through pinned memory,
    queued on the current stream."""
    host = torch.from_numpy(np.ascontiguousarray(array)) if not isinstance(array, torch.Tensor) else array
    return pinned(host).to(device, non_blocking=True)
