"""Memory limits of the retrieval ABIs: checked before torch loads, and the residual failures said
in one line.

`address_space_problem` compares RLIMIT_AS with what the call maps (engine.memory: the measured
fixed part of a build or a query run, its threads, the CLIP's files and the index's), before
anything heavy is imported: without room, glibc aborts a thread that finds none for its
thread-local data (exit 127, nothing to catch). `exhaustion_guarded` turns a MemoryError, an
allocator's "can't allocate memory" or a thread that cannot start into one `PROG: error:` line.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def clip_folder_guess(given: Path | None, index_dir: Path | None = None) -> Path | None:
    """The CLIP folder the call will most likely load, found without importing torch or hashing
    anything (the order of engine.retrieval.index_clip.resolve); None when none is there."""
    from engine import settings
    from evaluator.cir import task

    meta = None
    if index_dir is not None:
        try:
            meta = json.loads((Path(index_dir) / "meta.json").read_text())
        except (OSError, ValueError):
            meta = None
    model = (meta or {}).get("model") if isinstance(meta, dict) else None
    recorded = model.get("dir") if isinstance(model, dict) else None
    for folder in (given, settings.clip_model_dir(), task.CLIP_DIR, recorded):
        if folder and os.path.exists(folder):
            return Path(folder)
    return None


def need(parts: tuple[int, int], *paths: Path | None) -> tuple[int, int]:
    """(bytes, threads): the address space a call whose measured `parts` are (fixed, per thread)
    maps with the thread budget's threads and the files under `paths` (engine.memory)."""
    from engine import threads
    from engine.io import path_bytes
    from engine.memory import need_bytes, retrieval_thread_bytes

    fixed, per_thread = parts
    n = threads.budget("cpu").total
    mapped = sum(path_bytes(p) for p in paths if p is not None)
    return need_bytes(mapped, fixed, retrieval_thread_bytes(per_thread, n)), n


def address_space_problem(parts: tuple[int, int], what: str, *paths: Path | None) -> str | None:
    """Why the address-space limit is too low for `need(parts, *paths)`; None when it is high
    enough (or there is none)."""
    from engine.memory import AddressSpaceError, check_address_space

    nbytes, n = need(parts, *paths)
    try:
        check_address_space(nbytes, f"{what} with {n} threads")
    except AddressSpaceError as e:
        return str(e)
    return None


def query_run_problem(index_dir: Path, model_dir: Path | None) -> str | None:
    """`address_space_problem` of a query run over `index_dir` with the CLIP it will most likely load."""
    from engine.memory import RETRIEVAL_RUN

    return address_space_problem(RETRIEVAL_RUN, "a query run", index_dir, clip_folder_guess(model_dir, index_dir))


def exhaustion_guarded(prog: str, body: Callable[[], int], debug: bool = False) -> int:
    """`body()`, with running out of memory or threads turned into one `PROG: error:` line
    (exit 2; re-raised when debugging)."""
    from engine.cli import debugging, error
    from engine.memory import exhaustion_line

    try:
        return body()
    except (MemoryError, RuntimeError) as e:
        line = exhaustion_line(e)
        if line is None or debugging(debug):
            raise
        return error(prog, line)
