"""SIGINT (Ctrl-C) ends scripts/run.sh and scripts/build.sh as SIGTERM does: what is finished is
kept, one line on stderr, no traceback, out within a second; the same command then resumes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
from cir_helpers import (
    REPO,
    build_args,
    built_index,
    check_abi,
    clip_dirs,
    corpus,
    read_rows,
    requests_of,
    run_args,
)

from engine.retrieval.index import BUILD_DIR, load_index
from evaluator.cir import build as cir_build
from evaluator.cir import run as cir_run

PROMPT_S = 1.5   # SIGTERM ends either command in ~0.1 s; a shared 2-core machine gets some slack

SLOW_RUN = "import sys, time\nfrom evaluator.cir import run\n" \
           "sys.exit(run.main(sys.argv[1:], on_row=lambda n: time.sleep(0.1)))"
SLOW_BUILD = """import sys, time
from engine.retrieval import index
save = index.ChunkStore.save
def slow(self, *a, **k):
    save(self, *a, **k)
    time.sleep(0.5)
index.ChunkStore.save = slow
from evaluator.cir import build
sys.exit(build.main(sys.argv[1:]))
"""


def _interrupt(code: str, args: list[str], ready) -> tuple[subprocess.CompletedProcess, float]:
    """Start `code` with `args`, SIGINT it once `ready()` holds; (its result, seconds to exit)."""
    env = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "CLIP_DEVICE": "cpu",
           "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 240
    while not ready() and p.poll() is None and time.monotonic() < end:
        time.sleep(0.02)
    assert p.poll() is None, "finished before it could be interrupted: " + p.stderr.read()[-2000:]
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.monotonic() - t


def _last_line(err: str) -> str:
    return [ln for ln in err.splitlines() if ln.strip()][-1]


def test_sigint_ends_a_run_keeping_its_rows(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    q = corpus() / "requests.jsonl"
    args = run_args(q, out)

    def five_rows():
        return out.exists() and out.read_bytes().count(b"\n") >= 5

    r, took = _interrupt(SLOW_RUN, args, five_rows)
    assert r.returncode == cir_run.INTERRUPTED, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
    assert _last_line(r.stderr) == ("scripts/run.sh: interrupted (SIGINT): every row written so far is kept; "
                                    "the same command resumes")
    assert took < PROMPT_S, took
    kept = read_rows(out)                                     # whole rows only, no torn line
    assert 5 <= len(kept) < len(requests_of(q))
    capsys.readouterr()
    assert cir_run.main(args) == 0
    assert f"resuming {out}: {len(kept)} rows kept" in capsys.readouterr().err
    check_abi(read_rows(out), requests_of(q), load_index(built_index()).ids)


def test_sigint_ends_a_build_keeping_its_chunks(tmp_path, capsys):
    d = tmp_path / "index"
    args = build_args(d, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu")

    def one_chunk():
        return (d / BUILD_DIR / "chunk-000000.json").exists()

    r, took = _interrupt(SLOW_BUILD, args, one_chunk)
    assert r.returncode == cir_run.INTERRUPTED, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
    assert _last_line(r.stderr) == ("scripts/build.sh: interrupted (SIGINT): finished chunks are kept; "
                                    "the same command resumes the build")
    assert took < PROMPT_S, took
    done = len(list((d / BUILD_DIR).glob("chunk-*.json")))
    assert 1 <= done < 6
    capsys.readouterr()
    assert cir_build.main(args) == 0
    assert f"resuming: {done} of 6 chunks already built" in capsys.readouterr().err
    a, ref = load_index(d), load_index(built_index())
    assert a.ids == ref.ids and np.array_equal(np.asarray(a.emb), np.asarray(ref.emb))


def test_the_previous_sigint_handler_comes_back(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    assert cir_run.main(["--index-dir", str(tmp_path), "--queries", str(tmp_path / "q"),
                         "--output", str(tmp_path / "o")]) == 2
    assert signal.getsignal(signal.SIGINT) is before
