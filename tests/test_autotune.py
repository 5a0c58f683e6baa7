"""The measured build's search, on fake timings (no timed tests): what it compiles, what it rejects
and why, what it chooses (also on noisy timings), what it drops, what disk it uses, and how the
build falls back when nothing holds."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import REPO, tiny_spec

from engine.tuning.autotune import Agreement, Candidate, SearchConfig, rank, search


class Clock:
    """A fake clock: each measured action advances it by what the fake says it cost."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeMeasurer:
    """Planted rates (eager screen and compiled graph) per (precision, batch, backend, options);
    `fail_compile` / `fail_run` / `disagree` plant failures; `costs` advance the clock."""

    def __init__(self, clock, screen, graph, fail_compile=(), fail_run=(), disagree=(), fraction=0.0,
                 compile_s=10.0, first=None, recheck=None):
        self.clock, self._screen, self._graph = clock, screen, graph
        self.first = dict(first or {})   # candidate name -> its first timing (a disturbed measurement)
        self.fail_compile, self.fail_run, self.disagree = set(fail_compile), set(fail_run), set(disagree)
        self.fraction, self.compile_s = fraction, compile_s
        self.compiled: list[str] = []
        self.recheck, self.recheck_calls = recheck, 0   # the re-check graph's rate (None: it fails)

    def screen(self, p, b):
        self.clock.t += 1
        return self._screen[(p, b)]

    def compile(self, c):
        self.clock.t += self.compile_s if c.backend == "aot" else 0.5
        self.compiled.append(c.name)
        if c.name.replace("+graphs", "") in self.fail_compile:   # one compile serves graphs on and off
            raise RuntimeError("planted: the backend cannot build this")
        return c.name

    def time(self, h, c):
        self.clock.t += 1
        if c.name in self.fail_run:
            raise RuntimeError("planted: CUDA graph capture failed")
        if c.name in self.first:
            return self.first.pop(c.name)
        return self._graph[(c.precision, c.batch_size, c.backend, c.options)]

    def agree(self, h, c):
        if c.name.replace("+graphs", "") in self.disagree:
            return Agreement(0.9, False, "planted: 26 of 256 calibration images disagree with the FP32 graph")
        low = c.precision != "fp32"
        guard = {"tau": 0.01, "rechecked_fraction": self.fraction, "estimated_per_10k": 2.0, "budget_per_10k": 10.0,
                 "safety": 2.0, "images": 16, "disagreements": 0}
        return Agreement(1.0, True, "", 0.01 if low else None, self.fraction if low else 0.0, 2.0 if low else None,
                         guard if low else None)

    def recheck_rate(self):
        self.recheck_calls += 1
        if self.recheck is None:
            raise RuntimeError("planted: the FP32 re-check graph does not run")
        return self.recheck


def _cfg(**k) -> SearchConfig:
    base = dict(precisions=("fp32", "bf16"), batch_sizes=(8, 16), backends=("aot",), device="cpu", budget_s=600,
                options=("default",), cuda_graphs=(False,), compile_estimate_s=0.0, compiled=("aot",),
                options_backends=("aot",))
    return SearchConfig(**{**base, **k})


# an AVX2 machine: emulated bf16 is far slower than fp32, eager and compiled
AVX2_SCREEN = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 5.0, ("bf16", 16): 5.5}
AVX2_GRAPH = {("fp32", 8, "aot", "default"): 40.0, ("fp32", 16, "aot", "default"): 43.0,
              ("bf16", 8, "aot", "default"): 7.0, ("bf16", 16, "aot", "default"): 8.0}


def test_on_a_cpu_without_native_bf16_the_search_rejects_bf16_because_it_measured_slower(capsys):
    clock = Clock()
    m = FakeMeasurer(clock, AVX2_SCREEN, AVX2_GRAPH)
    res = search(m, _cfg(), clock=clock)
    assert res.ranked[0].candidate == Candidate("fp32", 16, "aot")
    bf16 = next(t for t in res.trials if t.candidate.name == "aot/bf16/b16")
    # timed, then not classified: slower than an FP32 candidate that holds, whatever its agreement
    assert bf16.status == "slower" and "8.0 images/s on the graph, under 43.0 of aot/fp32/b16" in bf16.why
    assert bf16.agreement is None
    # bf16/b16 is compiled although it screens under PRUNE x the best: it is its precision's best batch
    assert "aot/bf16/b16" in m.compiled and "aot/bf16/b8" not in m.compiled
    assert [r["status"] for r in res.table()].count("not compiled") == 1


