"""What a timing report says of this process: when it started and its peak memory.

Report times are seconds since the process started: ENGINE_T0 when set (scripts/run sets it
before the interpreter starts), else the start time Linux keeps in /proc, else the import of
this module.
"""
from __future__ import annotations

import os
import time

_T_IMPORT = time.perf_counter()


def process_start() -> float:
    """Wall-clock second (time.time()) the process, or the command that started it, began."""
    from engine import settings

    try:
        t0 = settings.t0()
    except ValueError:
        t0 = None
    if t0 is not None:
        return t0
    try:  # Linux: process start time from /proc, in clock ticks since boot
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - (time.perf_counter() - _T_IMPORT)


def start_offset(start: float) -> float:
    """What turns a time.perf_counter() value into seconds since `start` (a time.time() value),
    added to it."""
    return (time.time() - time.perf_counter()) - start


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory so far, MiB: {"process": this one, "children": the largest of its
    children that ended and were waited for (an isolated decoder, once closed; also a helper a
    library forked, whose figure starts at this process's size at the fork: torch's import
    runs `ldconfig -p` so)}."""
    import resource

    kib = {"process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,      # Linux: KiB
           "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}
    return {k: round(v / 1024, 1) for k, v in kib.items()}
