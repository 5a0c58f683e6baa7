"""The retrieval gallery index on disk: chunked while building, verified when opened, committed by one rename.

    INDEX_DIR/meta.json                     the commit record: the one pointer a reader resolves
    INDEX_DIR/embeddings-<build>.f16.npy    [N, D] float16, L2-normalised rows
    INDEX_DIR/ids-<build>.json              [N] image ids (as given: str or int), row order
    INDEX_DIR/<extra>-<build>.<ext>         optional build-time extras named in meta.json `files`
                                            (pic2word mapping, gallery-derived text bank, DBA rows)
    INDEX_DIR/kernels/topk.json, topk-sm<arch>.cubin   the top-k kernel compiled at build time
                                            (CUDA + CuPy builds; kernels.topk.store_compiled,
                                            recorded in meta.json `kernels`)
    INDEX_DIR/.lock                         flock'ed by the one build writing this index (its pid inside)
    INDEX_DIR/.build/progress.json          resume key of an unfinished build
    INDEX_DIR/.build/chunk-000012.npz       finished chunks (each written to a temp name, renamed) ...
    INDEX_DIR/.build/chunk-000012.json      ... and each one's record: sha256 of its bytes, its decoder

Commit: the data files of a build get new names (never rewritten in place); then meta.json,
naming them with their sha256, replaces the old one by one os.replace: that rename is the
switch, and the previous build's files are deleted after it. A reader reads meta.json once
and then the files it names; a file that vanished meanwhile (a commit switched and deleted
it) sends the reader back to the new meta.json (at most READ_TRIES times), so a reader sees
the old index or the new one, never a mix and never a gap. Everything temporary lives
inside INDEX_DIR (its parent may be read-only); temp files are created with O_EXCL under a
random name.

Integrity: opening an index reads each file once, hashes the bytes it read against
meta.json's sha256 and parses those same bytes (the extras' bytes are kept: their users
read `Index.extra_bytes`, never the file again); the embedding rows must be finite with
|norm - 1| < NORM_TOL and the ids distinct (as strings). Anything else is one
IndexLoadError naming the file. Chunks of an unfinished build are hashed the same way on
resume and at the end; a bad one is rebuilt.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.io import LockHeld, take_lock, write_atomic
from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options import extra_files

FORMAT = "cir-index/1"
BUILD_DIR = ".build"
LOCK_FILE = ".lock"
EXTRA_FILES = extra_files()   # optional data files, the options' (engine.retrieval.options; index_extras writes them)
KERNEL_DIR = "kernels"   # compiled kernels the query run loads instead of compiling (kernels.topk)
# A unit FP32 row rounded to FP16 moves its norm by at most 2**-11 (~4.9e-4, round to nearest):
# 1e-2 is 20 times that, and far below what a damaged row shows (0 for a zeroed row, NaN, 1e4).
NORM_TOL = 1e-2
READ_TRIES = 8           # a reader racing commits re-resolves meta.json at most this often
MAX_FILE = 1 << 40       # index files are read whole; this only keeps read_regular's bound sane
REBUILD = "rebuild it with scripts/build.sh --force"


class IndexLoadError(RuntimeError):
    """The index directory holds no usable index; the message says what is wrong."""


class IndexBusyError(IndexLoadError):
    """Another build holds the index directory's lock."""


def _npy_parts(arr: np.ndarray) -> list:
    """An .npy file of the C-contiguous `arr` as [header bytes, a view of the array's own bytes]:
    written and hashed in that order they are np.save's bytes, without a second copy of the array."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(arr))
    return [buf.getvalue(), memoryview(arr).cast("B")]


def _sha256_parts(data) -> str:
    """sha256 of bytes, or of a list of parts in order (the bytes write_atomic writes)."""
    h = hashlib.sha256()
    for part in (data if isinstance(data, list) else [data]):
        h.update(part)
    return h.hexdigest()


def npy_from_bytes(data: bytes) -> np.ndarray:
    """The array of an .npy file's bytes, without copying them (read-only); ValueError when malformed."""
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = header(f)
    if dtype.hasobject or fortran:
        raise ValueError("not a plain C-order array")
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - f.tell() != count * dtype.itemsize:
        raise ValueError(f"{len(data) - f.tell()} data bytes for shape {shape} {dtype}")
    return np.frombuffer(data, dtype, count=count, offset=f.tell()).reshape(shape)