def test_where_bf16_measures_faster_and_holds_it_is_chosen():
    clock = Clock()
    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 55.0, ("bf16", 16): 60.0}
    graph = {**AVX2_GRAPH, ("bf16", 16, "aot", "default"): 90.0, ("bf16", 8, "aot", "default"): 80.0}
    m = FakeMeasurer(clock, screen, graph, fraction=0.02, recheck=9.0)
    res = search(m, _cfg(), clock=clock)
    best = res.ranked[0]
    assert best.candidate == Candidate("bf16", 16, "aot")
    # the guard's expected re-checks are paid at the re-check graph's measured rate: 1 / (1/90 + 0.02/9)
    assert best.effective_images_per_s == pytest.approx(1 / (1 / 90 + 0.02 / 9))
    assert best.row()["recheck_images_per_s"] == 9.0 and m.recheck_calls == 1


def test_re_checks_are_priced_at_the_re_check_graphs_rate_not_the_best_fp32_candidates():
    """IEEE FP32 at the re-check batch runs at a tenth of bf16 (a GPU): 20 % re-checked makes bf16
    slower than FP32 (1 / (1/90 + 0.2/9) = 30 < 43), where the FP32 candidate's 43 would call it 63."""
    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 55.0, ("bf16", 16): 60.0}
    graph = {**AVX2_GRAPH, ("bf16", 16, "aot", "default"): 90.0, ("bf16", 8, "aot", "default"): 80.0}
    clock = Clock()
    res = search(FakeMeasurer(clock, screen, graph, fraction=0.2, recheck=9.0), _cfg(), clock=clock)
    assert res.ranked[0].candidate == Candidate("fp32", 16, "aot")
    bf16 = next(t for t in res.trials if t.candidate == Candidate("bf16", 16, "aot"))
    assert bf16.effective_images_per_s == pytest.approx(30.0)


def test_a_re_check_rate_that_cannot_be_measured_is_priced_at_the_best_fp32_candidate(capsys):
    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 55.0, ("bf16", 16): 60.0}
    graph = {**AVX2_GRAPH, ("bf16", 16, "aot", "default"): 90.0, ("bf16", 8, "aot", "default"): 80.0}
    clock = Clock()
    res = search(FakeMeasurer(clock, screen, graph, fraction=0.02), _cfg(), clock=clock)
    assert res.ranked[0].effective_images_per_s == pytest.approx(1 / (1 / 90 + 0.02 / 43))
    err = capsys.readouterr().err
    assert err.count("re-check graph's rate could not be measured") == 1 and "planted" in err


def test_a_lead_whose_first_timing_was_disturbed_prunes_nothing():
    """aot/fp32/b16 is first timed at 14.2 (its true rate 10.7): the eager candidates timed after it
    are slower than 14.2, not than the confirmed leader, so they are judged after all."""
    clock = Clock()
    screen = {("fp32", 8): 11.1, ("fp32", 16): 10.6}
    graph = {("fp32", 8, "aot", "default"): 12.3, ("fp32", 16, "aot", "default"): 10.7,
             ("fp32", 8, "eager", "default"): 12.7, ("fp32", 16, "eager", "default"): 10.1}
    m = FakeMeasurer(clock, screen, graph, first={"aot/fp32/b16": 14.2})
    res = search(m, _cfg(precisions=("fp32",), backends=("aot", "eager")), clock=clock)
    by = {t.candidate.name: t for t in res.trials}
    assert by["eager/fp32/b8"].status == "holds" and by["eager/fp32/b8"].agreement == 1.0
    assert res.ranked[0].candidate == Candidate("fp32", 8, "eager")
    assert by["aot/fp32/b16"].images_per_s == pytest.approx(10.7)      # the median of its timings
    # one still slower than the confirmed leader (10.1 against 12.7) stays unjudged
    assert by["eager/fp32/b16"].status == "slower" and by["eager/fp32/b16"].agreement is None
    assert "under 12.7 of eager/fp32/b8" in by["eager/fp32/b16"].why


