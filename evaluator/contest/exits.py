"""Every exit path of scripts/run: what a run holds and releases, signals, the fast exit.

A run holds the reserved OUTPUT's temp file (evaluator.contest.output) and its scratch
folder TMPDIR/eva-engine-run-<random> (whatever a library writes there stays in it), made with
a unique name and held under a flock on its `.owner` file while the run lives: a folder is swept
as a killed run's only when that lock can be taken (a lock dies with its process), never by a
PID that another PID namespace may reuse. `Held`
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

from engine.io import make_owned_temp, owner_gone
from evaluator.contest.output import Output, stale

RUN_DIR_PREFIX = "eva-engine-run-"          # TMPDIR/eva-engine-run-<random>: this run's scratch folder
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def private_tmpdir(prog: str) -> tuple[Path, int] | None:
    """(TMPDIR/eva-engine-run-<random>, the fd holding its owner lock), made the process's TMPDIR and
    removed by Held.release; killed runs' folders are removed first. None, said on stderr, when
    TMPDIR is not writable (an artifact that needs it then fails to load)."""
    from engine import settings

    base = settings.tmpdir()
    try:
        for p in base.iterdir():
            if p.name.startswith(RUN_DIR_PREFIX) and _abandoned(p):
                shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass
    try:
        d, fd = _owned_folder(base)
    except OSError as e:
        print(f"{prog}: warning: TMPDIR {base} is not writable ({e.strerror or e}); continuing without a "
              "scratch folder", file=sys.stderr)
        return None
    os.environ.update(TMPDIR=str(d))   # C++ loaders and Python's tempfile read it when they need it
    tempfile.tempdir = None
    return d, fd


def _owned_folder(base: Path) -> tuple[Path, int]:
    """A new folder under `base` with a unique name, its OWNER file created and flocked."""
    return make_owned_temp(base, RUN_DIR_PREFIX)


def _abandoned(folder: Path) -> bool:
    """A scratch folder whose run is gone: its OWNER lock can be taken. One without an OWNER (made
    by an older run, named by its PID) is abandoned when that process no longer runs."""
    gone = owner_gone(folder)
    return stale(folder.name, RUN_DIR_PREFIX) if gone is None else gone


class Held:
    """What a run must release on every exit path: the reserved OUTPUT and the scratch folder."""

    output: Output | None = None
    scratch: Path | None = None
    scratch_lock: int | None = None     # the fd holding the scratch folder's OWNER lock

    def hold_scratch(self, made: tuple[Path, int] | None) -> None:
        self.scratch, self.scratch_lock = made if made is not None else (None, None)

    def release(self) -> None:
        if self.output is not None:
            self.output.discard()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            os.environ.update(TMPDIR=str(self.scratch.parent))   # the caller's TMPDIR again
            tempfile.tempdir = None
        if self.scratch_lock is not None:
            os.close(self.scratch_lock)   # after the folder is gone: a sweeper never sees it unlocked
            self.scratch_lock = None


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
