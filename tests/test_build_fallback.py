"""The measured build's order, watchdog and fallback, on fake timings (no timed test): every precision
and backend is compiled once before a second batch size, fp16 is skipped where bf16 holds at the same
cost, a compile that runs past its share is stopped and its backend dropped, and when nothing
compiled is verified the build takes the measured eager bf16 (guarded) rather than eager FP32. The
end-to-end check can run in the build's own process (as it does on CUDA)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
from conftest import tiny_spec
from test_autotune import Clock, FakeMeasurer, _BuildFake, _cfg

from engine.tuning import autotune
from engine.tuning.autotune import search

# a Hopper-like GPU: bf16 and fp16 screen alike, fp8's eager form is slower than bf16's eager (its
# compiled graph is the fastest), fp32 far behind; TensorRT a little faster than AOTInductor
GPU_SCREEN = {("bf16", 128): 115.0, ("bf16", 64): 110.0, ("bf16", 32): 100.0,
              ("fp16", 128): 112.0, ("fp16", 64): 108.0, ("fp16", 32): 99.0,
              ("fp8", 128): 90.0, ("fp8", 64): 85.0, ("fp8", 32): 80.0,
              ("fp32", 128): 15.0, ("fp32", 64): 14.5, ("fp32", 32): 14.0}
GPU_GRAPH = {(p, b, be, "default"): {"bf16": 200.0, "fp16": 200.0, "fp8": 300.0, "fp32": 30.0}[p] + b / 10
             + (20.0 if be == "trt" else 0.0) for p in ("bf16", "fp16", "fp8", "fp32") for b in (32, 64, 128)
             for be in ("aot", "trt")}


class GpuFake(FakeMeasurer):
    """Every backend's compile costs `compile_s` on the fake clock (TensorRT's as AOTInductor's)."""

    def compile(self, c):
        self.clock.t += self.compile_s
        self.compiled.append(c.name.replace("+graphs", ""))
        if c.name.replace("+graphs", "") in self.fail_compile:
            raise RuntimeError("planted: the backend cannot build this")
        return c.name


def _gpu_cfg(**k):
    base = dict(precisions=("fp32", "bf16", "fp16", "fp8"), batch_sizes=(32, 64, 128), backends=("aot", "trt"),
                device="cuda", cuda_graphs=(True, False), compiled=("aot", "trt"), fp16_same_cost=0.05)
    return _cfg(**{**base, **k})


def test_every_precision_and_backend_is_compiled_once_before_a_second_batch_size_and_fp16_is_skipped_at_bf16s_cost():
    clock = Clock()
    m = GpuFake(clock, GPU_SCREEN, GPU_GRAPH, fraction=0.01, recheck=30.0)
    res = search(m, _gpu_cfg(budget_s=600), clock=clock)
    leaders = ["aot/bf16/b128", "trt/bf16/b128", "aot/fp8/b128", "trt/fp8/b128", "aot/fp32/b128", "trt/fp32/b128"]
    assert m.compiled[:6] == leaders
    assert all(name.endswith("/b128") for name in m.compiled[:6])       # no second batch size before them
    rows = {r["name"]: r for r in res.table()}
    for be in ("aot", "trt"):
        for b in (128, 64):
            fp16 = rows[f"{be}/fp16/b{b}"]
            assert fp16["status"] == "not compiled" and f"bf16 holds on {be} at the same cost" in fp16["why"]
    assert not any("/fp16/" in name for name in m.compiled)
    assert res.ranked[0].candidate.precision == "fp8" and res.ranked[0].candidate.backend == "trt"


def test_fp16_is_compiled_where_bf16_does_not_hold_or_fp16_screens_clearly_faster():
    clock = Clock()
    m = GpuFake(clock, GPU_SCREEN, GPU_GRAPH, disagree={"aot/bf16/b128", "trt/bf16/b128"}, fraction=0.01,
                recheck=30.0)
    search(m, _gpu_cfg(budget_s=600, precisions=("bf16", "fp16")), clock=clock)
    assert m.compiled[:4] == ["aot/bf16/b128", "trt/bf16/b128", "aot/fp16/b128", "trt/fp16/b128"]
    clock = Clock()
    faster = {**GPU_SCREEN, ("fp16", 128): 130.0}                        # 13 % over bf16's 115: worth a compile
    m = GpuFake(clock, faster, GPU_GRAPH, fraction=0.01, recheck=30.0)
    search(m, _gpu_cfg(budget_s=600, precisions=("bf16", "fp16")), clock=clock)
    assert m.compiled[:2] == ["aot/fp16/b128", "trt/fp16/b128"] and "aot/bf16/b128" in m.compiled


class RealTimeClock(Clock):
    """The fake clock plus real seconds: the watchdog counts real time, the fakes add their planted costs."""

    def __init__(self):
        super().__init__()
        self.start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.start + self.t