def test_a_tie_goes_to_the_simpler_candidate():
    clock = Clock()
    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 31.0, ("bf16", 16): 33.0}
    graph = {**AVX2_GRAPH, ("bf16", 16, "aot", "default"): 44.0}   # 2 % faster than fp32/b16: a tie
    res = search(FakeMeasurer(clock, screen, graph), _cfg(), clock=clock)
    assert res.ranked[0].candidate == Candidate("fp32", 16, "aot")
    assert res.ranked[1].candidate == Candidate("bf16", 16, "aot")


def test_failing_and_disagreeing_candidates_are_skipped_with_one_line_each(capsys):
    clock = Clock()
    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 50.0, ("bf16", 16): 60.0}
    graph = {**AVX2_GRAPH, ("bf16", 16, "aot", "default"): 90.0, ("bf16", 8, "aot", "default"): 85.0}
    m = FakeMeasurer(clock, screen, graph, fail_compile={"aot/bf16/b16"}, disagree={"aot/bf16/b8"},
                     fail_run={"aot/fp32/b16+graphs"})
    res = search(m, _cfg(device="cuda", cuda_graphs=(True, False)), clock=clock)
    err = capsys.readouterr().err.splitlines()
    rows = {r["name"]: r for r in res.table()}
    for name in ("aot/bf16/b16", "aot/bf16/b16+graphs"):
        assert rows[name]["status"] == "failed" and "cannot build" in rows[name]["why"]
    for name in ("aot/bf16/b8", "aot/bf16/b8+graphs"):
        assert rows[name]["status"] == "rejected" and "disagree" in rows[name]["why"]
    assert rows["aot/fp32/b16+graphs"]["status"] == "failed" and "capture" in rows["aot/fp32/b16+graphs"]["why"]
    for name in ("aot/bf16/b16+graphs", "aot/bf16/b16", "aot/bf16/b8", "aot/bf16/b8+graphs", "aot/fp32/b16+graphs"):
        assert len([line for line in err if f" {name}:" in line]) == 1, err
    # the graphs-on and graphs-off rows of one compile share it
    assert m.compiled.count("aot/bf16/b16+graphs") + m.compiled.count("aot/bf16/b16") == 1
    assert res.ranked[0].candidate == Candidate("fp32", 16, "aot")


def test_the_budget_stops_compiles_that_would_not_fit():
    clock = Clock()
    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 31.0, ("bf16", 16): 29.0}
    m = FakeMeasurer(clock, screen, {**AVX2_GRAPH}, compile_s=100.0)
    res = search(m, _cfg(budget_s=320), clock=clock)
    rows = {r["name"]: r for r in res.table()}
    assert len(m.compiled) == 2     # 4 s of screens, 2 x (100 + 1) s: a third needs 1.5 x 100 s, 114 s are left
    assert sum("of the search budget left" in r.get("why", "") for r in rows.values()) == 2
    assert res.seconds <= 320


def test_compile_options_are_tried_on_the_best_fp32_candidate():
    clock = Clock()
    graph = {**AVX2_GRAPH, ("fp32", 16, "aot", "max-autotune"): 52.0}
    res = search(FakeMeasurer(clock, AVX2_SCREEN, graph), _cfg(options=("default", "max-autotune")), clock=clock)
    assert res.ranked[0].candidate == Candidate("fp32", 16, "aot", False, "max-autotune")


def test_rank_orders_by_effective_rate():
    clock = Clock()
    graph = {**AVX2_GRAPH, ("fp32", 8, "aot", "default"): 42.0}     # within TIE of b16: both hold
    res = search(FakeMeasurer(clock, AVX2_SCREEN, graph), _cfg(precisions=("fp32",)), clock=clock)
    assert [t.candidate.batch_size for t in rank(res.trials)] == [8, 16]   # a tie: the smaller batch
    graph[("fp32", 8, "aot", "default")] = 30.0                       # clearly slower: timed, not classified
    res = search(FakeMeasurer(Clock(), AVX2_SCREEN, graph), _cfg(precisions=("fp32",)))
    assert [t.candidate.batch_size for t in rank(res.trials)] == [16]


@pytest.mark.parametrize("cap, isa, bf16", [("AVX2", "", False), ("AVX512", "", True), ("AVX512", "AVX2", False)])
def test_native_precisions_follow_the_cpu_capability_and_onednn_limit(monkeypatch, cap, isa, bf16):
    from engine.core.precision import native_precisions

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    got, skipped = native_precisions("cpu")
    assert ("bf16" in got) is bf16 and got[0] == "fp32"
    if not bf16:
        assert cap in skipped["bf16"] and "--search-precisions" in skipped["bf16"]


