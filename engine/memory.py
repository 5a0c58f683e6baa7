"""The address space a run maps, from measured parts, checked against RLIMIT_AS before torch loads.

A run under `ulimit -v` / `prlimit --as` that lacks room fails late and badly: a shared library
that cannot be mapped, an allocator error in the middle of a batch, or glibc aborting a thread
that finds no room for its thread-local data (exit 127, nothing to catch). So each entry point
compares the limit with an estimate first and says, in one line, the limit and the need:

    need = fixed part + its threads' part + the bytes of the files it maps
           + the OpenBLAS threads past the first + MARGIN

Measured with the check off, by bisecting RLIMIT_AS in 2 MiB steps over whole runs of the tiny
test models (x86_64, 2 CPUs, torch 2.14.1 CUDA build run on the CPU, DALI 2.4; lowest limit
that passed, by ENGINE_THREADS T). The machine: lscpu's "Intel(R) Xeon(R) Processor", family 6
model 167, 2 vCPUs under KVM, with avx512f, avx512_bf16, avx512_fp16, avx512_vnni, amx_bf16,
amx_int8 and amx_tile among its flags; numpy 2 with scipy-openblas 0.3.31 (DYNAMIC_ARCH), torch
with MKL and GNU OpenMP. Remeasured on 2026-12-04 at T=2 after the entry points gave numpy's
OpenBLAS one thread before numpy loads: classification 3568 MiB and index build 4238 (as the
table, within its run-to-run spread), query run 3370 and 3560 (two bisections), T=1 3362, T=4
3598 (twice): below the table (its runs had numpy's OpenBLAS start a second thread).

    classification, dali-cpu in a child   T=1: 3359 MiB  T=2: 3568  T=4: 4137  T=8: 4638  (8 MB artifact)
      the same, DALI in the process                  T=2: 4391 (+823)
      the same, PIL in the process                   T=2: 3907 (+339)
    retrieval query run                   T=1: 3597      T=2: 3597  T=4: 3638   (13 MB CLIP, tiny index)
    retrieval index build                 T=1: 3957      T=2: 4235  T=4: 4337   (13 MB CLIP)

Classification: each of its threads (threads.Budget.peak(isolated_decoder=False): 8, 11, 19, 35
above) maps a stack (8 MiB) and, while glibc makes new ones (8 per CPU), a malloc arena (64 MiB
reserved); past them a thread was measured at 40 MiB. Retrieval: a slope per thread of the budget,
measured between T=2 and T=4; T=1 counts as 2 (the build then asks 294 MiB more than it needs).
Every estimate is 48 to 105 MiB (at most 2.5 %) above the thresholds above, which move by up to
about 12 MiB from run to run on a quiet machine (3568 passed 1 run in 3, 3580 passed 4 in 4) and
more on a busy one (with a margin of 16 MiB, a run failed once at its estimate of 3591 MiB); the
query run's by about 190 MiB (3370 or 3560 at T=2; why was not found: a 64 MiB malloc arena for
each thread that happens to malloc would fit it), so its estimate covers the higher. numpy's OpenBLAS
starts OPENBLAS_NUM_THREADS threads as numpy loads (the entry points set 1 unless the caller set
it); one that cannot start makes OpenBLAS print `blas_thread_init: pthread_create failed` and
raise SIGINT at itself. Each past the first added 41 MiB (VmSize after a GEMM, torch loaded, 1
against 2 threads) and counts in the need: OPENBLAS_THREAD. A CUDA run maps more
(the driver reserves large ranges) and is not measured here: its estimate is the CPU one, a lower
bound. Other machines map more or less, and CI's machine may map more: CI's 2-core machines ran
out at these estimates (classification and index build at T=2), cleanly, in one line each. Forcing this machine's torch
and oneDNN to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) left the classification threshold at
3573 MiB, so the difference is not the vector ISA. Rerun the bisection there (the check off) to refit.
"""
from __future__ import annotations

import os