class HangingTrt(FakeMeasurer):
    """TensorRT's compile sleeps far past any share, swallowing what `except Exception` would catch."""

    def compile(self, c):
        if c.backend == "trt":
            self.compiled.append(c.name)
            try:
                time.sleep(20)
            except Exception:  # noqa: BLE001 - a compiler that swallows errors must still be stopped
                time.sleep(20)
        return super().compile(c)


def test_a_compile_that_runs_past_its_share_is_stopped_and_the_search_goes_on_with_the_other_backend(capsys):
    clock = RealTimeClock()
    graph = {**GPU_GRAPH, **{(p, 8, be, "default"): r for p, r in (("fp32", 40.0), ("bf16", 80.0))
                             for be in ("aot", "trt")}}
    m = HangingTrt(clock, {("fp32", 8): 30.0, ("bf16", 8): 60.0}, graph, fraction=0.01, recheck=30.0)
    # 600 s of search: a compile's share is 0.5 % of the time left when it starts, about 3 s
    cfg = _cfg(backends=("trt", "aot"), compiled=("trt", "aot"), batch_sizes=(8,), compile_share=0.005)
    t0 = time.monotonic()
    res = search(m, cfg, clock=clock)
    assert time.monotonic() - t0 < 12                     # not the 40 s of one hanging compile, nor two
    assert [n for n in m.compiled if n.startswith("trt/")] == ["trt/bf16/b8"]    # compiled once, then dropped
    assert "stopped" in res.dropped["trt"]
    rows = {r["name"]: r for r in res.table()}
    assert rows["trt/bf16/b8"]["status"] == "failed" and "stopped after its allowance" in rows["trt/bf16/b8"]["why"]
    assert rows["trt/bf16/b8"]["seconds"] < 3.0 + 2.0     # stopped within its share (plus the alarm's repeat)
    assert rows["trt/fp32/b8"]["status"] == "not compiled" and "backend trt dropped" in rows["trt/fp32/b8"]["why"]
    assert res.ranked[0].candidate.name == "aot/bf16/b8"
    err = capsys.readouterr().err
    assert err.count("backend trt dropped") == 1 and "was stopped" in err


def test_a_slower_candidate_that_compiles_nothing_gets_its_agreement_measured_for_the_fallback():
    clock = Clock()
    screen = {("fp32", 16): 10.0, ("bf16", 16): 50.0}
    graph = {("fp32", 16, "aot", "default"): 40.0, ("bf16", 16, "aot", "default"): 200.0,
             ("fp32", 16, "eager", "default"): 10.0, ("bf16", 16, "eager", "default"): 50.0}
    m = FakeMeasurer(clock, screen, graph, fraction=0.02, recheck=9.0)
    res = search(m, _cfg(batch_sizes=(16,), backends=("aot", "eager")), clock=clock)
    rows = {t.candidate.name: t for t in res.trials}
    eager = rows["eager/bf16/b16"]
    assert eager.status in ("slower", "holds") and eager.held and eager.agreement == 1.0 and eager.guard
    pick = autotune.fallback_choice(res.trials, ("aot",), [])
    assert pick is eager                                  # eager bf16 with its guard beats eager fp32
    # a candidate whose own end-to-end check counted too many disagreements is not the fallback
    refuted = [{"candidate": "eager/bf16/b16", "ok": False, "disagreements": 9}]
    assert autotune.fallback_choice(res.trials, ("aot",), refuted).candidate.name == "eager/fp32/b16"
    # a check that could not run (the machine refused the child) says nothing against it
    unrun = [{"candidate": "eager/bf16/b16", "ok": False, "why": "scripts/run exited 1: CUDA error"}]
    assert autotune.fallback_choice(res.trials, ("aot",), unrun) is eager


def test_when_every_verification_fails_the_fallback_is_the_measured_eager_bf16_with_its_guard(
        tmp_path, tiny_checkpoint, monkeypatch, capsys):
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import load_runtime
    from engine.tuning import AutoConfig, GuardConfig, build
    from engine.tuning import auto as build_auto
    from engine.tuning import measure as autotune_measure

    real = autotune_measure.Measurer

    def measurer(*a, **k):
        fake = _BuildFake(real, *a, **k, fraction=0.02, recheck=9.0)
        # eager bf16 measured far faster than eager fp32, as on a GPU
        fake._graph = {(p, b, "eager", "default"): (90.0 if p == "bf16" else 12.0) + b for p in ("fp32", "bf16")
                       for b in (8, 16, 32)}
        return fake

    monkeypatch.setattr(autotune_measure, "Measurer", measurer)
    monkeypatch.setattr(autotune_measure, "importable_backends", lambda device: (["eager"], {}))
    seen = []

    def verify(ctx, spec, timeout=1800.0):
        seen.append(f"eager/{spec.precision}/b{spec.batch_size}")
        return {"ok": False, "images": 16,
                "why": "scripts/run exited 1: CUDA error: all CUDA-capable devices are busy or unavailable"}

    monkeypatch.setattr(build_auto, "verify_artifact", verify)
    meta = build(tiny_spec("squash", 16), tiny_checkpoint, tmp_path / "art", backend="eager", device="cpu",
                 guard=GuardConfig(calibration_source="renders", calibration_count=16),
                 auto=AutoConfig(precisions=("fp32", "bf16"), budget_s=100))
    assert seen and all("/bf16/" in name for name in seen)              # the ranked ones were tried first
    assert (meta["precision"], meta["backend"], meta["batch_size"]) == ("bf16", "eager", 32)
    assert meta["guard"]["recheck_backend"] == "eager" and meta["guard"]["tau"] == 0.01
    search_rec = meta["build"]["search"]
    assert search_rec["chosen"] is None and search_rec["fallback"].startswith("eager/bf16/b32")
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "falling back to" in ln]
    assert len(lines) == 1 and "no measured candidate held, built and verified" in lines[0]
    assert "eager/bf16/b32" in lines[0] and "guarded" in lines[0]
    rt = load_runtime(load_artifact(tmp_path / "art"))
    assert rt.run(np.zeros((32, 112, 112, 3), np.uint8)).shape == (32,)


