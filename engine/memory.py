"""The address space a run maps, from measured parts, checked against RLIMIT_AS before torch loads.

A run under `ulimit -v` / `prlimit --as` that lacks room fails late and badly: a shared library
that cannot be mapped, an allocator error in the middle of a batch, or glibc aborting a thread
that finds no room for its thread-local data (exit 127, nothing to catch). So each entry point
compares the limit with an estimate first and says, in one line, the limit and the need:

    need = fixed + per thread (stack, malloc arena) + the bytes of the files the run maps

Measured with the check off by bisecting RLIMIT_AS (2 MiB steps) over whole runs of the tiny
test models (x86_64, 2 CPUs, torch 2.14.1 CUDA build on the CPU, glibc 2.3x), by thread
count N (`threads.Budget.peak(isolated=False)`):

    classification (scripts/run)  N=8: 3359 MiB  N=11: 3568  N=19: 4137  N=35: 4638 (8 MB artifact)
    retrieval index build         see RETRIEVAL_BUILD_FIXED;  retrieval queries: RETRIEVAL_RUN_FIXED

Each thread maps its stack (8 MiB) and, while glibc allows new ones (8 per CPU), a malloc arena
(64 MiB reserved): 72 MiB each up to 8 per CPU, then 40 MiB each (measured). The fixed parts are
the measured thresholds less the threads' and files' shares; the estimate is at most 1.5 % above
every measured threshold (MARGIN covers run-to-run noise). A CUDA run maps more (the driver
reserves large ranges) and is not measured here: its estimate is the CPU one, a lower bound.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

MiB = 1 << 20
THREAD_STACK = 8 * MiB          # glibc's default thread stack (RLIMIT_STACK's 8 MiB)
MALLOC_ARENA = 64 * MiB         # one glibc malloc arena's reservation (HEAP_MAX_SIZE on 64-bit)
THREAD_PAST_ARENAS = 40 * MiB   # measured per thread once glibc's 8 arenas per CPU are all made
MARGIN = 16 * MiB               # run-to-run noise of the measured thresholds (a few MiB) and rounding

CLASSIFY_FIXED = 2775 * MiB          # python, numpy, PIL, torch with its CUDA libraries, the engine
DECODER_HERE = {"dali": 823 * MiB,   # a decoder in the process (not in a child): DALI's libraries and pools,
                "pil": 339 * MiB}    # PIL's decode pool and batches (measured beside an isolated DALI)
RETRIEVAL_BUILD_FIXED = 2775 * MiB   # the same and the CLIP towers, DALI's CPU decoder
RETRIEVAL_RUN_FIXED = 2775 * MiB     # the same and the CLIP towers, the query pipeline


def decoder_bytes(name: str | None) -> int:
    """What decoder `name` adds when it runs in this process (None: it runs in a child). A
    decoder not measured (nvjpeg, GPU only) counts as PIL, its last fallback."""
    if name is None:
        return 0
    return DECODER_HERE["dali"] if name.startswith("dali") else DECODER_HERE["pil"]


class AddressSpaceError(RuntimeError):
    """The address-space limit is below what the run maps; the message says both, in one line."""


def tree_or_file_bytes(path: str | os.PathLike) -> int:
    """Bytes of a file, or of the files under a folder; 0 for a path that is not there."""
    from engine.io import tree_bytes

    try:
        if os.path.isfile(path):
            return os.path.getsize(path)
    except OSError:
        return 0
    return tree_bytes(path) if os.path.isdir(path) else 0


def thread_bytes(threads: int, cpus: int | None = None) -> int:
    """Address space `threads` threads reserve: a stack each, and a malloc arena each while glibc
    still makes new ones (8 per CPU)."""
    cpus = cpus or os.cpu_count() or 1
    with_arena = min(threads, 8 * cpus)
    return threads * THREAD_STACK + with_arena * MALLOC_ARENA + (threads - with_arena) * (
        THREAD_PAST_ARENAS - THREAD_STACK)


def need_bytes(files: Iterable[str | os.PathLike], fixed: int, threads: int = 0, cpus: int | None = None) -> int:
    """The address space a run maps: `fixed` + its `threads` + the bytes of `files` (files or
    folders it maps, such as an artifact or an index), with MARGIN."""
    return fixed + thread_bytes(threads, cpus) + sum(tree_or_file_bytes(f) for f in files) + MARGIN


def address_space_limit() -> int | None:
    """The soft RLIMIT_AS in bytes, or None when there is none."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def check_address_space(need: int, what: str = "this run") -> None:
    """AddressSpaceError when the soft RLIMIT_AS is below `need` bytes ("WHAT maps")."""
    soft = address_space_limit()
    if soft is not None and soft < need:
        raise AddressSpaceError(f"the address-space limit ({soft >> 20} MiB, ulimit -v) is below the about "
                                f"{-(-need // MiB)} MiB {what} maps: raise the limit to at least that")


def is_oom(e: BaseException) -> bool:
    """Whether `e` is running out of memory: Python's MemoryError or an allocator's RuntimeError."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text))


def is_thread_start_failure(e: BaseException) -> bool:
    """Whether `e` is Python failing to start a thread (no room for its stack, or the process limit)."""
    return isinstance(e, RuntimeError) and "can't start new thread" in str(e).lower()


def exhaustion_line(e: BaseException) -> str | None:
    """One line for running out of memory or threads, naming the limit; None for any other error."""
    first = (str(e).splitlines() or [""])[0][:200]
    soft = address_space_limit()
    limit = f"the address-space limit is {soft >> 20} MiB" if soft is not None else "no address-space limit is set"
    if is_thread_start_failure(e):
        return (f"cannot start a thread ({type(e).__name__}: {first}): {limit}; raise it, or the process "
                "limit (ulimit -u), or set ENGINE_THREADS lower")
    if is_oom(e):
        return f"out of memory ({type(e).__name__}: {first}); {limit}: raise the memory limit or use a smaller batch"
    return None


def is_memory_import_error(e: BaseException) -> bool:
    """Whether an import failed for want of memory (a library that could not be mapped)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "failed to map segment" in text or "cannot allocate memory" in text


def import_failure(module: str, e: BaseException) -> str:
    """Why `module` could not be imported, in words: an interpreter without it, a memory limit too
    low to map it, or the error as it is."""
    import sys

    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == module:
        return f"cannot import {module} ({e}): the interpreter {sys.executable} has no {module} installed"
    if is_memory_import_error(e):
        return f"cannot import {module} ({e}): is the memory limit too low?"
    return f"cannot import {module} ({e})"
