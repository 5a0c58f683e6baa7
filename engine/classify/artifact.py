"""Artifact directories: a manifest.json plus the weights or compiled graph it names.

The manifest carries the spec, backend, precision, device, versions, the SHA-256 of
every file and of the source checkpoint, the compiled graph's input and output as the
build ran it (`graph`), and its own digest (`manifest_sha256`, over the rest of it).
`load_artifact` checks all of it before the model loads:

    always        the manifest's own digest (an edited manifest is refused), every field's
                  type and range, spec == graph (input [B, S, S, 3] uint8, output [B] int32),
                  built with the torch this process runs (a compiled graph is bound to it),
                  the backend's files all listed, each a regular file inside the artifact
    quick (default, ENGINE_ARTIFACT_VERIFY)   + each file's size and a sampled SHA-256
                  (16 blocks of 64 KiB at fixed offsets: ~1 MiB read per file)
    size          + each file's size only
    sha256        + each file's full SHA-256 (./build.sh and `selfcheck current` run this)

and then, in every mode, every byte: under quick and size the full SHA-256 of every listed
file starts on a thread of its own (WeightsCheck; hashlib and file reads release the GIL)
while the model loads, and `Artifact.check_weights()` joins it, raising ArtifactError on a
difference; Classifier.classify_read (under classify and classify_bytes) and Runtime.run_async
call it before the first image, so no answer ever comes from bytes that differ from the
manifest (docs/classification.md, "Artifact checks", has the cost: ~2 s for EVA-02-L's
1.8 GB, while its graphs load). Every
listed file is hashed in full: each one is read by the model's load (weights, the compiled
code, the kernels' binaries, AOTInductor's metadata), so none is a file whose damage cannot
change an answer; the sampled check is only the early refusal of a replaced or truncated file
before the model maps it. Under sha256 the full hash runs before the load, nothing after.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import settings
from engine.core.spec import Spec
from engine.io import package_versions, sha256_file

FORMAT = "eva-engine-artifact/2"
MANIFEST = "manifest.json"
DIGEST_KEY = "manifest_sha256"
VERIFY_MODES = ("quick", "size", "sha256")
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 64 << 10
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ArtifactError(RuntimeError):
    """The artifact directory is missing, incomplete or corrupt."""


class WeightsCheck:
    """The full SHA-256 of every listed file against the manifest, hashed on a thread started at
    load (`start`) or already done (`done`). `wait()` joins it: ArtifactError naming the first file
    that differs or cannot be read. A thread that cannot start (a PID limit) hashes in `wait()`."""

    def __init__(self, files: list[tuple[Path, str, int]]):
        self.files = files                     # (path, manifest sha256, bytes)
        self.hash_s = 0.0                      # the hashing's own duration
        self.waited_s = 0.0                    # how long wait() blocked the caller
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._task: int | None = None          # the hashing thread's kernel task id
        self._ran = not files

    @classmethod
    def done(cls) -> WeightsCheck:
        """A check with nothing left to hash (the files were hashed before the load)."""
        return cls([])

    @classmethod
    def start(cls, root: Path, files: dict[str, dict[str, Any]]) -> WeightsCheck:
        check = cls([(root / name, info["sha256"], int(info["bytes"])) for name, info in files.items()])
        if check.files:
            try:
                check._thread = threading.Thread(target=check._hash, name="artifact-sha256", daemon=True)
                check._thread.start()
            except RuntimeError:             # no thread to be had: wait() hashes in the caller
                check._thread = None
        return check

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.files)

    def _hash(self) -> None:
        t0 = time.perf_counter()
        self._task = threading.get_native_id()
        try:
            for path, want, _ in self.files:
                try:
                    got = sha256_file(path)
                except OSError as e:
                    self._error = f"artifact file {path} cannot be read for its SHA-256: {e.strerror or e}"
                    return
                if got != want:
                    self._error = (f"artifact file {path} is corrupt: its SHA-256 differs from the manifest "
                                   "(its bytes are not the ones the build wrote; rebuild it with ./build.sh)")
                    return
        except MemoryError:
            self._error = "out of memory while hashing the artifact's files"
        finally:
            self.hash_s = time.perf_counter() - t0
            self._ran = True

    def wait(self) -> None:
        """Join the hash; ArtifactError when a file's bytes differ from the manifest's SHA-256."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            _wait_task_gone(self._task)
        elif not self._ran:
            self._hash()
        self.waited_s += time.perf_counter() - t0
        if self._error is not None:
            raise ArtifactError(self._error)

    def report(self) -> dict[str, Any]:
        """What the timing report records: bytes hashed after the load began, the hash's own
        seconds and how long the answers waited for it."""
        return {"bytes": self.bytes, "hash_s": round(self.hash_s, 4), "waited_s": round(self.waited_s, 4)}