def bad_row(emb: np.ndarray, block: int = RETRIEVAL.norm_check_block) -> int | None:
    """First row of emb [N, D] that is not finite with |norm - 1| < NORM_TOL, or None.
    FP32 blocks of 1024 rows stay in cache (measured faster than 16384 at [125000, 768]);
    NaN and inf fail the comparison too."""
    for lo in range(0, len(emb), block):
        x = np.asarray(emb[lo:lo + block], np.float32)
        norms = np.sqrt(np.einsum("ij,ij->i", x, x))          # [b]
        bad = np.flatnonzero(~(np.abs(norms - 1.0) < NORM_TOL))
        if len(bad):
            return lo + int(bad[0])
    return None


def duplicate_id(ids: list):
    """An id that occurs twice (compared as strings, as Index.rows does), or None."""
    seen: set[str] = set()
    for i in ids:
        if str(i) in seen:
            return i
        seen.add(str(i))
    return None


@dataclass
class Index:
    dir: Path
    meta: dict
    ids: list                 # [N] image ids as the records gave them
    emb: np.ndarray           # [N, D] float16, read-only, verified against meta.json
    # the extras' bytes as read and verified when the index was opened: a commit that switches
    # the index later (and deletes these files) changes nothing for this reader
    extras: dict[str, bytes] = field(default_factory=dict, repr=False)
    # str(image_id) -> row (ids compare as strings: CIRCO ids are ints, CIRR ids strings)
    row_of: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.row_of = {str(i): r for r, i in enumerate(self.ids)}

    def extra(self, name: str) -> Path | None:
        """Path of an optional build-time data file (EXTRA_FILES), or None when this build has none."""
        f = self.meta.get("files", {}).get(name)
        return self.dir / f if f else None

    def extra_bytes(self, name: str) -> bytes | None:
        """The bytes of an extra as they were read and verified at open (never read again), or None."""
        return self.extras.get(name)

    def rows(self) -> dict[str, int]:
        """str(image_id) -> row (a copy of `row_of`)."""
        return dict(self.row_of)


def _plain_name(v) -> bool:
    """A file name inside the index dir (no folder, no parent): what meta.json may name."""
    return isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v and "\x00" not in v


def _read_json_file(path: Path):
    from engine.io import read_regular
    from engine.retrieval.jsonl import MAX_BYTES, parse_line

    return parse_line(read_regular(path, MAX_BYTES, "the input-list limit").decode("utf-8"))


def _read_meta_checked(d: Path) -> dict:
    """meta.json of `d`, its shape checked (files, count, dim); IndexLoadError otherwise."""
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
    return meta


def _read_files(d: Path, meta: dict) -> dict[str, bytes]:
    """{name: bytes} of every file meta.json names, each read once. FileNotFoundError passes
    through (the caller re-resolves meta.json); IndexLoadError for anything else."""
    from engine.io import read_regular

    out = {}
    for name, fname in meta["files"].items():
        try:
            out[name] = read_regular(d / fname, MAX_FILE, follow=True)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as e:
            raise IndexLoadError(f"{d}: index files named by meta.json are unreadable ({e}); {REBUILD}") from e
    return out


def _digests(blobs: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}


def _check_digests(d: Path, meta: dict, got: dict[str, str]) -> None:
    """Each file's sha256 (of its bytes as read, once) against meta.json's; IndexLoadError naming
    the first that differs."""
    digests = meta.get("sha256")
    if not isinstance(digests, dict):
        raise IndexLoadError(f"{d / 'meta.json'}: records no sha256 of its files; {REBUILD}")
    for name, digest in got.items():
        if digest != digests.get(name):
            raise IndexLoadError(f"{d / meta['files'][name]}: sha256 differs from meta.json's (the file is damaged "
                                 f"or from another build); {REBUILD}")


