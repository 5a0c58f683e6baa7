"""The read-ahead is a byte budget: what is read and not yet decoded stays within it (plus one
file per read in flight), a batch whose files exceed it reaches the decoder in chunks, and a
file larger than the budget is decoded alone; rows keep their order."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.classify.pipeline import ReadAhead, decoded_batches


class Recorder:
    """A decoder that records what it gets; row i of its output holds item i's first byte."""

    def __init__(self, alive: dict):
        self.calls: list[list[int]] = []           # the blob sizes of each call
        self.alive = alive

    def decode(self, blobs):
        self.calls.append([len(b) for b in blobs])
        with self.alive["lock"]:
            self.alive["now"] -= sum(len(b) for b in blobs)
        out = np.zeros((len(blobs), 1, 1, 3), np.uint8)
        for i, b in enumerate(blobs):
            out[i] = b[0]
        return out, {}


def _run(sizes: list[int], bsz: int, budget: int, readers: int = 4):
    alive = {"now": 0, "peak": 0, "lock": threading.Lock()}

    def read(i: int) -> bytes:
        with alive["lock"]:
            alive["now"] += sizes[i]
            alive["peak"] = max(alive["peak"], alive["now"])
        return bytes([i % 251]) * sizes[i]

    dec = Recorder(alive)
    rows = []
    for _, lo, hi, arr, failed, _ in decoded_batches(read, len(sizes), bsz, dec, readers, 2, max_bytes=budget):
        assert failed == {} and arr.shape[0] == hi - lo
        rows += [int(v) for v in arr[:, 0, 0, 0]]
    return rows, dec.calls, alive["peak"]


def test_bytes_read_ahead_stay_within_the_budget_whatever_the_file_count():
    sizes = [30] * 48
    rows, calls, peak = _run(sizes, bsz=8, budget=100)
    assert rows == [i % 251 for i in range(48)]                      # every row, in order
    assert all(sum(c) <= 100 for c in calls)                         # chunks of at most the budget
    assert len(calls) > 48 // 8                                      # so batches went in pieces
    # read ahead (budget + a file per reader in flight) + the chunk being filled: not 3 batches of 8
    assert peak <= 100 + 4 * 30 + 100 < 3 * 8 * 30, peak


def test_a_file_larger_than_the_budget_is_decoded_alone():
    sizes = [20, 20, 500, 20, 20, 20]
    rows, calls, _ = _run(sizes, bsz=6, budget=100)
    assert rows == list(range(6))
    assert [500] in calls and all(len(c) == 1 for c in calls if 500 in c)


@pytest.mark.parametrize("budget", [1 << 30])
def test_a_large_budget_hands_whole_batches_to_the_decoder(budget):
    rows, calls, _ = _run([1000] * 20, bsz=8, budget=budget)
    assert rows == list(range(20)) and [len(c) for c in calls] == [8, 8, 4]


def test_read_ahead_reads_the_first_file_alone_then_within_the_budget():
    started = []
    gate = threading.Event()

    def read_one(i):
        started.append(i)
        gate.wait(5)
        return bytes(10), None

    ra = ReadAhead(read_one, 10, readers=4, max_files=10, max_bytes=25)
    try:
        time.sleep(0.3)
        assert started == [0]                     # no size known yet: one read
        gate.set()
        assert ra.take(0) == (bytes(10), None)
        got = [ra.take(i)[0] for i in range(1, 10)]
        assert got == [bytes(10)] * 9
    finally:
        ra.close()
