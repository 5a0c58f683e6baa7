"""A loaded artifact that answers top-1 for images: load, decode, infer, answer.

    import engine

    with engine.load("artifacts/default") as clf:
        top1 = clf.classify(["a.jpg", "b.png"])   # int32 [2], in order
        clf.last_failed                             # {index: why}: the files nothing could read

Load, in this order (Classifier.__init__):
0. the address-space limit (ulimit -v) is checked against what the run will map (engine.memory);
1. a decoder that runs in a child process (engine.decoders.runs_isolated) is started from the
   artifact's manifest before torch is imported: it starts while torch loads;
2. torch and the engine's modules are imported, the artifact is read and checked
   (engine.classify.artifact) and the thread budget of its device applied (engine.threads);
3. any other decoder is built on a thread (a DALI GPU pipeline takes about a second) while
   the runtime loads, its CUDA graphs not yet captured;
4. the decoder is waited for, then the graphs are captured: no other thread may touch the
   device during a capture (a DALI GPU pipeline allocates while it builds).
The full SHA-256 of the artifact's files, started by step 2 on a thread of its own, runs
meanwhile; each classify call joins it before its first image is read (ArtifactError, from
engine.classify.artifact, when a file's bytes differ from the manifest: no answer is returned).
It ends before the reader threads start, so the run's thread peak (threads.Budget.peak) holds.
Decode and infer: engine.classify.pipeline reads, decodes and infers batches in overlap.
Answer: one int32 per item, in order. An item that cannot be read or decoded gets the
prediction of a zero image (the pipeline keeps one in its slot) and is named in `last_failed`;
classify and classify_bytes also say it on stderr, one line each.

Options (None: the engine's settings): decoder (ENGINE_DECODER, else the one the artifact's
manifest names, else the fast decoder of the artifact's device), readers (ENGINE_READERS), depth
(ENGINE_PIPELINE_DEPTH), isolate (ENGINE_DECODER_ISOLATE), max_file_bytes (ENGINE_MAX_FILE_BYTES:
classify's file size cap).
A load that cannot succeed raises LoadError; running out of memory stays the MemoryError or
RuntimeError it was (is_oom tells it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import settings
from engine.memory import is_oom
from engine.process_stats import peak_rss_mib, process_start, start_offset

if TYPE_CHECKING:
    import numpy as np


class LoadError(RuntimeError):
    """The artifact cannot be loaded here. `stage`: "memory" (the address-space limit),
    "imports" (torch), "artifact" (its checks) or "runtime" (its model)."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


def check_address_space(artifact: Path, threads: int, decoder_here: str | None = None) -> None:
    """LoadError (stage "memory") when RLIMIT_AS is below what a run maps: the artifact's files,
    the runtime's fixed part, its `threads`, and the decoder when it runs in this process
    (`decoder_here`; engine.memory has the measured parts)."""
    from engine.memory import AddressSpaceError
    from engine.memory import check_address_space as check

    try:
        check(need_bytes_for(artifact, threads, decoder_here), f"a run of {artifact} with {threads} threads")
    except AddressSpaceError as e:
        raise LoadError(str(e), "memory") from None


def need_bytes_for(artifact: Path, threads: int, decoder_here: str | None = None) -> int:
    """The address space a classification run of `artifact` with `threads` threads maps."""
    from engine.io import path_bytes
    from engine.memory import CLASSIFY_FIXED, decoder_bytes, need_bytes, thread_bytes

    return need_bytes(path_bytes(artifact), CLASSIFY_FIXED + decoder_bytes(decoder_here), thread_bytes(threads))


def decoder_in_process(artifact: Path, name: str | None, isolate: bool) -> str | None:
    """The run's decoder when it decodes in this process, None when in a child: `name`, else the
    artifact's default, read from its manifest without torch (an unreadable one: None)."""
    from engine.decoders import default_decoder, runs_isolated

    try:
        if name is None:
            with open(artifact / "manifest.json", "rb") as f:
                name = default_decoder(json.loads(f.read(64 << 20)).get("device", "cpu"))
        return None if runs_isolated(name, isolate) else name
    except (OSError, ValueError, AttributeError, RecursionError, ImportError):
        return None   # the manifest or the decoder's module: loading says what is wrong with them