class _BuildFake(FakeMeasurer):
    """The fake measurer behind a real engine.build: planted rates, real (eager) builds."""

    def __init__(self, real, *args, **plant):
        clock = Clock()
        screen = {(p, b): 30.0 for p in ("fp32", "bf16") for b in (8, 16, 32)}
        graph = {(p, b, be, "default"): 40.0 + b + (5 if p == "fp32" else -20) for p in ("fp32", "bf16")
                 for b in (8, 16, 32) for be in ("aot", "eager")}
        super().__init__(clock, screen, graph, **plant)
        self._real = real(*args)

    def compile(self, c):
        super().compile(c)
        return self._real.compile(c)

    def discard(self, h):
        self._real.discard(h)


def _context(net, spec, pixels, ref, budget=10.0, safety=2.0, recheck_batch=None):
    """A build's context on the CPU for a Measurer: the network, its calibration pixels and FP32 (top-1, margins)."""
    from engine.tuning.assemble import GuardConfig
    from engine.tuning.context import BuildContext
    from engine.tuning.reference import Reference

    return BuildContext(spec, "cpu", GuardConfig(budget=budget, safety=safety, recheck_batch=recheck_batch), net=net,
                        calibration=Reference(pixels, *ref, origin={}))


def _auto_build(tmp_path, tiny_checkpoint, monkeypatch, verify_ok=lambda name: True, **plant):
    from engine.tuning import AutoConfig, GuardConfig, build
    from engine.tuning import auto as build_auto
    from engine.tuning import measure as autotune_measure

    real = autotune_measure.Measurer
    monkeypatch.setattr(autotune_measure, "Measurer", lambda *a, **k: _BuildFake(real, *a, **k, **plant))
    monkeypatch.setattr(autotune_measure, "importable_backends", lambda device: (["eager"], {}))
    seen = []

    def verify(ctx, spec, timeout=1800.0):
        name = f"eager/{spec.precision}/b{spec.batch_size}"
        seen.append(name)
        return {"ok": verify_ok(name), "images": 16, "agreement": 1.0 if verify_ok(name) else 0.5,
                **({} if verify_ok(name) else {"why": "planted: 50.00% of 16 images agree"})}

    monkeypatch.setattr(build_auto, "verify_artifact", verify)
    spec = tiny_spec("squash", 16)
    meta = build(spec, tiny_checkpoint, tmp_path / "art", backend="eager", device="cpu",
                 guard=GuardConfig(calibration_source="renders", calibration_count=16),
                 auto=AutoConfig(precisions=("fp32", "bf16"), budget_s=100))
    return meta, seen


def test_the_build_takes_the_next_candidate_when_the_first_fails_its_end_to_end_check(tmp_path, tiny_checkpoint,
                                                                                         monkeypatch, capsys):
    meta, seen = _auto_build(tmp_path, tiny_checkpoint, monkeypatch, verify_ok=lambda n: n != "eager/fp32/b32")
    assert seen[:2] == ["eager/fp32/b32", "eager/fp32/b16"]
    assert (meta["precision"], meta["batch_size"], meta["backend"]) == ("fp32", 16, "eager")
    search_rec = meta["build"]["search"]
    assert search_rec["chosen"] == "eager/fp32/b16" and not search_rec["fallback"]
    assert [v["ok"] for v in search_rec["verify"]] == [False, True]
    rows = {r["name"]: r for r in search_rec["candidates"]}
    assert rows["eager/fp32/b32"]["status"] == "failed" and "end-to-end" in rows["eager/fp32/b32"]["why"]
    assert rows["eager/fp32/b16"]["status"] == "chosen"
    assert "against 61.0 of eager/fp32/b16" in rows["eager/fp32/b8"]["why"]
    assert "failed its end-to-end check" in capsys.readouterr().err
    on_disk = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert on_disk["build"]["search"]["verify"] == search_rec["verify"]
    assert not list(tmp_path.glob(".search.*"))          # the candidates' work folder is gone


