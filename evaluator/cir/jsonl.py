"""JSONL inputs of the CIR ABI: gallery records, query requests, and a run output to resume.

Bad lines never stop a call: each gets one stderr line naming file and line number.
Bad UTF-8 is decoded with replacement characters (the request is still answered);
malformed JSON, non-objects and rows without a usable id are skipped.
"""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ID_KEYS = ("image_id", "id", "img_id", "image_name", "name")
PATH_KEYS = ("path", "file", "filename", "file_name", "image_path", "img_path", "file_path")
QUERY_KEYS = ("query_id", "id", "pairid")
REFERENCE_KEYS = ("reference_image_id", "reference_img_id", "reference_id", "reference")
MODIFICATION_KEYS = ("modification", "relative_caption", "caption", "text")

Warn = Callable[[str], None]


def stderr_warn(prefix: str) -> Warn:
    return lambda msg: print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


def is_id(v) -> bool:
    return isinstance(v, (str, int)) and not isinstance(v, bool) and str(v) != ""


def _first(obj: dict, keys: tuple[str, ...]):
    return next((obj[k] for k in keys if k in obj), None)


def jsonl_objects(path: Path, warn: Warn) -> Iterator[tuple[int, dict]]:
    """(line number, object) per usable line; blank lines are skipped silently."""
    data = path.read_bytes()
    for no, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            warn(f"{path}:{no}: not valid UTF-8 (byte {e.start}); decoded with replacement characters")
            text = raw.decode("utf-8", errors="replace")
        try:
            obj = json.loads(text)
        except ValueError as e:
            warn(f"{path}:{no}: malformed JSON ({getattr(e, 'msg', e)}); line skipped")
            continue
        if not isinstance(obj, dict):
            warn(f"{path}:{no}: expected a JSON object, got {type(obj).__name__}; line skipped")
            continue
        yield no, obj


@dataclass(frozen=True)
class Record:
    image_id: str | int
    path: str
    line: int


def read_records(path: Path, warn: Warn) -> list[Record]:
    """Gallery records {image_id, path} (synonyms accepted); duplicates keep the first."""
    out: list[Record] = []
    seen: dict[str, int] = {}
    for no, obj in jsonl_objects(path, warn):
        iid, rel = _first(obj, ID_KEYS), _first(obj, PATH_KEYS)
        if "image" in obj and (iid is None) != (rel is None):  # `image` fills whichever is missing
            iid, rel = (obj["image"], rel) if iid is None else (iid, obj["image"])
        if not is_id(iid):
            warn(f"{path}:{no}: no usable image id (one of {', '.join(ID_KEYS)}); line skipped")
            continue
        if not isinstance(rel, str) or not rel or "\x00" in rel:
            warn(f"{path}:{no}: image {iid}: no usable path (one of {', '.join(PATH_KEYS)}); line skipped")
            continue
        if str(iid) in seen:
            warn(f"{path}:{no}: duplicate image id {iid!r} (first at line {seen[str(iid)]}); line skipped")
            continue
        seen[str(iid)] = no
        out.append(Record(iid, rel, no))
    return out


@dataclass(frozen=True)
class Request:
    line: int
    query_id: str | int
    reference: str | None          # str(reference_image_id), None when absent
    modification: str
    shared_concept: str | None


def read_requests(path: Path, warn: Warn) -> list[Request]:
    """Query requests in file order; one stderr line per problem, naming the line."""
    out: list[Request] = []
    seen: dict[str, int] = {}
    for no, obj in jsonl_objects(path, warn):
        where = f"{path}:{no}"
        qid = _first(obj, QUERY_KEYS)
        if not is_id(qid):
            warn(f"{where}: no usable query_id; line skipped")
            continue
        if str(qid) in seen:
            warn(f"{where}: duplicate query_id {qid!r} (first at line {seen[str(qid)]}); line skipped")
            continue
        seen[str(qid)] = no
        ref = _first(obj, REFERENCE_KEYS)
        if not is_id(ref):
            warn(f"{where}: query {qid!r}: no usable reference_image_id; answering from the text alone")
            ref = None
        mod = _first(obj, MODIFICATION_KEYS)
        if mod is None:
            warn(f"{where}: query {qid!r}: no modification; using an empty one")
            mod = ""
        elif not isinstance(mod, str):
            warn(f"{where}: query {qid!r}: modification is {type(mod).__name__}, not a string; using its JSON text")
            mod = json.dumps(mod)
        if not mod.strip():
            warn(f"{where}: query {qid!r}: empty modification")
        concept = obj.get("shared_concept")
        if concept is not None and not isinstance(concept, str):
            warn(f"{where}: query {qid!r}: shared_concept is not a string; ignored")
            concept = None
        out.append(Request(no, qid, None if ref is None else str(ref), mod, concept or None))
    return out


def _valid_row(obj) -> bool:
    if not isinstance(obj, dict) or not is_id(obj.get("query_id")) or not isinstance(obj.get("results"), list):
        return False
    for r in obj["results"]:
        s = r.get("score") if isinstance(r, dict) else None
        if not is_id(r.get("image_id") if isinstance(r, dict) else None) or isinstance(s, bool) \
                or not isinstance(s, (int, float)) or not math.isfinite(s):
            return False
    return True


def finished_rows(path: Path, warn: Warn) -> tuple[list[str], int]:
    """(query ids, byte length) of the valid prefix of an earlier run's output.

    A row counts once it is complete (newline-terminated) and valid; the first torn or
    invalid line ends the prefix (the caller truncates the file there and redoes the rest).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    done: list[str] = []
    seen: set[str] = set()
    end = 0
    for no, raw in enumerate(data.split(b"\n")[:-1], start=1):  # the last piece has no newline
        try:
            obj = json.loads(raw.decode("utf-8"))
        except ValueError:
            obj = None
        if not raw.strip():
            end += len(raw) + 1
            continue
        if not _valid_row(obj) or str(obj["query_id"]) in seen:
            warn(f"{path}:{no}: not a valid result row; output resumes from here")
            return done, end
        seen.add(str(obj["query_id"]))
        done.append(str(obj["query_id"]))
        end += len(raw) + 1
    if end < len(data):
        warn(f"{path}: dropping a torn last line ({len(data) - end} bytes)")
    return done, end
