"""The retrieval gallery index on disk: chunked while building, committed by one rename.

    INDEX_DIR/meta.json                     the commit record (written last, by rename)
    INDEX_DIR/embeddings-<build>.f16.npy    [N, D] float16, L2-normalised rows
    INDEX_DIR/ids-<build>.json              [N] image ids (as given: str or int), row order
    INDEX_DIR/<extra>-<build>.<ext>         optional build-time extras named in meta.json `files`
                                            (pic2word mapping, gallery-derived text bank, DBA rows)
    INDEX_DIR/kernels/topk.json, topk-sm<arch>.cubin   the top-k kernel compiled at build time
                                            (CUDA + CuPy builds; kernels.topk.store_compiled,
                                            recorded in meta.json `kernels`)
    INDEX_DIR/.build/progress.json          resume key of an unfinished build
    INDEX_DIR/.build/chunk-000012.npz       finished chunks (each written to a temp name, renamed)

Everything temporary lives inside INDEX_DIR (its parent may be read-only). meta.json
names the data files of its build, so a rebuild writes new files beside the old ones
and a reader sees either the old index or the new one, never a mix; the old files are
deleted only after the new meta.json is in place.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.io import write_atomic

FORMAT = "cir-index/1"
BUILD_DIR = ".build"
EXTRA_FILES = ("pic2word", "text_bank", "dba")   # optional data files (engine.retrieval.extras)
KERNEL_DIR = "kernels"   # compiled kernels the query run loads instead of compiling (kernels.topk)


class IndexLoadError(RuntimeError):
    """The index directory holds no usable index; the message says what is wrong."""


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


@dataclass
class Index:
    dir: Path
    meta: dict
    ids: list                 # [N] image ids as the records gave them
    emb: np.ndarray           # [N, D] float16, memory-mapped

    def extra(self, name: str) -> Path | None:
        """Path of an optional build-time data file (EXTRA_FILES), or None when this build has none."""
        f = self.meta.get("files", {}).get(name)
        return self.dir / f if f else None

    def rows(self) -> dict[str, int]:
        """str(image_id) -> row (ids compare as strings: CIRCO ids are ints, CIRR ids strings)."""
        return {str(i): r for r, i in enumerate(self.ids)}


def _plain_name(v) -> bool:
    """A file name inside the index dir (no folder, no parent): what meta.json may name."""
    return isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v and "\x00" not in v


def _read_json_file(path: Path):
    from engine.retrieval.jsonl import parse_line, read_input

    return parse_line(read_input(path).decode("utf-8"))


def load_index(index_dir: str | os.PathLike) -> Index:
    """The committed index of `index_dir`; IndexLoadError names what is missing or inconsistent."""
    d = Path(index_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        extra = " (an unfinished build is there: run scripts/build.sh again to finish it)" \
            if (d / BUILD_DIR).is_dir() else ""
        raise IndexLoadError(f"no finished index in {d}: meta.json is missing{extra}")
    try:
        meta = _read_json_file(meta_path)
    except (OSError, ValueError) as e:
        raise IndexLoadError(f"{meta_path}: unreadable ({e})") from e
    if not isinstance(meta, dict):
        raise IndexLoadError(f"{meta_path}: a JSON {type(meta).__name__}, not an index record (rebuild the index)")
    if meta.get("format") != FORMAT:
        raise IndexLoadError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    files, n, dim = meta.get("files"), meta.get("count"), meta.get("dim")
    if not isinstance(files, dict) or not all(_plain_name(files.get(k)) for k in ("embeddings", "ids")) \
            or not all(_plain_name(v) for v in files.values()) or not isinstance(n, int) or not isinstance(dim, int):
        raise IndexLoadError(f"{meta_path}: malformed: needs files.embeddings / files.ids (plain file names), "
                             "count and dim")
    try:
        for k in ("embeddings", "ids"):
            if not (d / files[k]).is_file():   # never open a FIFO or a device
                raise OSError(f"{d / files[k]} is missing or not a regular file")
        emb = np.load(d / files["embeddings"], mmap_mode="r", allow_pickle=False)
        ids = _read_json_file(d / files["ids"])
    except (OSError, ValueError, EOFError) as e:
        raise IndexLoadError(f"{d}: index files named by meta.json are unreadable ({e})") from e
    from engine.retrieval.jsonl import is_id

    if not isinstance(emb, np.ndarray) or not isinstance(ids, list) or not all(is_id(i) for i in ids):
        raise IndexLoadError(f"{d}: the embeddings are not an array or the ids not a list of ids")
    if emb.shape != (n, dim) or emb.dtype != np.float16 or len(ids) != n:
        raise IndexLoadError(f"{d}: embeddings {emb.shape} {emb.dtype} / {len(ids)} ids do not match "
                             f"meta.json count {n} dim {dim}")
    return Index(d, meta, ids, emb)


def read_meta(index_dir: Path) -> dict | None:
    """meta.json of a committed index, or None (missing, unreadable or not an object)."""
    try:
        meta = _read_json_file(index_dir / "meta.json")
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


class ChunkStore:
    """Finished chunks of one build key under INDEX_DIR/.build/."""

    def __init__(self, index_dir: Path, key: dict):
        self.dir = index_dir / BUILD_DIR
        self.key = key

    def path(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.npz"

    def open(self) -> set[int]:
        """Chunks already done for this key; chunks of another key are discarded (said on stderr)."""
        prog = self.dir / "progress.json"
        old = None
        if prog.is_file():
            try:
                old = _read_json_file(prog)
                old = old.get("key") if isinstance(old, dict) else None
                old = old if isinstance(old, dict) else None
            except (OSError, ValueError) as e:
                print(f"[cir_build] {prog} unreadable ({e}); starting the build over", file=sys.stderr)
        if old is not None and old != self.key:
            changed = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k))
            print(f"[cir_build] discarding the unfinished build in {self.dir}: {', '.join(changed)} changed",
                  file=sys.stderr)
        if old != self.key:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            write_atomic(prog, json.dumps({"key": self.key}, indent=1).encode())
            return set()
        return {int(p.stem.split("-")[1]) for p in self.dir.glob("chunk-*.npz")}

    def save(self, chunk: int, rows: np.ndarray, emb: np.ndarray, failed: list[dict]) -> None:
        """rows: [m] int64 record numbers; emb: [m, D] float16; failed: unreadable records of the chunk."""
        buf = io.BytesIO()
        np.savez(buf, rows=rows.astype(np.int64), emb=emb.astype(np.float16),
                 failed=np.frombuffer(json.dumps(failed).encode(), np.uint8))
        write_atomic(self.path(chunk), buf.getvalue())

    def load(self, chunks: range) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """Concatenated (rows [N], emb [N, D], failed) of `chunks`, in chunk order."""
        rows, embs, failed = [], [], []
        for c in chunks:
            try:
                with np.load(self.path(c), allow_pickle=False) as z:
                    rows.append(z["rows"])
                    if len(z["rows"]):
                        embs.append(z["emb"])
                    failed += json.loads(z["failed"].tobytes().decode())
            except (OSError, ValueError, KeyError, EOFError) as e:
                raise IndexLoadError(f"{self.path(c)}: unreadable chunk ({type(e).__name__}: {e}); "
                                     "pass --force to rebuild") from e
        dim = self.key.get("embed_dim", 0)
        emb = np.concatenate(embs) if embs else np.zeros((0, dim), np.float16)
        return np.concatenate(rows) if rows else np.zeros(0, np.int64), emb, failed

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def commit(index_dir: Path, emb: np.ndarray, ids: list, meta: dict,
           extras: dict[str, tuple[str, bytes]] | None = None) -> dict:
    """Write the data files under fresh names, then meta.json (the commit), then drop old files.
    `extras`: {name in EXTRA_FILES: (suffix, bytes)}, written as NAME-<build>SUFFIX."""
    import hashlib

    build = uuid.uuid4().hex[:12]
    files = {"embeddings": f"embeddings-{build}.f16.npy", "ids": f"ids-{build}.json"}
    blobs = {"embeddings": _npy_bytes(np.ascontiguousarray(emb, np.float16)), "ids": json.dumps(ids).encode()}
    for name, (suffix, data) in (extras or {}).items():
        if name not in EXTRA_FILES:
            raise ValueError(f"unknown index extra {name!r} (one of {EXTRA_FILES})")
        files[name], blobs[name] = f"{name}-{build}{suffix}", data
    for name, data in blobs.items():
        write_atomic(index_dir / files[name], data)
    meta = {"format": FORMAT, "build_id": build, "files": files, "count": int(emb.shape[0]),
            "dim": int(emb.shape[1]),
            "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}, **meta}
    write_atomic(index_dir / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    keep = set(files.values())
    old = [index_dir.glob(f"{name}-*") for name in ("embeddings", "ids", *EXTRA_FILES)]
    for p in (q for g in old for q in g):
        if p.name not in keep and p.is_file():
            p.unlink(missing_ok=True)
    return meta