def test_when_every_candidate_fails_the_build_is_eager_fp32_without_graphs(tmp_path, tiny_checkpoint, monkeypatch,
                                                                          capsys):
    names = [f"eager/{p}/b{b}" for p in ("fp32", "bf16") for b in (8, 16, 32)]
    meta, _ = _auto_build(tmp_path, tiny_checkpoint, monkeypatch, fail_compile=set(names))
    assert (meta["precision"], meta["backend"], meta["cuda_graphs"]) == ("fp32", "eager", False)
    assert meta["build"]["search"]["fallback"] and meta["build"]["search"]["chosen"] is None
    err = capsys.readouterr().err
    assert "WARNING: no measured candidate held" in err
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import load_runtime

    rt = load_runtime(load_artifact(tmp_path / "art"))
    assert rt.run(np.zeros((16, 112, 112, 3), np.uint8)).shape == (16,)


def test_the_re_check_rate_is_the_fp32_network_at_the_re_check_batch_measured_once(tiny_checkpoint, monkeypatch,
                                                                                   tmp_path):
    from engine.core.checkpoint import load_model
    from engine.presets import preset
    from engine.tuning import measure as autotune_measure

    spec = tiny_spec("squash", 16, "bf16")
    net = load_model(spec, tiny_checkpoint)
    pixels, ref = np.zeros((4, 112, 112, 3), np.uint8), (np.zeros(4, np.int64), np.zeros(4, np.float32))
    timed = []

    def rate(fn, x, device, **k):     # fake timings: what was timed, at which batch
        timed.append((x.shape[0], {q.dtype for q in fn.parameters()}, fn(x).dtype))
        return 123.0

    monkeypatch.setattr(autotune_measure, "rate", rate)
    m = autotune_measure.Measurer(_context(net, spec, pixels, ref, recheck_batch=4), tmp_path)
    assert m.recheck_rate() == m.recheck_rate() == 123.0
    assert timed == [(4, {torch.float32}, torch.int32)]     # once, FP32 weights, top-1 only, at the re-check batch
    assert autotune_measure.Measurer(_context(net, spec, pixels, ref, recheck_batch="auto"), tmp_path).recheck_batch \
        == preset("cpu").recheck_batch


class NoisyMeasurer(FakeMeasurer):
    """Planted rates, each timing jittered by up to +-`jitter` and, with probability `p`, disturbed
    (10-40 % slower: another process on the machine), from a seeded generator."""

    def __init__(self, clock, screen, graph, seed, jitter=0.02, p=0.1):
        super().__init__(clock, screen, graph)
        self.rng, self.jitter, self.p = random.Random(seed), jitter, p

    def time(self, h, c):
        r = super().time(h, c) * (1 + self.rng.uniform(-self.jitter, self.jitter))
        return r * self.rng.uniform(0.6, 0.9) if self.rng.random() < self.p else r


def _noisy_choice(seed: int, gain: float) -> str:
    """The search's choice between aot/fp32/b16 (100 images/s) and b32 (100 x (1 + gain)), noisy timings."""
    clock = Clock()
    graph = {("fp32", 16, "aot", "default"): 100.0, ("fp32", 32, "aot", "default"): 100.0 * (1 + gain)}
    m = NoisyMeasurer(clock, {("fp32", 16): 30.0, ("fp32", 32): 30.0}, graph, seed)
    res = search(m, _cfg(precisions=("fp32",), batch_sizes=(16, 32)), clock=clock)
    return res.ranked[0].candidate.name


@pytest.mark.parametrize("gain", [0.0, 0.02, 0.03, -0.03])
def test_on_noisy_timings_rates_a_few_percent_apart_give_the_same_choice_for_every_seed(gain):
    """Within TIE (5 %) the simpler (the smaller batch) stays, whatever the noise draws: jitter of
    +-2 % and one timing in ten 10-40 % slower. (Near TIE itself, 4-6 %, either choice is right.)"""
    assert {_noisy_choice(seed, gain) for seed in range(40)} == {"aot/fp32/b16"}


@pytest.mark.parametrize("gain, best", [(0.16, "aot/fp32/b32"), (0.25, "aot/fp32/b32"), (-0.2, "aot/fp32/b16")])
def test_on_noisy_timings_rates_more_than_15_percent_apart_pick_the_faster_for_every_seed(gain, best):
    assert {_noisy_choice(seed, gain) for seed in range(40)} == {best}


