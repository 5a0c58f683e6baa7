"""Child processes that never outlive the command that started them.

A command that starts a long child (build.sh -> python -m engine.build -> scripts/run for the
verification) must not leave it running when it is killed: an orphaned build would finish
later and replace an artifact that a newer build already reported ready. So every such child

- runs in a process group of its own, which is killed (SIGTERM, then SIGKILL after a grace)
  whenever the parent leaves the wait for it: an exception, Ctrl-C, a SIGTERM turned into an
  exit by `signals_exit`, a timeout;
- gets SIGTERM from the kernel when its parent dies, however it dies (SIGKILL included), on
  Linux through prctl(PR_SET_PDEATHSIG); that setting survives exec, so a shell script that
  execs Python keeps it.

`signals_exit()` turns SIGTERM and SIGHUP into `Terminated` (a SystemExit of 128 + signal) in the
main thread, so `finally` blocks run (temp folders removed, children killed) before the exit.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

GRACE_S = 10.0          # a child's time to clean up after SIGTERM before its group gets SIGKILL
_PR_SET_PDEATHSIG = 1   # linux/prctl.h


class Terminated(SystemExit):
    """SIGTERM or SIGHUP stopped the command: exit 128 + the signal, after the cleanup."""

    def __init__(self, sig: int):
        super().__init__(128 + sig)
        self.signal = sig


def _raise_terminated(sig: int, _frame) -> None:
    raise Terminated(sig)


@contextlib.contextmanager
def signals_exit():
    """Inside: SIGTERM and SIGHUP raise Terminated (SIGINT already raises KeyboardInterrupt).
    Only the main thread can install handlers; elsewhere this does nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _prctl():
    """libc's prctl, loaded before a fork (None where there is none: not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with(parent: int, prctl):
    """The child's first step after fork: SIGTERM when `parent` dies; gone already, exit now."""
    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:    # the parent died before the setting took: nobody would signal
            os._exit(128 + signal.SIGTERM)
    return setup


def kill_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to `proc`'s process group, then SIGKILL to what is left after `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)   # grandchildren that outlived the child too
    proc.wait()


def popen(cmd, **kwargs) -> subprocess.Popen:
    """subprocess.Popen in a process group of its own, SIGTERMed when this process dies."""
    return subprocess.Popen(cmd, process_group=0, preexec_fn=_die_with(os.getpid(), _prctl()), **kwargs)


def run(cmd, timeout: float | None = None, grace_s: float = GRACE_S, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run's form and result, the child started by `popen`: on a timeout, an exception or a
    signal in this process the child's whole group is killed before the error goes on."""
    if kwargs.pop("capture_output", False):
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with popen(cmd, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:   # a timeout, Ctrl-C, Terminated, any error: the group goes first
            kill_group(proc, grace_s)
            raise
        kill_group(proc, 0)   # the child has exited: what it left in its group goes too
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