def start_isolated_decoder(artifact: Path, name: str | None, isolate: bool, threads: int):
    """The decoder started from the artifact's manifest before torch is imported, when it runs in
    a child process (engine.decoders.runs_isolated); None otherwise or if the manifest is unusable
    (load_artifact then says why). The Classifier keeps it only if the checked artifact agrees."""
    from engine.core.spec import Spec
    from engine.decoders import artifact_decoder, make_decoder, runs_isolated

    try:
        with open(artifact / "manifest.json", "rb") as f:
            meta = json.loads(f.read(64 << 20))
        name = name or artifact_decoder(meta)
        if not runs_isolated(name, isolate):
            return None
        spec = Spec.from_dict(meta["spec"])
        return make_decoder(name, spec, spec.batch_size, threads, isolate)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


@dataclass
class _Classification:
    """The last classify call: its item count, the pipeline's Result, its clock interval."""

    n: int
    result: Any            # engine.classify.pipeline.Result
    begin: float
    end: float


class Classifier:
    """An artifact loaded with its decoder; see the module doc. Use it as a context manager, or
    call close() (the decoder's child process stops; the model stays until the object is dropped)."""

    def __init__(self, artifact: str | os.PathLike, decoder: str | None = None, readers: int | None = None,
                 depth: int | None = None, isolate: bool | None = None, max_file_bytes: int | None = None):
        from engine import threads

        self.path = Path(artifact)
        self.depth = settings.pipeline_depth() if depth is None else depth
        if (readers is not None and readers < 1) or self.depth < 0:
            raise ValueError("readers must be >= 1 and depth >= 0")
        isolate = settings.decoder_isolate() if isolate is None else isolate
        self.max_file_bytes = settings.max_file_bytes() if max_file_bytes is None else max_file_bytes
        self.last_failed: dict[int, str] = {}
        self._closed = False
        name = decoder or settings.decoder()
        budget = threads.budget("cpu")
        check_address_space(self.path, budget.peak(isolated_decoder=False),                       # step 0
                            decoder_in_process(self.path, name, isolate))
        early = start_isolated_decoder(self.path, name, isolate, budget.decoder)                  # step 1
        try:
            self._load(name, readers, isolate, early)
        except BaseException:
            if early is not None:
                early.close()
            raise

    def _load(self, name: str | None, readers: int | None, isolate: bool, early) -> None:
        from engine import threads

        try:
            import torch  # noqa: F401 - the heavy import, timed as part of "imports"
        except (ImportError, OSError, MemoryError) as e:
            from engine.memory import import_failure

            raise LoadError(import_failure("torch", e), "imports") from None
        import numpy as np

        from engine.classify.artifact import ArtifactError, load_artifact
        from engine.classify.pipeline import Result
        from engine.classify.runtime import load_runtime
        from engine.decoders import artifact_decoder, start_decoder

        self._t_imports = time.perf_counter()
        try:
            art = self.artifact = load_artifact(self.path)                                        # step 2
        except (ArtifactError, OSError) as e:
            raise LoadError(f"cannot load artifact {self.path}: {e}", "artifact") from None
        self.budget = threads.budget(art.device)
        threads.apply_torch(self.budget)
        self.readers = readers or self.budget.readers
        name = name or artifact_decoder(art.meta)
        if early is not None and (early.name, early.spec, early.batch_size) == (name, art.spec, art.batch_size):
            self.decoder, pending = early, None
        else:
            if early is not None:
                early.close()
            pending = start_decoder(name, art.spec, art.batch_size, self.budget.decoder, isolate)   # step 3
        try:
            self.runtime = load_runtime(art, capture=False)   # CUDA graphs: captured once the decoder is built
        except (ArtifactError, RuntimeError, OSError) as e:
            if is_oom(e):
                raise
            raise LoadError(f"cannot load artifact {self.path}: {e}", "runtime") from None
        if pending is not None:
            self.decoder = pending.result()                                                        # step 4
        self.runtime.capture_graphs()   # no other thread touches the device now
        self._t_loaded = time.perf_counter()
        self._last = _Classification(0, Result(np.zeros(0, np.int32)), self._t_loaded, self._t_loaded)

    # ---------------------------------------------------------------- decode, infer, answer
    def classify_read(self, read: Callable[[int], bytes], n: int) -> np.ndarray:
        """Top-1 of items 0..n-1: int32 [n]. `read(i)` (called on reader threads) returns item i's
        encoded bytes or raises; an item that fails is in `last_failed` {i: why}. Prints nothing.
        ArtifactError when the artifact's files differ from its manifest (their full SHA-256,
        waited for here, before the first image is read)."""
        from engine.classify.pipeline import classify

        if self._closed:
            raise RuntimeError("the classifier is closed")
        self.artifact.check_weights()   # no answer from bytes the build did not write
        begin = time.perf_counter()
        res = classify(read, n, self.decoder, self.runtime, readers=self.readers, depth=self.depth)
        self._last = _Classification(n, res, begin, time.perf_counter())
        self.last_failed = dict(sorted(res.failed.items()))
        return res.top1

    def classify(self, paths: Sequence[str | os.PathLike]) -> np.ndarray:
        """Top-1 of image files: int32 [len(paths)], in order. Each is opened as open() would (a
        symlink followed) and must be a regular file of at most max_file_bytes."""
        from engine.io import read_regular

        names = [os.fspath(p) for p in paths]
        cap = self.max_file_bytes
        top1 = self.classify_read(lambda i: read_regular(names[i], cap, follow=True), len(names))
        self._say_failed(top1, lambda i: str(names[i]))
        return top1

    def classify_bytes(self, blobs: Iterable[bytes]) -> np.ndarray:
        """Top-1 of encoded images (JPEG, PNG, ... bytes): int32 [len(blobs)], in order."""
        items = list(blobs)
        top1 = self.classify_read(items.__getitem__, len(items))
        self._say_failed(top1, lambda i: f"item {i}")
        return top1

    def _say_failed(self, top1: np.ndarray, label: Callable[[int], str]) -> None:
        for i, why in self.last_failed.items():
            print(f"[engine] {label(i)}: unreadable, predicted {top1[i]}: {why}", file=sys.stderr)

    # ---------------------------------------------------------------- report, close
    def report(self, start: float | None = None) -> dict:
        """The timing report of the last classification. Seconds; `imports`, `first_batch_s` and
        the timeline count from `start` (a time.time() value; default: this process's start);
        `read` and `decode` are summed over their threads; `pipeline` is the call's wall time."""
        offset = start_offset(process_start() if start is None else start)
        last, b = self._last, self.budget
        res, busy, wall = last.result, last.result.stages, last.end - last.begin
        report = {
            "images": last.n,
            "failed": len(res.failed),
            "backend": self.artifact.backend,
            "decoder": self.decoder.name,
            "decoder_isolated": bool(getattr(self.decoder, "isolated", False)),
            "precision": self.artifact.precision,
            "batch_size": self.artifact.batch_size,
            "device": str(self.runtime.device),
            "pipeline_depth": self.depth,
            "artifact_sha256": self.artifact.weights.report(),   # the full hash, overlapped with the load
            "threads": {"budget": b.total, "readers": self.readers, "decoder": b.decoder,
                        "intra_op": b.intra_op, "inter_op": b.inter_op},
            "stages": {
                "imports": round(self._t_imports + offset, 4),
                "artifact_load": round(self._t_loaded - self._t_imports, 4),
                "read": round(busy.get("read", 0.0), 4),
                "decode": round(busy.get("decode", 0.0), 4),
                "inference": round(busy.get("inference", 0.0), 4),
                "pipeline": round(wall, 4),
            },
            "first_batch_s": round(res.first_batch_at + offset, 4) if res.first_batch_at else None,
            "images_per_s": round(last.n / max(wall, 1e-9), 2),
            "peak_rss_mib": peak_rss_mib(),          # this process; its ended children apart (the decoder's)
            "timeline": [{**e, "start": round(e["start"] + offset, 4), "end": round(e["end"] + offset, 4)}
                         for e in res.timeline],
        }
        if hasattr(self.runtime, "report"):
            report["runtime"] = self.runtime.report()
        return report

    def close(self) -> None:
        """Stop the decoder (an isolated one's child process); classify refuses afterwards."""
        if not self._closed:
            self._closed = True
            if hasattr(self.decoder, "close"):
                self.decoder.close()

    def __enter__(self) -> Classifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
