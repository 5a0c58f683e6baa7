"""Whether an earlier output of scripts/run.sh may be resumed, and opening it for the rows to come.

An output resumes only if the same requests, method, index and CLIP wrote it: its identity
(`run_identity`) is recorded beside it (FILE.run.json; in a read-only folder, under the index
dir's .runs/) before any row is written, and compared (`resume_mismatch`) before it is reused.
Which of its rows stay is the output rules' work (evaluator.cir.jsonl.resume_rows).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO

from evaluator.cir.jsonl import Resumed, resume_rows
from evaluator.cir.task import TOP_K


class ResumeError(Exception):
    """The output cannot be resumed or written: one line naming it (and --fresh where that helps)."""


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


def open_output(output: Path, kept: Resumed | None) -> BinaryIO:
    """`output` opened for writing: in place when rows are kept, else afresh. ResumeError when it cannot be."""
    try:
        return open(output, "r+b" if kept is not None else "wb")
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
