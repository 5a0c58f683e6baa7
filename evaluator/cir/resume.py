"""Whether an earlier output of scripts/run.sh may be resumed, and opening it for the rows to come.

An output resumes only if the same requests, method, index and CLIP wrote it: `open_run` opens
it for a run; its identity (`run_identity`) is recorded beside it (FILE.run.json; in a read-only folder, under the index
dir's .runs/) before any row is written, and compared (`resume_mismatch`) before it is reused.
Which of its rows stay is the output rules' work (evaluator.cir.jsonl.resume_rows).

One run writes an output at a time: `HeldOutput` holds OUTPUT itself (its real path, through a
symlink) under an exclusive flock from before its rows are read, truncated or appended until
the run ends; a second run on it, whatever its flags, stops with OutputBusy and changes
neither OUTPUT nor its record. The lock dies with its process (a killed run never blocks the
next), and nothing is made beside OUTPUT, so a read-only folder holding a writable OUTPUT is
held as well. The contest holds an OUTPUT it writes in place with the same lock
(engine.io.open_locked).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from evaluator.cir.jsonl import Resumed, resume_rows
from evaluator.cir.task import TOP_K


class ResumeError(Exception):
    """The output cannot be resumed or written: one line naming it (and --fresh where that helps)."""


class OutputBusy(ResumeError):
    """Another run holds OUTPUT's lock: it is writing OUTPUT now."""


class HeldOutput:
    """`with HeldOutput(output, say):` OUTPUT reserved for this run (the module's rule): its real
    path opened (created when absent) and held under an exclusive flock until the `with` ends.
    OutputBusy when another run holds it, ResumeError when it cannot be opened for writing. On a
    filesystem without flock the run goes on unguarded, said through `say`. A non-regular OUTPUT
    (a FIFO, /dev/stdout) is not held: it keeps no rows to protect. An OUTPUT this run created
    and never wrote (it stopped before its first row) is removed on leaving."""

    def __init__(self, output: Path, say):
        self.path, self.real = output, Path(os.path.realpath(output))
        self.fd: int | None = None
        self.created = self.opened = False
        try:
            if not stat.S_ISREG(os.stat(self.real).st_mode):
                return
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ResumeError(f"cannot write {output}: {e.strerror or e}") from e
        try:
            self.fd, locked = self._open()
        except BlockingIOError:
            shown = output if self.real == Path(os.path.abspath(output)) else f"{output} (really {self.real})"
            raise OutputBusy(f"another run is writing OUTPUT now (it holds the lock on {shown}); this run "
                             "stops and leaves OUTPUT and its record as they are") from None
        except OSError as e:
            raise ResumeError(f"cannot write {output}: {e.strerror or e}") from e
        if not locked:
            say(f"warning: the filesystem of {self.real} has no file locks (flock): a second run on this "
                "output is not refused while this one writes it")

    def _open(self) -> tuple[int, bool]:
        """(fd, locked) of the real path, created here when absent (self.created)."""
        from engine.io import open_locked

        while True:
            try:
                fd, locked = open_locked(self.real, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                self.created = True
                return fd, locked
            except FileExistsError:
                pass
            try:
                return open_locked(self.real, os.O_RDWR)
            except FileNotFoundError:
                continue                     # removed in between: create it

    def __enter__(self) -> HeldOutput:
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        try:   # made by this run and never written: leave no empty output behind (still under the lock)
            if self.created and not self.opened and os.fstat(self.fd).st_size == 0:
                from engine.io import same_inode

                if same_inode(self.fd, self.real):
                    os.unlink(self.real)
        except OSError:
            pass
        finally:
            os.close(self.fd)            # releases the lock
            self.fd = None


def requests_digest(requests) -> str:
    """sha256 of the requests as parsed (id, reference, modification, shared concept; file order):
    what a row answers. Line numbers, blank lines and JSON spacing do not count."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.query_id, r.reference, r.modification, r.shared_concept]).encode() + b"\n")
    return h.hexdigest()


def run_identity(method, index, info: dict, requests) -> dict:
    """What decides an output's rows: the requests, the method, the index, the CLIP."""
    return {"method": method.to_dict(), "method_label": method.label, "index_build_id": index.meta.get("build_id"),
            "model_digest": info.get("digest"), "requests_sha256": requests_digest(requests),
            "requests": len(requests)}


def _identity_paths(output: Path, index_dir: Path) -> list[Path]:
    """Where an output's identity is kept: beside it, else (a read-only folder) in the index dir."""
    key = hashlib.sha256(str(output.resolve()).encode()).hexdigest()[:16]
    return [output.with_name(output.name + ".run.json"), index_dir / ".runs" / f"{key}.json"]


def write_identity(output: Path, index_dir: Path, ident: dict, say) -> None:
    """Record `ident` for `output` (the first place that takes it); when none does, a warning through `say`."""
    from engine.io import write_atomic

    data = (json.dumps(ident, indent=1, sort_keys=True) + "\n").encode()
    for i, path in enumerate(_identity_paths(output, index_dir)):
        try:
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, data)
            return
        except OSError as e:
            if i:
                say(f"warning: cannot record which method writes {output} ({e.strerror or e}): "
                    "a later call cannot check it before resuming")


