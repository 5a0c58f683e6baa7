"""The measured build inside one deadline, on a fake clock (no real compile, no timed test): a slow
compile, a slow verification and a slow preamble (checkpoint load, calibration reference) each
still end inside the deadline, with a verified artifact or the eager FP32 fallback, and the
manifest says which and why; a backend failing for a reason of the machine is compiled once; a
disk quota of about three compiles still gives a verified artifact; a calibration slower than
planned takes only the images that fit its share; the end-to-end check's child is stopped at the
time left."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from conftest import tiny_spec
from test_autotune import FakeMeasurer

FAIL_ENV = "CppCompileError: x.cpp:1:10: fatal error: Python.h: No such file or directory"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedFake(FakeMeasurer):
    """Planted rates (fp32 faster, larger batches faster), real eager compiles into the search's work
    folder, and the build's fake clock advanced by what each step is said to cost."""

    def __init__(self, clock, real, ctx, workdir, compile_s=1.0, env_fail=False):
        screen = {(p, b): 30.0 for p in ("fp32", "bf16") for b in (8, 16, 32)}
        graph = {(p, b, "eager", "default"): 40.0 + b + (5 if p == "fp32" else -20) for p in ("fp32", "bf16")
                 for b in (8, 16, 32)}
        super().__init__(clock, screen, graph, compile_s=compile_s)
        self.env_fail = env_fail
        self._real = real(ctx, workdir)

    def compile(self, c):
        self.clock.t += self.compile_s
        self.compiled.append(c.name)
        if self.env_fail:
            raise RuntimeError(FAIL_ENV)
        return self._real.compile(c)

    def discard(self, h):
        self._real.discard(h)


def _build(tmp_path, ckpt, monkeypatch, deadline, compile_s=1.0, verify_s=1.0, verify_ok=lambda name: True,
           load_s=0.0, calibration_s=0.0, env_fail=False, count=16, per_image_s=0.0):
    """engine.build's auto build of the tiny model (eager, counted as a compiling backend so the
    compile rules apply) on a fake clock, `count` calibration renders, each image a real graph
    classifies costing `per_image_s` more; returns (manifest, clock, measurer, verified names)."""
    from engine.core import checkpoint
    from engine.tuning import AutoConfig, GuardConfig, assemble, build, calibrate
    from engine.tuning import auto as build_auto
    from engine.tuning import measure as autotune_measure

    clock, made = Clock(), []
    real = autotune_measure.Measurer

    def measurer(*a, **k):
        made.append(TimedFake(clock, real, *a, compile_s=compile_s, env_fail=env_fail, **k))
        return made[-1]

    def slow(fn, seconds):
        def run(*a, **k):
            clock.t += seconds
            return fn(*a, **k)
        return run

    monkeypatch.setattr(autotune_measure, "Measurer", measurer)
    monkeypatch.setattr(autotune_measure, "importable_backends", lambda device: (["eager"], {}))
    config = build_auto.search_config
    monkeypatch.setattr(build_auto, "search_config",
                        lambda *a: (lambda cfg, sk: (dataclasses.replace(cfg, compiled=("eager",)), sk))(*config(*a)))
    monkeypatch.setattr(checkpoint, "load_model", slow(checkpoint.load_model, load_s))
    if calibration_s:
        monkeypatch.setattr(assemble, "calibration_stream", slow(assemble.calibration_stream, calibration_s))
    classify = calibrate.classify

    def slow_classify(fn, pixels, *a, **k):
        clock.t += per_image_s * len(pixels)
        return classify(fn, pixels, *a, **k)

    monkeypatch.setattr(calibrate, "classify", slow_classify)
    seen = []

    def verify(ctx, spec, timeout=1800.0):
        name = f"eager/{spec.precision}/b{spec.batch_size}"
        seen.append(name)
        clock.t += verify_s
        ok = verify_ok(name)
        return {"ok": ok, "images": 16, "agreement": 1.0 if ok else 0.5, **({} if ok else {"why": "planted"})}

    monkeypatch.setattr(build_auto, "verify_artifact", verify)
    meta = build(tiny_spec("squash", 16), ckpt, tmp_path / "art", backend="eager", device="cpu",
                 guard=GuardConfig(calibration_source="renders", calibration_count=count),
                 auto=AutoConfig(precisions=("fp32", "bf16"), deadline_s=deadline, clock=clock))
    return meta, clock, made[0], seen


