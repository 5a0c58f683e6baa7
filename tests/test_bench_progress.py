"""The benchmarks' preparation is said on the terminal while it runs, not swallowed by pytest's
capture (tests/bench/prep_progress.py): a passing pytest run shows each step's lines and the
output of the processes a step starts."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

MODULE = '''
import subprocess, sys, time
import pytest
import prep_progress
from prep_progress import Preparation

prep_progress.HEARTBEAT_S = 0.2

@pytest.fixture(scope="module")
def prepared(request):
    prep = Preparation(request.config)
    prep.say("preparing in ROOT")
    with prep.step("building the thing", "minutes"):
        subprocess.run([sys.executable, "-c", "import sys; print('child progress line', file=sys.stderr)"],
                       check=True)
        time.sleep(0.5)
    print("captured, as pytest does with a fixture's output")
    return 1

def test_uses_it(prepared):
    assert prepared == 1
'''


def test_preparation_lines_reach_the_terminal_past_pytests_capture(tmp_path):
    (tmp_path / "test_prep_demo.py").write_text(MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "bench"), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_prep_demo.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr
    assert "bench: preparing in ROOT" in err
    assert "bench: building the thing (minutes) ..." in err
    assert "bench: building the thing: still running" in err              # the heartbeat
    assert "child progress line" in err                                      # a started process's own output
    assert "bench: building the thing: done in " in err
    assert err.index("building the thing (minutes)") < err.index("child progress line") < err.index("done in")
    assert "captured, as pytest does" not in r.stdout + err                  # outside a step, capture holds
