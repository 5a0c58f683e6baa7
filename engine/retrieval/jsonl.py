"""JSONL inputs of retrieval: gallery records and query requests.

Bad lines never stop a call: each gets one stderr line naming file and line number.
Bad UTF-8 is decoded with replacement characters (the request is still answered);
malformed JSON, lines nested deeper than MAX_DEPTH, non-objects and rows without a
usable id are skipped. A UTF-8 byte-order mark at the start is ignored. Files are read
as every input is: regular files only (a FIFO is an error, never a hang), at most MAX_BYTES.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES = 1 << 30        # a gallery of millions of records fits; anything larger is not an input list
MAX_DEPTH = 64             # brackets nested deeper than this make a line invalid (json recurses per level)
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')   # a string (skipped whole) or one bracket

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


def read_input(path: Path) -> bytes:
    """The bytes of an input list (records, requests, an output to resume): a regular file of at
    most MAX_BYTES, else OSError / ValueError saying why."""
    from engine.io import read_regular

    return read_regular(path, MAX_BYTES, "the input-list limit")


def nesting(text: str, limit: int = MAX_DEPTH) -> int:
    """Deepest bracket nesting of a JSON text, brackets inside strings ignored (stops past `limit`)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def parse_line(text: str):
    """json.loads of one line, refusing one nested deeper than MAX_DEPTH (ValueError, never a RecursionError)."""
    if ("[" in text or "{" in text) and text.count("[") + text.count("{") > MAX_DEPTH and nesting(text) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def jsonl_objects(path: Path, warn: Warn) -> Iterator[tuple[int, dict]]:
    """(line number, object) per usable line; blank lines are skipped silently."""
    data = read_input(path)
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not part of the first line
        data = data[3:]
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
            obj = parse_line(text)
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


def record_reader(corpus: Path, paths, confine: bool = False):
    """read(i) -> bytes of record i's image: a regular file of at most ENGINE_MAX_FILE_BYTES.

    A path resolves as the records give it, as PIL's Image.open would open it: relative to
    `corpus`, absolute as is, symlinks followed (a staged corpus is often a farm of links
    into a store). `confine` (for untrusted records): only relative paths that stay inside
    `corpus`, also through symlinks; anything else is a ValueError naming the path."""
    from engine import settings
    from engine.io import read_regular, resolve_inside

    cap, real = settings.max_file_bytes(), os.path.realpath(corpus)

    def read(i: int) -> bytes:
        rel = paths[i]
        if confine:
            return read_regular(resolve_inside(corpus, rel, "the corpus folder", real), cap)
        # realpath first: read_regular refuses a final symlink, the reference follows it
        return read_regular(os.path.realpath(os.path.join(corpus, rel)), cap)

    return read


@dataclass(frozen=True)
class Request:
    line: int
    query_id: str | int
    reference: str | None          # str(reference_image_id), None when absent
    modification: str
    shared_concept: str | None


def parse_request(obj: dict, where: str, warn: Warn, line: int = 0, query_id=None) -> Request | None:
    """One request object (the requests JSONL schema, synonyms accepted) as a Request; `query_id`
    stands in when the object has none. None, said, when no usable query id is left."""
    qid = _first(obj, QUERY_KEYS)
    if qid is None:
        qid = query_id
    if not is_id(qid):
        warn(f"{where}: no usable query_id; line skipped")
        return None
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
    return Request(line, qid, None if ref is None else str(ref), mod, concept or None)


def read_requests(path: Path, warn: Warn) -> list[Request]:
    """Query requests in file order; one stderr line per problem, naming the line."""
    out: list[Request] = []
    seen: dict[str, int] = {}
    for no, obj in jsonl_objects(path, warn):
        where = f"{path}:{no}"
        qid = _first(obj, QUERY_KEYS)
        if is_id(qid) and str(qid) in seen:
            warn(f"{where}: duplicate query_id {qid!r} (first at line {seen[str(qid)]}); line skipped")
            continue
        r = parse_request(obj, where, warn, no)
        if r is not None:
            seen[str(r.query_id)] = no
            out.append(r)
    return out