def test_a_calibration_slower_than_planned_takes_only_the_images_that_fit_its_share(
        tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """0.1 s an image by the fake clock: the calibration's share (the preset's plan, 20 s, the search
    leaving nothing spare under a 1,000 s deadline) holds as many whole batches of 16 as fit at that
    rate, its later passes (the decoder's check) counted; the cut is one line, the manifest counts
    the images used, and the phase stays inside its share."""
    from engine.decoders import default_decoder, start_problem

    # the decoder's check reads and classifies each image twice more (PIL, dali-cpu) where dali-cpu starts
    later = 2 if start_problem(default_decoder("cpu")) is None else 0
    batch_s = 16 * 0.1 * (1 + later)
    want = 16 * int(20 // batch_s)                       # whole batches inside the 20 s share
    assert 16 <= want < 256
    meta, clock, _, _ = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1000, count=256, per_image_s=0.1)
    search = meta["build"]["search"]
    assert search["calibration"]["count"] == want and search["calibration"]["asked"] == 256
    assert search["calibration"]["fit"]["seconds"] == 20
    line = f"calibration: {want} of 256 images fit the 20 s left for it at "
    err = capsys.readouterr().err
    assert err.count(line) == 1 and f"engine.build: deadline: {line}" in err
    assert any(c.startswith(line) for c in search["clock"]["cut"])
    assert search["clock"]["actual_s"]["calibration"] <= 20 and clock.t <= 1000


def _rows(meta) -> dict:
    return {r["name"]: r for r in meta["build"]["search"]["candidates"]}


def test_a_compile_slower_than_its_estimate_stops_the_compiles_and_the_build_ends_verified_in_time(
        tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """The preset's first estimate is 120 s; the compile takes 600: it also stands for the re-check
    graph's compile, so no second compile fits before the deadline, and the one compiled is verified."""
    meta, clock, m, seen = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1000, compile_s=600)
    search = meta["build"]["search"]
    assert clock.t <= 1000
    assert m.compiled == ["eager/fp32/b8"] and seen == ["eager/fp32/b8"]
    assert search["chosen"] == "eager/fp32/b8" and search["fallback"] is None and search["verify"][0]["ok"]
    rows = _rows(meta)
    assert "before the build's deadline" in rows["eager/fp32/b16"]["why"]
    assert rows["eager/fp32/b16"]["status"] == "not compiled"
    c = search["clock"]
    assert c["deadline_s"] == 1000 and c["plan_s"]["recheck"] == 120 and c["actual_s"]["search"] >= 600
    err = capsys.readouterr().err
    assert err.index("engine.build: deadline 1000 s; plan: checkpoint 10 s") < err.index("autotune: measuring")
    assert err.rstrip().splitlines()[-1].startswith("engine.build: spent ")


def test_a_slow_failing_verification_leaves_no_time_for_the_next_and_the_build_is_eager_fp32(
        tmp_path, tiny_checkpoint, monkeypatch):
    meta, clock, _, seen = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1500, verify_s=900,
                                  verify_ok=lambda name: False)
    search = meta["build"]["search"]
    assert clock.t <= 1500 and seen == ["eager/fp32/b32"]        # the second would end past the deadline
    assert (meta["precision"], meta["backend"], meta["cuda_graphs"]) == ("fp32", "eager", False)
    assert search["chosen"] is None and "deadline" in search["fallback"] and "not verified" in search["fallback"]
    assert [v["ok"] for v in search["verify"]] == [False, False] and search["verify"][1]["deadline"]
    assert search["verify"][1]["candidate"] == "eager/fp32/b16"
    assert any("not assembled or verified" in line for line in search["clock"]["cut"])


def test_a_slow_verification_that_passes_is_the_artifact(tmp_path, tiny_checkpoint, monkeypatch):
    meta, clock, _, seen = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1500, verify_s=900)
    assert clock.t <= 1500 and seen == ["eager/fp32/b32"]
    assert meta["build"]["search"]["chosen"] == "eager/fp32/b32" and meta["build"]["search"]["verify"][0]["ok"]
    assert meta["build"]["search"]["clock"]["actual_s"]["verify"] >= 900


