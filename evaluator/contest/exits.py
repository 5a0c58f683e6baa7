"""Every exit path of scripts/run: what a run holds and releases, signals, the fast exit.

A run holds the reserved OUTPUT's temp file (evaluator.contest.output) and its scratch
folder TMPDIR/eva-engine-run-<pid> (whatever a library writes there stays in it). `Held`
releases both on every exit path; SIGTERM, SIGHUP and SIGINT become a `Signalled` exit
(128 + signal) inside `signals_exit()`, so a terminated run releases them too. `exit_now`
leaves without interpreter teardown (torch/DALI finalizers cost seconds on the clock).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from evaluator.contest.output import Output, stale

RUN_DIR_PREFIX = "eva-engine-run-"          # TMPDIR/eva-engine-run-<pid>: this run's scratch folder
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def private_tmpdir(prog: str) -> Path | None:
    """TMPDIR/eva-engine-run-<pid>, made the process's TMPDIR and removed by Held.release;
    folders of killed runs are removed first. None, said on stderr, when TMPDIR is not writable
    (an artifact that needs it then fails to load)."""
    from engine import settings

    base = settings.tmpdir()
    try:
        for p in base.iterdir():
            if stale(p.name, RUN_DIR_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass
    d = base / f"{RUN_DIR_PREFIX}{os.getpid()}"
    try:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o700)
    except OSError as e:
        print(f"{prog}: warning: TMPDIR {base} is not writable ({e.strerror or e}); continuing without a "
              "scratch folder", file=sys.stderr)
        return None
    os.environ.update(TMPDIR=str(d))   # C++ loaders and Python's tempfile read it when they need it
    tempfile.tempdir = None
    return d


class Held:
    """What a run must release on every exit path: the reserved OUTPUT and the scratch folder."""

    output: Output | None = None
    scratch: Path | None = None

    def release(self) -> None:
        if self.output is not None:
            self.output.discard()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            os.environ.update(TMPDIR=str(self.scratch.parent))   # the caller's TMPDIR again
            tempfile.tempdir = None


class Signalled(SystemExit):
    """A signal stopped the run: main() cleans up and returns 128 + signal, so the caller's fast
    exit still applies (interpreter teardown would cost seconds)."""


def _on_signal(sig: int, _frame) -> None:
    raise Signalled(128 + sig)


@contextlib.contextmanager
def signals_exit():
    """SIGTERM, SIGHUP and SIGINT raise Signalled inside the block; the previous handlers after it."""
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in previous:
        signal.signal(s, _on_signal)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)