def load_index(index_dir: str | os.PathLike, verify: bool = True) -> Index:
    """The committed index of `index_dir`, every file verified (verify=False skips the digests and
    row checks: for measuring their cost); IndexLoadError names what is missing or inconsistent."""
    d = Path(index_dir)
    for attempt in range(READ_TRIES):
        meta = _read_meta_checked(d)
        try:
            blobs = _read_files(d, meta)
            break
        except FileNotFoundError as e:
            again = _read_meta_checked(d)
            if again.get("build_id") == meta.get("build_id") or attempt == READ_TRIES - 1:
                raise IndexLoadError(f"{d}: index files named by meta.json are unreadable ({e}); {REBUILD}") from e
    return _parse(d, meta, blobs, verify)


def _parse(d: Path, meta: dict, blobs: dict[str, bytes], verify: bool) -> Index:
    from engine.retrieval.jsonl import is_id, parse_line

    files, n, dim = meta["files"], meta["count"], meta["dim"]
    try:
        emb = npy_from_bytes(blobs["embeddings"])
        ids = parse_line(blobs["ids"].decode("utf-8"))
    except (ValueError, EOFError) as e:
        raise IndexLoadError(f"{d}: index files named by meta.json are unreadable ({e}); {REBUILD}") from e
    if not isinstance(ids, list) or not all(is_id(i) for i in ids):
        raise IndexLoadError(f"{d / files['ids']}: not a list of ids; {REBUILD}")
    if emb.shape != (n, dim) or emb.dtype != np.float16 or len(ids) != n:
        raise IndexLoadError(f"{d}: embeddings {emb.shape} {emb.dtype} / {len(ids)} ids do not match "
                             f"meta.json count {n} dim {dim}")
    if verify:
        _check_digests(d, meta, _digests(blobs))
        row, dup = bad_row(emb), duplicate_id(ids)
        if row is not None:
            norm = float(np.linalg.norm(np.asarray(emb[row], np.float32)))
            raise IndexLoadError(f"{d / files['embeddings']}: row {row} has norm {norm:.4g}, not a finite unit "
                                 f"row (|norm - 1| < {NORM_TOL}); {REBUILD}")
        if dup is not None:
            raise IndexLoadError(f"{d / files['ids']}: image id {dup!r} occurs twice; {REBUILD}")
    return Index(d, meta, ids, emb, {k: v for k, v in blobs.items() if k in EXTRA_FILES})