def test_the_end_to_end_check_can_run_in_the_builds_process_without_a_child(tmp_path, tiny_checkpoint, monkeypatch):
    """On CUDA the check runs where the build's context is (no scripts/run child to open another)."""
    from engine import build as engine_build
    from engine import children
    from engine.core.checkpoint import load_model
    from engine.presets import preset
    from engine.tuning import auto as build_auto
    from engine.tuning.context import BuildContext

    spec = tiny_spec("squash", 16)
    engine_build.build(spec, tiny_checkpoint, tmp_path / "art", backend="eager", device="cpu")

    def no_child(*a, **k):
        raise AssertionError("the check started a child")

    monkeypatch.setattr(children, "run", no_child)
    net = load_model(spec, tiny_checkpoint)
    pre = dataclasses.replace(preset("cpu"), verify_images=16, verify_alpha=0.05)
    ctx = BuildContext(spec, "cpu", work=tmp_path / "art", net=net, preset=pre,
                       decoder={"name": "pil", "budget_per_10k": 10.0})
    v = build_auto.verify_artifact(ctx, spec, in_process=True)
    assert v["ok"] and v["images"] == 16 and v["disagreements"] == 0 and v["where"] == "in the build's process"


def test_a_first_compile_slower_than_the_time_left_falls_back_to_the_eager_bf16_measured_before_it(
        tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """On a fake clock: the first AOTInductor compile takes 1,250 of the 1,500 s, leaving no time to
    verify it (its re-check compile is reserved at that estimate); the eager bf16 candidate measured
    before it (compile-free candidates go first) is the artifact, with its guard, not eager FP32."""
    from engine.tuning import AutoConfig, GuardConfig, build
    from engine.tuning import auto as build_auto
    from engine.tuning import measure as autotune_measure

    clock, real = Clock(), autotune_measure.Measurer

    class SlowAot(_BuildFake):
        def compile(self, c):
            if c.backend != "aot":
                return super().compile(c)
            clock.t += 1250
            self.compiled.append(c.name)
            return f"planted {c.name}"               # timed and checked by the fake, never assembled

        def discard(self, h):
            if not isinstance(h, str):
                super().discard(h)

    def measurer(*a, **k):
        fake = SlowAot(real, *a, **k, fraction=0.02, recheck=9.0)
        fake.clock = clock
        fake._screen = {(p, b): 60.0 if p == "bf16" else 30.0 for p in ("fp32", "bf16") for b in (8, 16, 32)}
        fake._graph = {(p, b, be, "default"): {("bf16", "aot"): 300.0, ("fp32", "aot"): 40.0,
                                               ("bf16", "eager"): 90.0, ("fp32", "eager"): 12.0}[(p, be)] + b
                       for p in ("fp32", "bf16") for b in (8, 16, 32) for be in ("aot", "eager")}
        return fake

    monkeypatch.setattr(autotune_measure, "Measurer", measurer)
    monkeypatch.setattr(autotune_measure, "importable_backends", lambda device: (["aot", "eager"], {}))
    seen = []
    monkeypatch.setattr(build_auto, "verify_artifact", lambda *a, **k: seen.append(a) or {"ok": True})
    meta = build(tiny_spec("squash", 16), tiny_checkpoint, tmp_path / "art", backend="eager", device="cpu",
                 guard=GuardConfig(calibration_source="renders", calibration_count=16),
                 auto=AutoConfig(precisions=("fp32", "bf16"), deadline_s=1500, clock=clock))
    assert clock.t <= 1500 and seen == []                                # no time to verify anything
    assert (meta["precision"], meta["backend"], meta["batch_size"]) == ("bf16", "eager", 8)
    assert meta["guard"]["recheck_backend"] == "eager"
    search_rec = meta["build"]["search"]
    assert "deadline" in search_rec["fallback"] and search_rec["fallback"].startswith("eager/bf16/b8")
    err = capsys.readouterr().err
    assert sum("falling back to eager/bf16/b8" in ln for ln in err.splitlines()) == 1