def resume_mismatch(output: Path, index_dir: Path, ident: dict) -> str | None:
    """Why `output` must not be resumed with `ident` (None: it may)."""
    for path in _identity_paths(output, index_dir):
        if path.is_file():
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                return f"its record {path} is unreadable ({e})"
            for key, what in (("method", "method"), ("index_build_id", "index"), ("model_digest", "CLIP")):
                if old.get(key) != ident[key]:
                    shown = "method_label" if key == "method" else key
                    return f"it was written with another {what} ({old.get(shown)!r}, now {ident[shown]!r})"
            if old.get("requests_sha256") != ident["requests_sha256"]:   # same ids may carry new requests
                was = old.get("requests_sha256")
                return (f"it answers other requests ({old.get('requests', '?')} requests, digest "
                        f"{str(was)[:12] if was else 'not recorded'}; now {ident['requests']}, "
                        f"{ident['requests_sha256'][:12]})")
            return None
    return "no record of the requests, method and index that wrote it"


def kept_rows(output: Path, index_dir: Path, ident: dict, requests, gallery_ids, warn) -> Resumed | None:
    """The rows of `output` a call with `ident` keeps (resume_rows), or None when there is no
    output to resume (absent or empty). ResumeError when another run wrote it, or it is unreadable."""
    if not (output.exists() and output.stat().st_size):
        return None
    why = resume_mismatch(output, index_dir, ident)
    if why:
        raise ResumeError(f"{output} cannot be resumed: {why}; pass --fresh to start it afresh")
    try:
        return resume_rows(output, requests, {str(i): i for i in gallery_ids}, TOP_K, warn)
    except (OSError, ValueError) as e:
        raise ResumeError(f"cannot read {output} to resume it: {e}; pass --fresh to overwrite it") from e


def open_run(held: HeldOutput, cfg, searcher, method, requests, warn, say) -> tuple[BinaryIO, Resumed | None]:
    """The held output of a run of `method` over `searcher`'s index (engine.retrieval.search.Searcher)
    opened for its rows, and the rows it keeps: those an earlier call with the same identity wrote
    (`kept_rows`, when `cfg.resume`), else none. The run's identity is recorded before any row is
    written, so a killed call keeps it too. ResumeError (one line) when it cannot be resumed or written."""
    ident = run_identity(method, searcher.index, searcher.info, requests)
    kept = kept_rows(cfg.output, cfg.index_dir, ident, requests, searcher.index.ids, warn) if cfg.resume else None
    out = open_output(held, kept)
    write_identity(cfg.output, cfg.index_dir, ident, say)
    return out, kept


def open_output(held: HeldOutput, kept: Resumed | None) -> BinaryIO:
    """The held output opened for writing (through the held file, so its lock stays on what is
    written): in place when rows are kept, else emptied. ResumeError when it cannot be."""
    output = held.path
    try:
        if held.fd is None:          # not held (not a regular file): opened by name, as ever
            return open(output, "r+b" if kept is not None else "wb")
        out = os.fdopen(os.dup(held.fd), "r+b")
        held.opened = True
        if kept is None:
            try:
                out.seek(0)
                out.truncate(0)
            except OSError:
                out.close()
                raise
        return out
    except OSError as e:
        raise ResumeError(f"cannot write {output}: {e.strerror or e}") from e


def cut_to_kept(out: BinaryIO, kept: Resumed | None) -> set[str]:
    """Leave `out` holding the kept rows only, positioned after them; returns their query ids (str)."""
    if kept is None:
        return set()
    body = b"".join(kept.rows)
    if not kept.prefix:          # rows were dropped before others: rewrite the kept ones in place
        out.seek(0)
        out.write(body)
    out.truncate(len(body))      # drop a torn last line and every row that is redone
    out.seek(len(body))
    out.flush()
    os.fsync(out.fileno())
    return set(kept.done)   # one row per query: as many ids as rows
