"""The guard's reported figures and argument bounds at their edges, and which CUDA events it
makes (timing only where a time is read): cases the guard's mutation run found untested.
Rows carry their id in the first pixel byte; the "FP32 graph" answers 1000 + id."""
from __future__ import annotations

import pytest
import torch

from engine.classify.guard import Guard


def fp32(x: torch.Tensor) -> torch.Tensor:   # [R, 2, 2, 3] uint8 -> int32 [R]
    return x[:, 0, 0, 0].to(torch.int32) + 1000


def batch(margins: list[float]):
    n = len(margins)
    x = torch.zeros((n, 2, 2, 3), dtype=torch.uint8)
    x[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)
    return x, torch.zeros(n, dtype=torch.int32), torch.tensor(margins, dtype=torch.float32)


def test_report_before_any_image():
    r = Guard(fp32, 0.5, 4).report()
    assert r["images"] == 0 and r["rechecked"] == 0 and r["calls"] == 0
    assert r["fraction"] == 0.0 and r["seconds"] == 0.0


def test_reported_figures_are_rounded_as_documented():
    import time

    g = Guard(fp32, 0.5, 4)
    t0 = time.perf_counter()
    g.apply(*batch([0.1, 3.0, 3.0]))
    r = g.report()
    assert g.stats.seconds <= time.perf_counter() - t0         # the re-check's own time, not a clock reading
    assert r["fraction"] == round(1 / 3, 6) and r["fraction"] != round(1 / 3, 7)  # 6 decimals
    assert r["seconds"] == round(g.stats.seconds, 4) and g.stats.seconds > 0


def test_tau_zero_and_a_recheck_batch_of_one_are_valid():
    g = Guard(fp32, 0.0, 1)            # tau 0: no margin is below it
    out = g.apply(*batch([0.0, 0.1]))
    g.finish()
    assert out.tolist() == [0, 0] and g.report()["rechecked"] == 0
    g = Guard(fp32, 0.5, 1)            # one row per FP32 call
    out = g.apply(*batch([0.1, 3.0, 0.2]))
    g.finish()
    assert out.tolist() == [1000, 0, 1002] and g.report()["calls"] == 2
    for tau, size in ((-0.01, 1), (0.5, 0)):
        with pytest.raises(ValueError, match="guard needs tau >= 0 and a batch >= 1"):
            Guard(fp32, tau, size)


class FakeEvent:
    made: list[bool] = []            # enable_timing of every event made
    timed: list["FakeEvent"] = []    # the timing events, in the order they were made
    synced: list["FakeEvent"] = []   # the timing events waited on

    def __init__(self, enable_timing: bool = False):
        FakeEvent.made.append(enable_timing)
        self.timing, self.recorded = enable_timing, False
        if enable_timing:
            FakeEvent.timed.append(self)

    def record(self):
        self.recorded = True

    def synchronize(self):
        if self.timing:
            FakeEvent.synced.append(self)

    def elapsed_time(self, other):
        assert self.timing and other.timing, "elapsed_time needs events made with enable_timing=True"
        assert self.recorded and other.recorded, "elapsed_time needs both events recorded"
        return 500.0                 # ms


def test_deferred_guard_times_only_the_recheck_events(monkeypatch):
    """The margin-copy events carry no timing (cheaper); the events around FP32 calls do, and the
    report waits once, on the last call's end event, then reads them all."""
    FakeEvent.made, FakeEvent.timed, FakeEvent.synced = [], [], []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    g = Guard(fp32, 0.5, 2, deferred=True, make_host=lambda n: torch.empty(n, dtype=torch.float32))
    out = g.apply(*batch([0.1, 3.0]))
    g.apply(*batch([0.2, 0.3, 0.4]))
    r = g.report()
    assert out.tolist() == [1000, 0] and r["rechecked"] == 4 and r["calls"] == 2
    assert FakeEvent.made == [False, False, True, True, True, True]   # two margin copies, two timed calls
    assert FakeEvent.synced == [FakeEvent.timed[-1]]                  # the last call's end event
    assert r["seconds"] == 1.0 and r["changed"] == 4                  # 2 x 500 ms
    assert r["recheck_batch"] == 2 and r["tau"] == 0.5
    again = g.report()                                                # a second report counts nothing twice
    assert again["seconds"] == 1.0 and again["changed"] == 4 and again["calls"] == 2


def test_the_first_1000_margins_are_kept_rounded_to_4_places():
    g = Guard(lambda x: torch.zeros(x.shape[0], dtype=torch.int32), 0.5, 64)
    margins = [0.123456] + [0.25] * 998 + [0.3, 0.4, 0.45]     # 1002 low rows: 999, then 3
    x = torch.zeros((len(margins), 2, 2, 3), dtype=torch.uint8)
    top1 = torch.zeros(len(margins), dtype=torch.int32)
    m = torch.tensor(margins, dtype=torch.float32)
    g.apply(x[:999], top1[:999], m[:999])
    g.apply(x[999:], top1[999:], m[999:])
    g.finish()
    kept = g.stats.margins
    assert len(kept) == 1000 and g.stats.rechecked == 1002
    assert kept[0] == 0.1235 and kept[-2:] == [0.25, 0.3]       # rounded; cut exactly after the 1000th


def test_padding_slots_of_the_last_call_are_zero_and_a_tuple_answer_is_read():
    """The partial last call's unused slots hold zeros, not the pixels of an earlier call's rows;
    a graph that answers (top1, margins) gives its first element."""
    seen = []

    def graph(x):
        seen.append(x.clone())
        return fp32(x), torch.zeros(x.shape[0])

    g = Guard(graph, 0.5, 4)
    x, top1, m = batch([0.1] * 5)
    x[:, 1, 1, 1] = 7                                    # every real row has non-zero pixels
    out = g.apply(x, top1, m)
    g.finish()
    assert out.tolist() == [1000, 1001, 1002, 1003, 1004]
    assert len(seen) == 2 and seen[1][0, 1, 1, 1] == 7
    assert int(seen[1][1:].abs().sum()) == 0            # slots 1..3: padding, zeroed