def _wait_task_gone(task: int | None, limit_s: float = 0.2) -> None:
    """Wait (at most `limit_s`) until a joined thread's kernel task has exited: join returns once
    its Python part ended, a moment before the kernel thread is gone, and a run under a PID bound starts its
    reader threads right after (Linux; elsewhere, no /proc, it returns at once)."""
    if task is None:
        return
    end = time.monotonic() + limit_s
    while os.path.exists(os.path.join("/proc/self/task", str(task))) and time.monotonic() < end:   # the kernel's thread list
        time.sleep(0.0005)


@dataclass(frozen=True)
class Artifact:
    root: Path
    spec: Spec
    backend: str        # a name in engine.backends
    device: str         # cpu | cuda
    precision: str
    batch_size: int
    files: dict[str, dict[str, Any]]   # name -> {"sha256", "sample_sha256", "bytes"}
    meta: dict[str, Any]               # the whole manifest
    weights: WeightsCheck = field(default_factory=WeightsCheck.done, compare=False, repr=False)

    def path(self, name: str) -> Path:
        return self.root / name

    def check_weights(self) -> None:
        """Wait for the full SHA-256 of the files (see the module doc): ArtifactError on a
        difference. Call it before any answer of the model leaves."""
        self.weights.wait()

    def total_bytes(self) -> int:
        """Bytes of every listed file (what loading the model maps, at least)."""
        return sum(int(f["bytes"]) for f in self.files.values())


def versions() -> dict[str, str | None]:
    """The stack the artifact is built with: the packages whose versions decide its numbers and
    its compiled code's ABI, and torch's CUDA (None on a CPU build of torch)."""
    import torch

    out = package_versions(("torch", "torchvision", "timm", "nvidia-dali-cuda130", "tensorrt", "torch-tensorrt"))
    return {**out, "torch_cuda": torch.version.cuda}


def check_versions(meta: dict[str, Any], where: str) -> None:
    """A compiled graph is bound to the torch that built it (its C++ ABI, its kernels): the
    artifact must have been built with the torch this process runs."""
    built = (meta.get("versions") or {}).get("torch")
    here = package_versions(("torch",))["torch"]
    if built != here:
        raise ArtifactError(f"{where}: the artifact was built with torch {built}, this is torch {here}: "
                            "rebuild it (./build.sh) with the torch that runs it")


