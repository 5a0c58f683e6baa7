"""A compile that runs past its share of the build's deadline is stopped.

Why in this process, not in a child: a compile needs the network in memory and, on CUDA, the
device (AOTInductor traces and autotunes its kernels there, TensorRT builds its engine there).
A child would load the checkpoint again, and under the EXCLUSIVE_PROCESS compute mode it could
not open the device at all while the build holds it. So the compile runs where the build's
network and CUDA context already are, and is made stoppable instead: `stop_after(seconds)` arms
SIGALRM, whose handler raises `CompileStopped` in the main thread wherever the compile is.
Python code (Dynamo's tracing, Inductor's lowering, a wait on the C++ compiler: subprocess.run
kills its child when the wait is interrupted) stops at once. `CompileStopped` is a BaseException,
so the `except Exception` that a compiler wraps around one autotuning choice does not swallow it,
and the alarm repeats every REPEAT_S until the block exits, so a handler that swallows one still
meets the next. What no signal interrupts: one long call inside C code (TensorRT's builder, a
CUDA kernel) ends before the exception is raised; the compile stops when that call returns.

Only the main thread receives signals: elsewhere, or where there is no SIGALRM, the block runs
unguarded (`guarded()` says whether it can be).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

REPEAT_S = 1.0      # the alarm again every second until the stopped block has exited


class CompileStopped(BaseException):
    """The compile ran past its allowance; raised in it by the watchdog."""

    def __init__(self, seconds: float):
        super().__init__(f"stopped after its allowance of {seconds:.0f} s")
        self.seconds = seconds


def guarded() -> bool:
    """Whether a block here can be stopped (the main thread, a platform with SIGALRM)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_after(seconds: float | None) -> Iterator[None]:
    """Run the block; once it has run `seconds` (None: never), raise CompileStopped inside it."""
    if seconds is None or not guarded():
        yield
        return
    limit = max(float(seconds), 0.001)

    def _stop(_sig, _frame):
        raise CompileStopped(limit)

    old = signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, limit, REPEAT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)       # disarmed before the old handler is back
        signal.signal(signal.SIGALRM, old)