def test_a_candidate_within_reach_of_the_leader_is_retimed_interleaved_and_the_table_shows_every_timing():
    clock = Clock()
    order = []

    class Recording(FakeMeasurer):
        def time(self, h, c):
            order.append(c.batch_size)
            return super().time(h, c)

    graph = {("fp32", 16, "aot", "default"): 43.0, ("fp32", 8, "aot", "default"): 40.0}
    res = search(Recording(clock, AVX2_SCREEN, graph), _cfg(precisions=("fp32",)), clock=clock)
    # b16 first; b8's first timing is within 15 % of it: the leader settled (3 timings), then A B A B A B
    assert order == [16, 8, 16, 16, 16, 8, 16, 8, 16, 8]
    by = {t.candidate.batch_size: t for t in res.trials}
    assert by[8].status == "slower" and "median of 4" in by[8].why and len(by[16].timings) == 6
    from engine.tuning.autotune import format_table

    table = format_table(res, "aot/fp32/b16")
    legend = table.split("\ncandidate ")[0]
    assert legend.startswith("columns (- = not measured):\n  candidate ")
    for name in ("candidate", "screen", "graph", "eff.", "agree", "tau", "chosen", "holds", "slower", "rejected",
                 "failed", "not compiled", "skipped", "dropped"):
        assert f"\n  {name} " in legend, name         # every column and status said once, above the rows
    assert table.count("graph with the guard's re-check cost") == 1
    assert "timings: [40.0, 40.0, 40.0, 40.0]" in table
    assert res.table()[1]["timings"] == [40.0] * 4


def test_a_backend_failing_for_a_reason_of_the_machine_is_compiled_once(capsys):
    clock = Clock()

    class NoHeaders(FakeMeasurer):
        def compile(self, c):
            if c.backend == "aot":
                self.compiled.append(c.name)
                raise RuntimeError("CppCompileError: C++ compile error\n/tmp/x.cpp:1:10: fatal error: "
                                   "Python.h: No such file or directory\ncompilation terminated.")
            return super().compile(c)

    screen = {("fp32", 8): 30.0, ("fp32", 16): 32.0, ("bf16", 8): 31.0, ("bf16", 16): 33.0}
    graph = {(p, b, be, "default"): 40.0 + b for p in ("fp32", "bf16") for b in (8, 16) for be in ("aot", "eager")}
    m = NoHeaders(clock, screen, graph)
    res = search(m, _cfg(backends=("aot", "eager")), clock=clock)
    assert [n for n in m.compiled if n.startswith("aot/")] == ["aot/bf16/b16"]
    rows = {r["name"]: r for r in res.table()}
    assert rows["aot/bf16/b16"]["status"] == "failed"
    for name in ("aot/fp32/b16", "aot/bf16/b8", "aot/fp32/b8"):
        assert rows[name]["status"] == "not compiled"
        assert rows[name]["why"] == "backend aot dropped: missing header Python.h"
    assert res.dropped == {"aot": "missing header Python.h"}
    err = capsys.readouterr().err
    assert err.count("backend aot dropped: missing header Python.h; its other candidates are not compiled") == 1
    assert res.ranked and res.ranked[0].candidate.backend == "eager"


class FilesMeasurer(FakeMeasurer):
    """Each compile writes `size` bytes into its own folder under `work`; discard removes them."""

    def __init__(self, clock, screen, graph, work, size):
        super().__init__(clock, screen, graph)
        self.work, self.size, self.discarded = work, size, []

    def compile(self, c):
        super().compile(c)
        folder = self.work / c.name.replace("/", "_")
        folder.mkdir(parents=True)
        (folder / "model.so").write_bytes(b"\0" * self.size)
        return folder

    def discard(self, folder):
        import shutil

        self.discarded.append(folder.name)
        shutil.rmtree(folder)


