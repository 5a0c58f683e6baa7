"""The CIR ABI's output rules: what a result row may hold, and which rows of an earlier
run's output a resumed call keeps. (Its inputs are read by engine.retrieval.jsonl.)"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine.retrieval.jsonl import Request, Warn, is_id, parse_line, read_input


def row_problem(obj, request: Request | None, gallery: dict[str, object], k: int) -> str | None:
    """Why `obj` is not a valid output row for `request` (None when it is): the output rules of
    the ABI. `gallery`: str(image_id) -> the id as the index holds it."""
    if not isinstance(obj, dict) or not is_id(obj.get("query_id")):
        return "not a result row"
    if request is None:
        return f"query {obj['query_id']!r} is not in the requests"
    if obj["query_id"] != request.query_id or type(obj["query_id"]) is not type(request.query_id):
        return f"query_id {obj['query_id']!r} is not the request's {request.query_id!r}"
    results = obj.get("results")
    if not isinstance(results, list) or len(results) > k:
        return f"results is not a list of at most {k}"
    seen: set[str] = set()
    last = math.inf
    for r in results:
        iid = r.get("image_id") if isinstance(r, dict) else None
        s = r.get("score") if isinstance(r, dict) else None
        if not is_id(iid) or str(iid) not in gallery or gallery[str(iid)] != iid:
            return f"result {iid!r} is not a gallery image id"
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            return f"result {iid!r} has no finite score"
        if str(iid) in seen:
            return f"image {iid!r} appears twice"
        if str(iid) == request.reference:
            return f"the reference image {iid!r} is among the results"
        if s > last:
            return "scores rise"
        seen.add(str(iid))
        last = s
    return None


@dataclass
class Resumed:
    rows: list[bytes]        # kept rows, each newline-terminated, in file order
    done: list[str]          # their query ids (str)
    prefix: bool             # the kept rows are exactly the start of the file: truncating suffices


def resume_rows(path: Path, requests: list[Request], gallery: dict[str, object], k: int,
                warn: Warn) -> Resumed:
    """The rows of an earlier run's output that may stay: complete (newline-terminated), valid under
    the output rules (`row_problem`), for a query in `requests`, the first for that query. Every
    dropped row is said on stderr; the caller rewrites the file when they are not a prefix."""
    try:
        data = read_input(path)
    except FileNotFoundError:
        return Resumed([], [], True)
    by_id = {str(r.query_id): r for r in requests}
    keep: list[bytes] = []
    done: list[str] = []
    pieces = data.split(b"\n")
    for no, raw in enumerate(pieces[:-1], start=1):       # the last piece has no newline
        if not raw.strip():
            continue
        try:
            obj = parse_line(raw.decode("utf-8"))
        except ValueError:
            obj = None
        qid = str(obj.get("query_id")) if isinstance(obj, dict) else None
        why = row_problem(obj, by_id.get(qid) if qid is not None else None, gallery, k)
        if why is None and qid in done:
            why = f"a second row for query {obj['query_id']!r}"
        if why is not None:
            warn(f"{path}:{no}: dropping an earlier row ({why}); it is answered again")
            continue
        keep.append(raw + b"\n")
        done.append(qid)
    if pieces[-1]:
        warn(f"{path}: dropping a torn last line ({len(pieces[-1])} bytes)")
    prefix = data.startswith(b"".join(keep))
    return Resumed(keep, done, prefix)
