"""The margin guard's boundaries and reported figures, on the host and in its deferred (CUDA) mode.

Pixels carry their row's identity (first byte = row id), and the "FP32 graph" answers
1000 + that id, so every row's final answer says whether the FP32 graph saw it. Raw
low-precision answers are 0.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.classify.guard import Guard

S = 2          # pixels are [B, 2, 2, 3]: only the first byte matters
TAU = 0.5


def _recheck(calls: list | None = None):
    def fp32(x: torch.Tensor) -> torch.Tensor:         # [R, S, S, 3] uint8 -> int32 [R]
        if calls is not None:
            calls.append(x.shape[0])
        return x[:, 0, 0, 0].to(torch.int32) + 1000
    return fp32


def _batch(ids, margins, bsz=None):
    """(x [B, S, S, 3] uint8 with row ids, raw top-1 zeros [B], margins [B]) padded to bsz with low margins."""
    bsz = bsz or len(ids)
    x = torch.zeros((bsz, S, S, 3), dtype=torch.uint8)
    x[: len(ids), 0, 0, 0] = torch.tensor(ids, dtype=torch.uint8)
    x[len(ids):, 0, 0, 0] = 255                                 # padding rows: an id no real row has
    m = torch.zeros(bsz, dtype=torch.float32)                  # padding margins 0: below any tau
    m[: len(ids)] = torch.tensor(margins, dtype=torch.float32)
    return x, torch.zeros(bsz, dtype=torch.int32), m


def _run(guard: Guard, batches, bsz: int):
    """Feed (ids, margins) batches (the last may be short: padded, `valid` set); answers after finish."""
    outs = []
    for ids, margins in batches:
        x, top1, m = _batch(ids, margins, bsz)
        outs.append((len(ids), guard.apply(x, top1, m, valid=len(ids))))
    guard.finish()
    return np.concatenate([o[:n].numpy() for n, o in outs])


def _expected(batches):
    return np.array([1000 + i if m < TAU else 0 for ids, ms in batches for i, m in zip(ids, ms)])


def _low(ids, low: set):
    return [0.1 if i in low else 3.0 for i in ids]


@pytest.mark.parametrize("deferred", [False, True])
def test_thirteen_low_rows_at_recheck_batch_four_all_get_fp32_answers(deferred):
    calls: list = []
    guard = Guard(_recheck(calls), TAU, batch=4, deferred=deferred, **_fake_device())
    low = set(range(0, 26, 2))                                  # 13 low rows over 3 batches of 10 (last: 6)
    ids = list(range(26))
    batches = [(ids[i:i + 10], _low(ids[i:i + 10], low)) for i in range(0, 26, 10)]
    got = _run(guard, batches, bsz=10)
    assert len(low) == 13 and np.array_equal(got, _expected(batches))   # row 13 included
    assert got[24] == 1024                                      # the 13th low row, alone in the last call
    r = guard.report()
    assert r["rechecked"] == 13 and r["changed"] == 13 and r["images"] == 26
    assert r["calls"] == 4 and calls == [4, 4, 4, 4]            # ceil(13 / 4) full static batches
    assert r["fraction"] == pytest.approx(13 / 26)


def test_rows_are_gathered_across_batches_into_full_recheck_calls():
    calls: list = []
    guard = Guard(_recheck(calls), TAU, batch=4)
    batches = [([3 * b, 3 * b + 1, 3 * b + 2], [0.1, 3.0, 3.0]) for b in range(4)]   # one low row per batch
    got = _run(guard, batches, bsz=3)
    assert np.array_equal(got, _expected(batches)) and calls == [4]    # one call, not one per batch


def test_all_rows_low_and_none_low():
    calls: list = []
    guard = Guard(_recheck(calls), TAU, batch=4)
    batches = [(list(range(8)), [0.0] * 8), ([8, 9, 10], [0.49] * 3)]
    got = _run(guard, batches, bsz=8)
    assert np.array_equal(got, 1000 + np.arange(11))
    assert guard.report()["rechecked"] == 11 and calls == [4, 4, 4]
    calls2: list = []
    none = Guard(_recheck(calls2), TAU, batch=4)
    got = _run(none, [(list(range(8)), [0.5] * 8)], bsz=8)     # margin == tau is not below it
    r = none.report()
    assert np.array_equal(got, np.zeros(8)) and calls2 == [] and r["rechecked"] == 0 and r["calls"] == 0
    assert r["fraction"] == 0.0 and r["images"] == 8


@pytest.mark.parametrize("deferred", [False, True])
def test_padding_rows_are_never_counted_or_rechecked(deferred):
    calls: list = []
    guard = Guard(_recheck(calls), TAU, batch=4, deferred=deferred, **_fake_device())
    x, top1, m = _batch([0, 1, 2], [3.0, 0.1, 3.0], bsz=8)      # rows 3..7 are padding with margin 0
    out = guard.apply(x, top1, m, valid=3)
    guard.finish()
    assert out.tolist() == [0, 1001, 0, 0, 0, 0, 0, 0]          # no padding row took an FP32 answer
    r = guard.report()
    assert r["images"] == 3 and r["rechecked"] == 1 and calls == [4]
    assert guard.stats.margins == [0.1]


def test_reported_fraction_is_rechecked_over_images_not_changed():
    def agreeing(x):                                          # FP32 agrees with the raw answer on even ids
        ids = x[:, 0, 0, 0].to(torch.int32)
        return torch.where(ids % 2 == 0, torch.zeros_like(ids), ids + 1000)

    guard = Guard(agreeing, TAU, batch=4)
    _run(guard, [(list(range(10)), [0.1] * 6 + [3.0] * 4)], bsz=10)
    r = guard.report()
    assert r["rechecked"] == 6 and r["changed"] == 3 and r["images"] == 10
    assert r["fraction"] == pytest.approx(0.6) and r["fraction"] != pytest.approx(0.3)


def test_guard_rejects_a_negative_tau_or_an_empty_batch():
    with pytest.raises(ValueError):
        Guard(_recheck(), -1.0, 4)
    with pytest.raises(ValueError):
        Guard(_recheck(), 0.5, 0)


# --- the deferred (CUDA) mode: no host sync per batch ---------------------------------------------

class _Clock:
    """Which apply() the guard is in: events remember the one that recorded them."""
    applies = 0


class _Event:
    def __init__(self, log):
        self.log, self.at = log, None

    def record(self):
        self.at = _Clock.applies

    def synchronize(self):
        self.log.append((self.at, _Clock.applies))

    def elapsed_time(self, other):
        return 2.0                                            # ms


def _fake_device(log=None):
    log = [] if log is None else log
    return {"make_event": lambda: _Event(log), "make_host": lambda n: torch.empty(n, dtype=torch.float32)}


def test_deferred_guard_reads_each_batch_one_batch_late_without_syncing(monkeypatch):
    syncs: list = []

    def counting(name, orig):
        def f(*a, **k):
            syncs.append(name)
            return orig(*a, **k)
        return f

    for name in ("item", "cpu", "tolist", "nonzero", "__int__", "__bool__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", counting("torch.nonzero", torch.nonzero))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda.synchronize", lambda *a: None))
    log: list = []
    guard = Guard(_recheck(), TAU, batch=4, deferred=True, **_fake_device(log))
    batches = [(list(range(b * 8, b * 8 + 8)), [0.1 if i % 3 == 0 else 2.0 for i in range(b * 8, b * 8 + 8)])
               for b in range(5)]
    outs = []
    for ids, margins in batches:
        x, top1, m = _batch(ids, margins)
        _Clock.applies += 1
        outs.append(guard.apply(x, top1, m))
    per_batch = [s for s in syncs if s != "numpy"]
    reads = syncs.count("numpy")                               # host reads of pinned margin buffers
    assert per_batch == [] and reads == 4                      # batch 5 is still in flight
    assert len(log) == 4 and all(recorded < now for recorded, now in log)   # each read one batch later
    guard.finish()
    got = np.concatenate([o.numpy() for o in outs])
    assert np.array_equal(got, _expected(batches))
    r = guard.report()
    assert r["seconds"] == pytest.approx(0.002 * r["calls"])  # device event time, read at the report
    assert r["rechecked"] == sum(m < TAU for _, ms in batches for m in ms) == r["changed"]


def test_answers_made_under_inference_mode_are_fixed_by_a_finish_outside_it():
    """The runtime classifies under inference mode; the pipeline calls finish() after it."""
    guard = Guard(_recheck(), TAU, batch=4)
    x, top1, m = _batch([0, 1, 2], [0.1, 3.0, 0.1])
    with torch.inference_mode():
        out = guard.apply(x, top1, m)
    guard.finish()
    assert out.tolist() == [1000, 0, 1002]