def test_the_search_fits_a_disk_quota_of_three_compiles_by_removing_losers(tmp_path, capsys):
    """Six candidates of 1 MiB each under a 3.2 MiB quota: every loser's files go as it loses, only
    KEEP (2) that hold keep theirs, so every candidate is compiled and the best two are left."""
    from engine.io import tree_bytes
    from engine.tuning.autotune import KEEP
    from engine.tuning.disk import WorkDisk

    size, work = 1 << 20, tmp_path / "work"
    work.mkdir()
    quota = int(3.2 * size)
    free = lambda p: quota - tree_bytes(work)   # noqa: E731 - the simulated quota
    clock = Clock()
    screen = {(p, b): 30.0 for p in ("fp32", "bf16") for b in (8, 16, 32)}
    graph = {(p, b, "aot", "default"): 40.0 + b + (30 if p == "bf16" else 0) for p in ("fp32", "bf16")
             for b in (8, 16, 32)}
    m = FilesMeasurer(clock, screen, graph, work, size)
    disk = WorkDisk(work, first_need=size, free=free, tmpdir=work, used=tree_bytes)   # TMPDIR's use: the folder's
    res = search(m, _cfg(batch_sizes=(8, 16, 32)), clock=clock, disk=disk)
    assert len(m.compiled) == 6 and disk.skipped == 0
    assert disk.peak <= quota and disk.largest == size
    assert disk.record()["tmpdir_peak_growth_bytes"] == disk.peak > 0
    left = sorted(p.name for p in work.iterdir())
    assert len(left) == KEEP and left == sorted(t.candidate.name.replace("/", "_") for t in res.ranked)
    assert res.ranked[0].candidate == Candidate("bf16", 32, "aot")
    # a quota of one compile: the second does not fit while the first holds; one line says so
    m2 = FilesMeasurer(Clock(), screen, graph, tmp_path / "w2", size)
    (tmp_path / "w2").mkdir()
    disk2 = WorkDisk(tmp_path / "w2", first_need=size, free=lambda p: int(1.5 * size) - tree_bytes(tmp_path / "w2"))
    res2 = search(m2, _cfg(batch_sizes=(8, 16, 32)), clock=m2.clock, disk=disk2)
    assert len(m2.compiled) < 6 and disk2.skipped >= 1
    assert any(r.get("why", "").startswith("disk: needs about") for r in res2.table())
    assert "not compiled: needs about" in capsys.readouterr().err
    assert res2.ranked


def test_a_guarded_candidate_disturbed_on_its_only_timing_is_timed_again_before_it_loses_its_files():
    """Seen on a loaded machine: bf16/b16 (the best, truly) was timed first at a third of its rate,
    b8 and b32 came after it, and b16 lost its files on that one timing (guarded candidates never lead
    the loop's retiming). Now a second timing decides, and within reach it is timed interleaved."""
    clock = Clock()
    screen = {("bf16", 8): 8.0, ("bf16", 16): 9.5, ("bf16", 32): 7.6}
    graph = {("bf16", 8, "eager", "default"): 19.0, ("bf16", 16, "eager", "default"): 21.0,
             ("bf16", 32, "eager", "default"): 12.0}
    m = FakeMeasurer(clock, screen, graph, fraction=0.004, recheck=5.0, first={"eager/bf16/b16": 7.0})
    res = search(m, _cfg(precisions=("bf16",), batch_sizes=(8, 16, 32), backends=("eager",), compiled=()),
                 clock=clock)
    assert res.ranked[0].candidate.name == "eager/bf16/b16"
    by = {t.candidate.batch_size: t for t in res.trials}
    assert by[16].timings[0] == 7.0 and len(by[16].timings) >= 4      # retimed, interleaved with b8
    assert "eager/bf16/b32" not in res.handles                           # the slow one still loses its files


def test_the_docs_explain_every_column_and_status_of_the_table():
    from engine.tuning.table import COLUMNS, STATUSES

    text = (REPO / "docs" / "classification.md").read_text()
    for name in (*COLUMNS, *STATUSES):
        assert f"`{name}`" in text, f"docs/classification.md does not explain the search table's {name!r}"


def test_on_a_machine_slower_than_planned_a_screen_starts_only_when_it_fits():
    """1 s an image by the fake clock: a screen (3 calls of its batch) of 8 images takes 24 s; one of 16
    would take 48, more than the 60 s budget leaves after the first, so it is a row that says why; the
    next precision's batch of 8, at the slowest rate seen, still fits."""
    class Slow(FakeMeasurer):
        def screen(self, p, b):
            self.screened.append((p, b))
            self.clock.t += 3 * b * 1.0          # one warm-up and two timed calls of the batch
            return self._screen[(p, b)]

    clock = Clock()
    m = Slow(clock, AVX2_SCREEN, AVX2_GRAPH)
    m.screened = []
    res = search(m, _cfg(budget_s=60), clock=clock)
    assert m.screened == [("fp32", 8), ("bf16", 8)]
    rows = {(t.candidate.precision, t.candidate.batch_size): t for t in res.trials if t.status == "not screened"}
    assert set(rows) == {("fp32", 16), ("bf16", 16)}
    assert "a screen takes about 48 s" in rows[("fp32", 16)].why and "of the search budget" in rows[("fp32", 16)].why
