"""One thread budget for the whole process: DALI, torch, OpenMP and the file readers.

Sandboxes bound PIDs (threads count), and a library left to itself sizes its pool from
every core of a many-core host. Everything is derived from `ENGINE_THREADS` (default:
the CPUs this process may use, at most 16):

    readers   file reader threads           ENGINE_READERS, else min(8, max(2, T))
    decoder   DALI worker threads           T
    intra_op  torch / OpenMP / MKL threads  T on the CPU, min(T, 4) beside a GPU
    inter_op  torch inter-op threads        1

`library_env` must reach the environment before numpy or torch is imported (OpenMP and
OpenBLAS size their pools when they load; numpy's OpenBLAS starts its threads right then, and
one it cannot start, under an address-space or process limit, makes it raise SIGINT at itself):
`apply_library_env` puts it there, keeping what the caller set; scripts/runtime_env.sh sets
OPENBLAS_NUM_THREADS the same way for everything a shell entry point starts. `apply_torch` sets
torch's own counts.
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass

from engine import settings


@dataclass(frozen=True)
class Budget:
    total: int        # ENGINE_THREADS
    readers: int
    decoder: int
    intra_op: int
    inter_op: int

    def peak(self, isolated_decoder: bool = True) -> int:
        """Most threads a CPU classification run holds at once, child decoder process included,
        as measured with torch 2.14 and DALI 2.4 (tests/test_hostile.py checks it): main + readers
        + the decode thread + 2 x (intra_op - 1) OpenMP workers (torch's OpenMP and its BLAS's
        each keep a pool), plus DALI's workers and its 3 input threads, plus the child's main thread
        and the thread that ends it when the parent is gone."""
        parent = 1 + self.readers + 1 + 2 * (self.intra_op - 1)
        return parent + self.decoder + 3 + 2 * int(isolated_decoder)


def budget(device: str = "cpu") -> Budget:
    """The budget for a run whose model executes on `device` (cpu | cuda)."""
    t = settings.threads()
    readers = settings.readers() or min(8, max(2, t))
    intra = t if device == "cpu" else min(t, 4)
    return Budget(t, readers, t, intra, 1)


OPENBLAS_THREADS = "1"   # numpy's OpenBLAS: scripts/runtime_env.sh sets the same default


def library_env(b: Budget) -> dict[str, str]:
    """Environment for the native thread pools (set before numpy / torch load)."""
    n = str(b.intra_op)
    # OpenBLAS only serves numpy here: one thread, and no per-thread buffers under a memory cap;
    # OpenMP threads sleep between calls (busy-waiting ones starve the decode threads on few cores)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": OPENBLAS_THREADS,
            "OMP_WAIT_POLICY": settings.omp_wait_policy()}


def apply_library_env(b: Budget, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put `library_env(b)` into `environ` (the process's by default) where it has no value yet: a
    variable the caller set explicitly (not empty) is kept. Returns the values in effect. Call it
    before numpy or torch is imported."""
    env = os.environ if environ is None else environ
    wanted = library_env(b)
    for k, v in wanted.items():
        if not env.get(k):
            env[k] = v
    return {k: env[k] for k in wanted}


def apply_torch(b: Budget) -> None:
    """torch's intra-op and inter-op pools sized from the budget (once per process)."""
    import torch

    torch.set_num_threads(b.intra_op)
    if torch.get_num_interop_threads() == b.inter_op:
        return
    try:
        torch.set_num_interop_threads(b.inter_op)
    except RuntimeError as e:  # already started in this process: its pool keeps its size
        print(f"[engine] torch inter-op threads left as they are ({e})", file=sys.stderr)