def sample_sha256(path: str | os.PathLike) -> str:
    """SHA-256 over the size and SAMPLE_BLOCKS blocks of SAMPLE_BYTES at evenly spaced offsets
    (first and last included): a different file of the same size is caught reading ~1 MiB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        span = max(size - SAMPLE_BYTES, 0)
        for k in range(SAMPLE_BLOCKS):
            f.seek(span * k // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def manifest_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the manifest without its own digest, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in meta.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def graph_record(fn, spec: Spec, device: str) -> dict[str, Any]:
    """Input and outputs of the built model as it ran once on a zero batch of the spec's shape.

    `fn` is what the backend's `load` returned: uint8 [B, S, S, 3] -> int32 top-1 [B] (a
    guarded graph also returns its margins). Run at build time, so the manifest records the
    shape the compiled graph was made for and proved to run with; load_artifact compares
    the spec with it before any image is read.
    """
    import torch

    x = torch.zeros((spec.batch_size, spec.input_size, spec.input_size, 3), dtype=torch.uint8, device=device)
    with torch.inference_mode():
        out = fn(x)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return {"input": {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")},
            "outputs": [{"shape": list(o.shape), "dtype": str(o.dtype).removeprefix("torch.")} for o in outs]}


def probe_graph(backend: str, root: Path, spec: Spec, device: str, meta: dict[str, Any]) -> dict[str, Any]:
    """graph_record of the files `backend` just wrote into `root`, loaded as the run will load them
    (`meta`: the manifest fields so far, e.g. a guard)."""
    import torch

    from engine import backends

    art = Artifact(Path(root), spec, backend, device, spec.precision, spec.batch_size, {}, meta)
    return graph_record(backends.get(backend).load(art, torch.device(device)), spec, device)


def write_manifest(root: Path, spec: Spec, backend: str, device: str, checkpoint: Path | None,
                   checkpoint_sha256: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the built model once (the `graph` record), digest every file in `root`, and write
    manifest.json last (its presence marks completion)."""
    graph = probe_graph(backend, root, spec, device, dict(extra or {}))
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "sample_sha256": sample_sha256(p),
                                                      "bytes": p.stat().st_size}
    meta = {
        "format": FORMAT,
        "spec": spec.to_dict(),
        "backend": backend,
        "device": device,
        "precision": spec.precision,
        "batch_size": spec.batch_size,
        "checkpoint": None if checkpoint is None else {
            "path": str(checkpoint), "sha256": checkpoint_sha256, "bytes": Path(checkpoint).stat().st_size},
        "files": files,
        "versions": versions(),
        **(extra or {}),
        "graph": graph,
    }
    meta = json.loads(json.dumps(meta))        # the digest covers exactly what a reader parses back
    meta[DIGEST_KEY] = manifest_digest(meta)
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)
    return meta