MiB = 1 << 20
MARGIN = 48 * MiB               # run-to-run noise of the thresholds (about 12 MiB quiet, more on a busy machine)

THREAD_STACK = 8 * MiB          # glibc's default thread stack (RLIMIT_STACK's 8 MiB)
MALLOC_ARENA = 64 * MiB         # one glibc malloc arena's reservation (HEAP_MAX_SIZE on 64-bit)
THREAD_PAST_ARENAS = 40 * MiB   # measured per thread once glibc's 8 arenas per CPU are all made
CLASSIFY_FIXED = 2775 * MiB     # python, numpy, PIL, torch with its CUDA libraries, the engine
DECODER_HERE = {"dali": 823 * MiB,   # a decoder in the process (not in a child): DALI's libraries and pools,
                "pil": 339 * MiB}    # PIL's decode pool and batches (measured beside an isolated DALI)

OPENBLAS_THREAD = 41 * MiB      # each thread numpy's OpenBLAS starts past its first: a stack and its buffer

# (fixed part, per thread of ENGINE_THREADS, at least 2 counted): the retrieval calls
RETRIEVAL_BUILD = (4120 * MiB, 51 * MiB)   # torch, the CLIP towers, DALI's CPU decoder in the process
RETRIEVAL_RUN = (3542 * MiB, 21 * MiB)     # torch, the CLIP towers, the query pipeline


def thread_bytes(threads: int, cpus: int | None = None) -> int:
    """Address space a classification run's `threads` threads reserve: a stack each, and a malloc
    arena each while glibc still makes new ones (8 per CPU), then the measured rest."""
    cpus = cpus or os.cpu_count() or 1
    with_arena = min(threads, 8 * cpus)
    return with_arena * (THREAD_STACK + MALLOC_ARENA) + (threads - with_arena) * THREAD_PAST_ARENAS


def retrieval_thread_bytes(per_thread: int, threads: int) -> int:
    """A retrieval call's threads' part: `per_thread` for each of ENGINE_THREADS, at least 2."""
    return per_thread * max(2, threads)


def decoder_bytes(name: str | None) -> int:
    """What decoder `name` adds when it runs in this process (None: it runs in a child). A
    decoder not measured (nvjpeg, GPU only) counts as PIL, its last fallback."""
    if name is None:
        return 0
    return DECODER_HERE["dali"] if name.startswith("dali") else DECODER_HERE["pil"]


def blas_thread_bytes(openblas_threads: int) -> int:
    """What the threads numpy's OpenBLAS starts as it loads add past its first (OPENBLAS_NUM_THREADS,
    which the entry points set to 1 unless the caller set it)."""
    return max(0, openblas_threads - 1) * OPENBLAS_THREAD


def need_bytes(mapped: int, fixed: int, threads: int = 0) -> int:
    """The address space a run maps: `fixed` + `threads` (its threads' part, in bytes) + `mapped`
    (the bytes of the files or folders it maps, such as an artifact, an index, a CLIP:
    engine.io.path_bytes of each) + the OpenBLAS threads past the first
    (engine.settings.openblas_threads) + MARGIN."""
    from engine import settings

    blas = blas_thread_bytes(settings.openblas_threads())
    return fixed + threads + mapped + blas + MARGIN


class AddressSpaceError(RuntimeError):
    """The address-space limit is below what the run maps; the message says both, in one line."""


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


def sigint_origin() -> str | None:
    """Where a SIGINT may have come from, in words, under an address-space limit; None without one.
    A Python handler cannot see the sender, and a native library that fails to start a thread
    raises SIGINT at itself (OpenBLAS: `blas_thread_init: pthread_create failed`), which such a
    limit makes likely: the line a run prints then names the limit beside Ctrl-C, not a key alone."""
    soft = address_space_limit()
    if soft is None:
        return None
    return (f"sent by Ctrl-C or a kill, or raised by a library that could not start a thread under the "
            f"{soft >> 20} MiB address-space limit, ulimit -v")


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