def test_a_slow_preamble_shortens_the_search_and_the_build_still_ends_verified_in_time(
        tmp_path, tiny_checkpoint, monkeypatch):
    meta, clock, m, _ = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1500, compile_s=100,
                               load_s=600, calibration_s=300)
    search = meta["build"]["search"]
    assert clock.t <= 1500 and 1 <= len(m.compiled) < 6
    assert search["chosen"] and search["verify"][-1]["ok"]
    assert search["clock"]["actual_s"]["checkpoint"] == 600 and search["clock"]["actual_s"]["calibration"] == 300


def test_a_preamble_that_leaves_no_time_to_compile_gives_the_eager_fp32_fallback(tmp_path, tiny_checkpoint,
                                                                                 monkeypatch, capsys):
    meta, clock, m, seen = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1500, compile_s=100,
                                  load_s=1300)
    search = meta["build"]["search"]
    assert clock.t <= 1500 and m.compiled == [] and seen == []
    assert search["chosen"] is None and "deadline" in search["fallback"]
    assert all(r["status"] == "not compiled" for r in search["candidates"])
    assert "WARNING: the build's deadline left no time" in capsys.readouterr().err


def test_a_backend_failing_for_a_reason_of_the_machine_is_compiled_once(tmp_path, tiny_checkpoint, monkeypatch,
                                                                        capsys):
    meta, _, m, _ = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1500, env_fail=True)
    assert m.compiled == ["eager/fp32/b8"]
    search = meta["build"]["search"]
    assert search["dropped"] == {"eager": "missing header Python.h"} and search["fallback"]
    rows = _rows(meta)
    assert rows["eager/fp32/b8"]["status"] == "failed"
    assert {r["why"] for n, r in rows.items() if n != "eager/fp32/b8"} == {"backend eager dropped: missing header Python.h"}
    assert capsys.readouterr().err.count("backend eager dropped: missing header Python.h; its other candidates") == 1


def test_a_disk_quota_of_about_three_compiles_still_gives_a_verified_artifact(tmp_path, tiny_checkpoint, monkeypatch):
    from engine.io import tree_bytes
    from engine.tuning import disk as build_disk

    one = tiny_checkpoint.stat().st_size               # one candidate's files: the FP32 weights, about
    quota = int(3.5 * one)
    monkeypatch.setattr(build_disk, "free_bytes", lambda folder: quota - tree_bytes(folder))
    meta, _, m, _ = _build(tmp_path, tiny_checkpoint, monkeypatch, deadline=1500)
    search = meta["build"]["search"]
    assert len(m.compiled) == 6 and search["disk"]["skipped_for_space"] == 0
    assert 0 < search["disk"]["peak_bytes"] <= quota
    assert search["chosen"] == "eager/fp32/b32" and search["verify"][-1]["ok"]


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaped yet counts as ended)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_end_to_end_checks_child_is_stopped_at_the_time_left_with_what_it_started(tmp_path, monkeypatch):
    """The check's scripts/run gets what the deadline left as its timeout; past it, it is stopped with
    every process it started (a grandchild holding its pipes does not keep the build waiting), and the
    check fails with one reason instead of raising."""
    import time

    from engine.tuning import auto as build_auto

    fake = tmp_path / "repo"
    (fake / "scripts").mkdir(parents=True)
    pid_file = tmp_path / "grandchild.pid"
    run = fake / "scripts" / "run"
    run.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {pid_file}\nwait\n")
    run.chmod(0o755)
    monkeypatch.setattr(build_auto, "REPO", fake)
    t = time.monotonic()
    got, rec = build_auto._run_script(tmp_path, [b"not a jpeg"], "pil", 1.0)
    assert time.monotonic() - t < 15 and len(got) == 0
    assert "did not finish in the 1 s the build's deadline left" in rec["why"]
    pid = int(pid_file.read_text())
    for _ in range(50):
        if _gone(pid):
            break
        time.sleep(0.1)
    assert _gone(pid), f"the grandchild {pid} outlived the timeout"