def _is_int(v, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def check_manifest(meta: Any, where: str) -> Spec:
    """The spec of a parsed manifest after checking its digest, fields and graph; ArtifactError otherwise."""
    if not isinstance(meta, dict):
        raise ArtifactError(f"{where} is corrupt: a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{where}: format {meta.get('format')!r}, expected {FORMAT!r} "
                            "(rebuild the artifact with python -m engine.build)")
    if meta.get(DIGEST_KEY) != manifest_digest(meta):
        raise ArtifactError(f"{where} was changed after the build: its {DIGEST_KEY} does not match its contents")
    try:
        spec = Spec.from_dict(meta["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{where}: bad spec ({type(e).__name__}: {e})") from None
    if not (_is_int(spec.input_size, 1) and _is_int(spec.batch_size, 1) and isinstance(spec.crop_pct, (int, float))
            and isinstance(spec.model, str) and isinstance(spec.model_kwargs, dict)
            and len(spec.mean) == len(spec.std) == 3 and _is_int(spec.num_classes, 1)):
        raise ArtifactError(f"{where}: spec fields of the wrong type: {meta['spec']}")
    for key, ok in (("backend", lambda v: isinstance(v, str) and v),
                    ("device", lambda v: v in ("cpu", "cuda")),
                    ("precision", lambda v: v == spec.precision),
                    ("batch_size", lambda v: _is_int(v, 1) and v == spec.batch_size),
                    ("files", lambda v: isinstance(v, dict))):
        if key not in meta or not ok(meta[key]):
            raise ArtifactError(f"{where}: field {key!r} is {meta.get(key)!r}: missing, malformed or "
                                "inconsistent with the spec")
    for name, info in meta["files"].items():
        if not (isinstance(info, dict) and _is_int(info.get("bytes")) and _HEX64.fullmatch(str(info.get("sha256")))
                and _HEX64.fullmatch(str(info.get("sample_sha256")))):
            raise ArtifactError(f"{where}: entry for file {name!r} is malformed: {info!r}")
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or name.startswith(("/", "\\")):
            raise ArtifactError(f"{where}: file name {name!r} is not a plain path inside the artifact")
    check_graph(meta.get("graph"), spec, where)
    return spec


def check_graph(graph: Any, spec: Spec, where: str) -> None:
    """The spec must ask for exactly the graph the build ran: input [B, S, S, 3] uint8 -> top-1 [B] int32
    (further outputs, a guard's margins, are [B] too)."""
    b, s = spec.batch_size, spec.input_size
    if not isinstance(graph, dict) or not isinstance(graph.get("outputs"), list) or not graph["outputs"]:
        raise ArtifactError(f"{where}: no compiled-graph record (rebuild the artifact with python -m engine.build)")
    want_in = {"shape": [b, s, s, 3], "dtype": "uint8"}
    problems = []
    if graph.get("input") != want_in:
        problems.append(f"input {graph.get('input')} (the spec needs {want_in})")
    if graph["outputs"][0] != {"shape": [b], "dtype": "int32"}:
        problems.append(f"top-1 output {graph['outputs'][0]} (the spec needs [{b}] int32)")
    if any(not isinstance(o, dict) or o.get("shape") != [b] for o in graph["outputs"][1:]):
        problems.append(f"outputs {graph['outputs'][1:]} (the spec needs [{b}] each)")
    if problems:
        raise ArtifactError(f"{where}: the spec (input_size {s}, batch_size {b}) does not match the compiled "
                            f"graph the build ran: {'; '.join(problems)}")


def check_files(root: Path, files: dict[str, dict[str, Any]], verify: str) -> None:
    """Every listed file is a regular file inside `root` that passes the `verify` check."""
    real_root = os.path.realpath(root)
    for name, info in files.items():
        p = root / name
        try:
            st = os.stat(p)
        except OSError:
            raise ArtifactError(f"artifact file missing: {p}") from None
        real = os.path.realpath(p)
        if not stat.S_ISREG(st.st_mode) or os.path.commonpath([real_root, real]) != real_root:
            raise ArtifactError(f"artifact file {p} is not a regular file inside the artifact")
        if st.st_size != info["bytes"]:
            raise ArtifactError(f"artifact file {p} has {st.st_size} bytes, manifest says {info['bytes']}")
        if verify == "quick" and sample_sha256(p) != info["sample_sha256"]:
            raise ArtifactError(f"artifact file {p} is corrupt or replaced: its sampled SHA-256 differs "
                                "from the manifest")
        if verify == "sha256" and sha256_file(p) != info["sha256"]:
            raise ArtifactError(f"artifact file {p} is corrupt: SHA-256 differs from the manifest")


def load_artifact(root: str | os.PathLike, verify: str | None = None) -> Artifact:
    """Read and check an artifact (see the module doc). verify: quick | size | sha256
    (default ENGINE_ARTIFACT_VERIFY, else quick). Under quick and size the full SHA-256 of every
    file is still running when this returns: `check_weights()` waits for it."""
    root = Path(root)
    try:
        verify = verify or settings.artifact_verify()
    except ValueError as e:
        raise ArtifactError(str(e)) from None
    if verify not in VERIFY_MODES:
        raise ArtifactError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    mpath = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"artifact directory not found: {root} (build one with python -m engine.build)")
    if not mpath.is_file():
        raise ArtifactError(f"{mpath} is missing: the artifact is incomplete or not an artifact")
    try:
        with open(mpath, "rb") as f:
            meta = json.loads(f.read(64 << 20))
    except (OSError, ValueError, RecursionError) as e:
        raise ArtifactError(f"{mpath} is corrupt: {type(e).__name__}: {e}") from e
    spec = check_manifest(meta, str(mpath))
    check_versions(meta, str(mpath))
    _check_backend_files(meta, str(mpath))
    check_files(root, meta["files"], verify)
    weights = WeightsCheck.done() if verify == "sha256" else WeightsCheck.start(root, meta["files"])
    return Artifact(root, spec, meta["backend"], meta["device"], meta["precision"],
                    int(meta["batch_size"]), meta["files"], meta, weights)


def _check_backend_files(meta: dict[str, Any], where: str) -> None:
    """The backend is registered and every file it loads is listed (and so verified)."""
    from engine import backends

    try:
        be = backends.get(meta["backend"])
    except ValueError as e:
        raise ArtifactError(f"{where}: {e}") from None
    missing = [f for f in be.FILES if f not in meta["files"]]
    if missing:
        raise ArtifactError(f"{where}: backend {meta['backend']} loads {missing}, which the manifest does not list")
