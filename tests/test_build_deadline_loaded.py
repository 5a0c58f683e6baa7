"""A measured build of the tiny model as a process, with two busy loops beside it on the machine's
cores, and a short deadline: every phase is cut to what it has (the calibration to the images that
fit its share), so the build ends within its deadline plus the slack engine.tuning.clock states."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from conftest import REPO

from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

DEADLINE_S = 15
SLACK_S = 20     # engine.tuning.clock: one step no clock cuts, the eager FP32 fallback's assembly, the exit


@contextmanager
def busy_loops(n: int = 2):
    """n processes spinning on the CPU for the block, killed after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _timed_build(argv: list[str], env: dict, timeout: float) -> tuple[int, str, float | None, float]:
    """(exit status, stderr, when the build's plan line came, when the process ended), seconds on one clock.
    The deadline counts from the plan line (the build's clock starts after the process's imports)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err, planned = [], None
    stop = threading.Timer(timeout, proc.kill)     # a build that never ends fails the test, in time
    stop.start()
    try:
        for line in proc.stderr:
            err.append(line)
            if planned is None and line.startswith(f"engine.build: deadline {DEADLINE_S} s; plan:"):
                planned = time.monotonic() - t0
        proc.wait()
    finally:
        stop.cancel()
        proc.kill()
        proc.wait()
    return proc.returncode, "".join(err), planned, time.monotonic() - t0


@pytest.mark.abi
@pytest.mark.slow
def test_a_measured_build_under_load_ends_within_its_deadline_and_slack(tmp_path, tiny_checkpoint):
    out = tmp_path / "art"
    argv = [sys.executable, "-m", "engine.build", "--model", TINY_MODEL, "--checkpoint", str(tiny_checkpoint),
            "--out", str(out), "--input-size", str(TINY_INPUT), "--crop-pct", "1.0",
            "--model-kwargs", json.dumps(TINY_KWARGS), "--precision", "auto", "--deadline-s", str(DEADLINE_S),
            "--calibration-count", "1000"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    with busy_loops(2):
        rc, err, planned, ended = _timed_build(argv, env, timeout=180)
    assert rc == 0 and planned is not None, err[-2000:]
    assert ended - planned <= DEADLINE_S + SLACK_S, (ended - planned, err[-3000:])
    meta = json.loads((out / "manifest.json").read_text())
    search = meta["build"]["search"]
    assert search["clock"]["elapsed_s"] <= DEADLINE_S + SLACK_S, search["clock"]
    # the calibration took what fit, said in one line, and the manifest counts those
    used = search["calibration"]["count"]
    assert 16 <= used < 1000 and search["calibration"]["asked"] == 1000
    lines = [x for x in err.splitlines() if x.startswith(f"engine.build: deadline: calibration: {used} of 1000 ")]
    assert len(lines) == 1, err[-3000:]