def read_meta(index_dir: Path) -> dict | None:
    """meta.json of a committed index, or None (missing, unreadable or not an object)."""
    try:
        meta = _read_json_file(index_dir / "meta.json")
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_index_folder(folder: Path) -> bool:
    """`folder` is an index this kit made or began (its mark, meta.json of this format, an
    unfinished build's folder or its lock): a build may write into it."""
    from engine.io import marked

    if marked(folder, "index") or (folder / BUILD_DIR).is_dir() or (folder / LOCK_FILE).is_file():
        return True
    try:
        return json.loads((folder / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class BuildLock:
    """`with BuildLock(index_dir):` holds INDEX_DIR/.lock (flock, exclusive) for a build's life;
    IndexBusyError naming the holder's pid when another build has it. The kernel drops the lock
    when the holder exits, however it exits; the file stays (removing it would race a waiter)."""

    def __init__(self, index_dir: Path):
        self.path = Path(index_dir) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> BuildLock:
        try:
            self.fd = take_lock(self.path)
        except LockHeld as e:
            raise IndexBusyError(f"another build holds this index {self.path.parent} (pid {e.holder})") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)         # closing the descriptor releases the flock
            self.fd = None


def _chunk_bytes(rows: np.ndarray, emb: np.ndarray, failed: list[dict]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, rows=rows.astype(np.int64), emb=emb.astype(np.float16),
             failed=np.frombuffer(json.dumps(failed).encode(), np.uint8))
    return buf.getvalue()


class ChunkStore:
    """Finished chunks of one build key under INDEX_DIR/.build/; each chunk's record names the
    decoder that decoded it (the build key holds everything else that decides its rows)."""

    def __init__(self, index_dir: Path, key: dict):
        self.dir = index_dir / BUILD_DIR
        self.key = key
        self.decoders: dict[int, str] = {}        # chunk -> decoder, of the chunks on disk

    def path(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.npz"

    def record_path(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.json"

    def open(self, n_chunks: int, log) -> dict[int, str]:
        """{chunk: decoder} of the chunks already done for this key, each verified against its
        record; chunks of another key are discarded, a bad chunk is dropped (each said via `log`)."""
        prog = self.dir / "progress.json"
        old = None
        if prog.is_file():
            try:
                old = _read_json_file(prog)
                old = old.get("key") if isinstance(old, dict) else None
                old = old if isinstance(old, dict) else None
            except (OSError, ValueError) as e:
                log(f"{prog} unreadable ({e}); starting the build over")
        if old is not None and old != self.key:
            changed = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k))
            log(f"discarding the unfinished build in {self.dir}: {', '.join(changed)} changed")
        if old != self.key:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            write_atomic(prog, json.dumps({"key": self.key}, indent=1).encode())
            return {}
        for tmp in self.dir.glob(".tmp-*"):       # left by a killed writer (the lock says none is running)
            tmp.unlink(missing_ok=True)
        for c in range(n_chunks):
            if self.path(c).exists() or self.record_path(c).exists():
                why = self._check(c)
                if why is None:
                    continue
                log(f"chunk {c + 1}/{n_chunks} ({self.path(c).name}): {why}; rebuilding it")
                self.drop(c)
        return dict(self.decoders)

    def _check(self, c: int) -> str | None:
        """Why chunk `c` cannot be kept (None: it can; its decoder is then in self.decoders)."""
        try:
            rec = _read_json_file(self.record_path(c))
            data = self.path(c).read_bytes()
        except (OSError, ValueError) as e:
            return f"unreadable ({type(e).__name__}: {e})"
        if not isinstance(rec, dict) or not isinstance(rec.get("decoder"), str):
            return "its record is malformed"
        if hashlib.sha256(data).hexdigest() != rec.get("sha256"):
            return f"sha256 differs from its record ({len(data)} bytes; the record says {rec.get('bytes')})"
        self.decoders[c] = rec["decoder"]
        return None

    def drop(self, chunk: int) -> None:
        self.record_path(chunk).unlink(missing_ok=True)
        self.path(chunk).unlink(missing_ok=True)
        self.decoders.pop(chunk, None)

    def save(self, chunk: int, rows: np.ndarray, emb: np.ndarray, failed: list[dict], decoder: str) -> None:
        """rows: [m] int64 record numbers; emb: [m, D] float16; failed: unreadable records of the chunk;
        decoder: the one that decoded its images. The chunk, then its record (with its sha256)."""
        data = _chunk_bytes(rows, emb, failed)
        self.record_path(chunk).unlink(missing_ok=True)   # no record names the bytes until they are whole
        write_atomic(self.path(chunk), data)
        rec = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "decoder": decoder,
               "rows": int(len(rows))}
        write_atomic(self.record_path(chunk), json.dumps(rec).encode())
        self.decoders[chunk] = decoder

    def load(self, chunks: range) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """Concatenated (rows [N], emb [N, D], failed) of `chunks`, in chunk order, each chunk's bytes
        hashed against its record as they are read."""
        import zipfile

        chunks = list(chunks)
        recs = {}
        for c in chunks:
            try:
                recs[c] = _read_json_file(self.record_path(c))
            except (OSError, ValueError) as e:
                raise IndexLoadError(f"{self.path(c)}: unreadable chunk ({type(e).__name__}: {e}); "
                                     "pass --force to rebuild") from e
        counts = [r.get("rows") if isinstance(r, dict) else None for r in recs.values()]
        # emb [N, D] is allocated once and filled chunk by chunk (peak: the index plus one chunk);
        # chunks recorded without their row count are concatenated instead (peak: twice the index)
        dim = self.key.get("embed_dim", 0)
        known = all(type(n) is int and n >= 0 for n in counts) and type(dim) is int and dim > 0
        emb = np.empty((sum(counts) if known else 0, dim), np.float16)
        rows, embs, failed, at = [], [], [], 0
        for c in chunks:
            try:
                rec = recs[c]
                data = self.path(c).read_bytes()
                if not isinstance(rec, dict) or hashlib.sha256(data).hexdigest() != rec.get("sha256"):
                    raise ValueError("sha256 differs from its record")
                with np.load(io.BytesIO(data), allow_pickle=False) as z:
                    r, part = z["rows"], z["emb"]
                    failed += json.loads(z["failed"].tobytes().decode())
                del data
                if known and (len(r) != rec["rows"] or len(part) != len(r) or (len(r) and part.shape[1:] != (dim,))):
                    raise ValueError(f"{len(r)} rows and embeddings of shape {part.shape}; the record says "
                                     f"{rec['rows']} rows, the build {dim} wide")
                rows.append(r)
                if known:
                    emb[at:at + len(r)] = part
                    at += len(r)
                elif len(r):
                    embs.append(part)
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
                raise IndexLoadError(f"{self.path(c)}: unreadable chunk ({type(e).__name__}: {e}); "
                                     "pass --force to rebuild") from e
        if not known and embs:
            emb = np.concatenate(embs)
        return np.concatenate(rows) if rows else np.zeros(0, np.int64), emb, failed

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def commit(index_dir: Path, emb: np.ndarray, ids: list, meta: dict,
           extras: dict[str, tuple[str, bytes]] | None = None) -> dict:
    """Write the data files under fresh names, then meta.json (the commit, one rename), then drop
    the previous build's files. `extras`: {name in EXTRA_FILES: (suffix, bytes)}, written as
    NAME-<build>SUFFIX. ValueError (nothing written) for rows that are not finite unit rows or an
    id given twice: an index is checked as it is written, as it is when read."""
    emb = np.ascontiguousarray(emb, np.float16)
    row = bad_row(emb)
    if row is not None:
        raise ValueError(f"row {row} of the embeddings is not a finite unit row (|norm - 1| < {NORM_TOL})")
    if duplicate_id(ids) is not None:
        raise ValueError(f"image id {duplicate_id(ids)!r} occurs twice")
    build = uuid.uuid4().hex[:12]
    files = {"embeddings": f"embeddings-{build}.f16.npy", "ids": f"ids-{build}.json"}
    blobs = {"embeddings": _npy_parts(emb), "ids": json.dumps(ids).encode()}   # the array itself, not a copy
    for name, (suffix, data) in (extras or {}).items():
        if name not in EXTRA_FILES:
            raise ValueError(f"unknown index extra {name!r} (one of {EXTRA_FILES})")
        files[name], blobs[name] = f"{name}-{build}{suffix}", data
    for name, data in blobs.items():
        write_atomic(index_dir / files[name], data)
    meta = {"format": FORMAT, "build_id": build, "files": files, "count": int(emb.shape[0]),
            "dim": int(emb.shape[1]),
            "sha256": {name: _sha256_parts(data) for name, data in blobs.items()}, **meta}
    write_atomic(index_dir / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())   # the switch
    keep = set(files.values())
    old = [index_dir.glob(f"{name}-*") for name in ("embeddings", "ids", *EXTRA_FILES)]
    for p in (q for g in old for q in g):
        if p.name not in keep and p.is_file():
            p.unlink(missing_ok=True)
    return meta
