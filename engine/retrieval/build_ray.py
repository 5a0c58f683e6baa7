"""Embed a gallery on Ray Data: the single-process build (engine.retrieval.gallery) with its
chunks spread over Ray actors, one per worker, each holding the CLIP towers loaded once.

    scripts/build.sh --ray [--workers N] --corpus DIR --index-dir INDEX [...]   (evaluator.cir.build)

The driver holds the index's lock, checks which chunks are finished (gallery's ChunkStore),
and builds a Ray Dataset with one row per unfinished chunk (its number and item range: the
object store holds chunk numbers and records, never pixels). Each actor embeds its chunk's
images (engine.retrieval.embed.embed_images) and writes the chunk file with ChunkStore.save,
the single build's own format, returning the chunk's record. The driver then commits with
gallery's commit (extras included). Resumable as the single build is: a stopped build
restarts at its unfinished chunks. Without RAY_ADDRESS a local Ray starts on this machine;
with it, the build joins that cluster (the index folder must then be on a shared disk).
Ray is imported here and in engine.retrieval.ray_session (its start, checks and cleanup) only.

Every failure is one line of ours (RayBuildError, its exit status with it): what ray_session
checks before the start, an actor's own error (carried back as a row, never as Ray's
ActorDiedError), a worker that died (the cause named: a full disk, memory, else Ray's first line).
A dead actor is not restarted nor its chunk retried (Ray Data's default: forever); the build ends.
A local Ray lives in its own folder TMPDIR/ray-<random>; on every exit (success, failure,
SIGTERM, SIGHUP, SIGINT) its processes are stopped and the folder removed (RaySession).
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval import gallery
from engine.retrieval.ray_session import (
    RayBuildError,
    RaySession,
    bounded_retries,
    capped_workers,
    local_capacity,
    start_ray,
)


def _log(msg: str) -> None:
    print(f"[cir_build_ray] {msg}", file=sys.stderr, flush=True)


def load_towers(model_dir, model_name, batch_size: int, device, precision):
    """CLIP towers as the single build loads them: (towers, info)."""
    from engine.clip.load import load_clip
    from engine.clip.towers import ClipTowers

    model, spec, info = load_clip(model_dir, model_name, batch_size)
    return ClipTowers(model, spec, device, precision), info


@dataclass(frozen=True)
class ActorSettings:
    """What each actor loads: the CLIP (load_towers' arguments), the build key, the corpus and
    index folders, the decoder by name, images per batch, reader threads, whether records paths
    are confined to the corpus, and the towers the driver chose (engine.clip.tune's record)."""
    tower_args: tuple
    key: dict
    corpus: str
    index_dir: str
    decoder: str
    batch_size: int
    readers: int
    confine: bool
    towers_record: dict | None = None


class ChunkEmbedder:
    """A Ray actor: towers and decoder loaded once; each row of a batch is one chunk to embed
    and save. Returns each chunk's record (chunk, sha256, decoder, rows), or its error: an error
    of ours travels back as a row's `error` (one line), so the driver says it as it was raised
    (a constructor that raised would reach the driver as Ray's ActorDiedError, and be restarted)."""

    def __init__(self, settings: ActorSettings):
        self.error = None
        try:
            self._load(settings)
        except Exception as e:          # noqa: BLE001 -- said by the driver, in one line
            self.error = _error_line(e)

    def _load(self, s: ActorSettings):
        from engine import settings as engine_settings
        from engine.clip import tune
        from engine.decoders import make_decoder
        from engine.retrieval.index import ChunkStore
        from engine.retrieval.jsonl import record_reader

        recs = read_own_records(Path(s.corpus), s.key)
        towers, _ = load_towers(*s.tower_args)
        # the towers the driver measured and chose (engine.clip.tune), loaded without compiling
        self.towers = tune.load_recorded(towers, Path(s.index_dir), s.towers_record, _log)
        self.dec = make_decoder(s.decoder, self.towers.spec.image, s.batch_size,
                                isolate=engine_settings.decoder_isolate())
        self.store = ChunkStore(Path(s.index_dir), s.key)
        self.paths = [r.path for r in recs]
        self.ids, self.lines = [r.image_id for r in recs], [r.line for r in recs]
        self.read = record_reader(Path(s.corpus), self.paths, s.confine)
        self.batch_size, self.readers = s.batch_size, s.readers

    def __call__(self, batch: dict) -> dict:
        import json

        out = {"chunk": [], "record": [], "error": []}
        for c, lo, hi in zip(batch["chunk"], batch["lo"], batch["hi"]):
            rec, err = {}, self.error
            if err is None:
                try:
                    rec = self.embed_chunk(int(c), int(lo), int(hi))
                except Exception as e:      # noqa: BLE001 -- said by the driver, in one line
                    err = _error_line(e)
            out["chunk"].append(int(c))
            out["record"].append(json.dumps(rec))
            out["error"].append(err or "")
        return out

    def embed_chunk(self, chunk: int, lo: int, hi: int) -> dict:
        import numpy as np

        from engine.retrieval.embed import embed_images

        rows, emb, failed, decoders = [], [], [], set()
        for b in embed_images(self.read, range(lo, hi), self.dec, self.towers.encode_images,
                              self.batch_size, self.readers):
            decoders.update(b.decoders)
            k = 0
            for j, item in enumerate(b.items):
                if b.ok[j]:
                    rows.append(item)
                    emb.append(b.emb[k])
                    k += 1
                else:
                    failed.append({"image_id": self.ids[item], "path": self.paths[item],
                                   "line": self.lines[item], "reason": b.failed[item]})
        dim = self.towers.spec.embed_dim
        e = np.stack(emb) if emb else np.zeros((0, dim), np.float16)
        self.store.save(chunk, np.asarray(rows, np.int64), e, failed, "+".join(sorted(decoders)))
        rec = gallery_record(self.store, chunk)
        return {**rec, "chunk": chunk, "failed": len(failed)}


def _error_line(e: BaseException) -> str:
    """An actor's error as the driver says it: its message on one line (an OSError names its file)."""
    from engine.cli import one_line

    return one_line(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {one_line(e)}"


def read_own_records(corpus: Path, key: dict) -> list:
    """The actor's own copy of the records (the object store carries chunk numbers only),
    checked against the build key: ValueError when records.jsonl changed since the driver read it."""
    import hashlib

    from engine.retrieval.jsonl import read_input, read_records

    path = corpus / "records.jsonl"
    sha = hashlib.sha256(read_input(path)).hexdigest()
    recs = read_records(path, lambda msg: None)      # the driver has said its warnings once
    if sha != key["records_sha256"] or len(recs) != key["records"]:
        raise ValueError(f"{path} changed while the build ran (sha256 {sha[:12]}, {len(recs)} records); "
                         "run the build again")
    return recs


def gallery_record(store, chunk: int) -> dict:
    import json

    return json.loads(store.record_path(chunk).read_text())


class RayEmbedder:
    """gallery.build's embedder (its public seam, `embed(build, chunks)`) spreading the chunks over
    Ray actors; everything else is the single build's. `tower_args`: load_towers' arguments for the
    actors; `workers`: actors asked for; `prog` names the command in Ray's one-line failures."""

    def __init__(self, tower_args: tuple, workers: int = RETRIEVAL.ray_workers, prog: str = "cir_build_ray"):
        self.workers, self.tower_args, self.prog = workers, tower_args, prog

    def embed(self, run, chunks: list[int]) -> bool:
        todo = chunks[:run.stop_after] if run.stop_after else chunks
        gpu = run.towers.device.type == "cuda"
        session = RaySession(self.prog, "finished chunks are kept; the same command resumes the build")
        with session:                     # Ray stopped and its folder removed on every way out
            ray = start_ray(session, min(self.workers, len(todo), local_capacity(gpu)))
            session.trap_signals()
            workers, line = capped_workers(self.workers, len(todo), session.capacity(gpu), "GPU" if gpu else "CPU")
            if line:
                _log(line)
            failure = self._run_chunks(run, ray, session, todo, (workers, gpu))
            if failure:   # raised here, not in _run_chunks: no frame of ours holding Ray's objects outlives Ray
                raise RayBuildError(failure, 1)
        if run.stop_after and run.saved >= run.stop_after and len(todo) < len(chunks):
            _log(f"stopping after {run.saved} chunks, as asked (resumable)")
            return False
        return True

    def _run_chunks(self, run, ray, session, todo: list[int], pool: tuple[int, bool]) -> str | None:
        """Embed `todo` on `workers` actors, one chunk per call; the line saying why it stopped on
        an actor's error or a worker's death, else None. (Returned, not raised: a traceback would keep
        this frame, its dataset and object refs alive past ray.shutdown, and a ref freed then makes
        Ray end the process.)"""
        import json

        workers, gpu = pool
        n, size = len(run.records), run.chunk_size
        rows = [{"chunk": c, "lo": c * size, "hi": min((c + 1) * size, n)} for c in todo]
        with warnings.catch_warnings():   # Ray 2.60 deprecates max_restarts as arguments, with no other way
            warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
            ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
                ChunkEmbedder, batch_size=1, compute=ray.data.ActorPoolStrategy(size=workers),
                **bounded_retries(), **({"num_gpus": 1} if gpu else {"num_cpus": 1}),
                fn_constructor_kwargs=dict(settings=ActorSettings(
                    tower_args=self.tower_args, key=run.key, corpus=str(run.corpus),
                    index_dir=str(run.index_dir), decoder=run.dec.name, batch_size=run.batch_size,
                    readers=run.readers, confine=run.confine, towers_record=run.towers_record)))
        t0 = time.perf_counter()
        images = 0
        rows_done = iter(ds.iter_rows())
        try:
            for i, row in enumerate(rows_done, 1):
                if row["error"]:
                    return f"a Ray actor failed: {row['error']}"
                rec = json.loads(row["record"])
                run.store.decoders[int(row["chunk"])] = rec["decoder"]
                run.embedded += rec["rows"]
                images += rec["rows"] + rec["failed"]
                run.saved += 1
                dt = time.perf_counter() - t0
                _log(f"chunk {int(row['chunk']) + 1}/{run.n_chunks} done ({i}/{len(todo)} this run, "
                     f"{images / dt if dt > 0 else 0.0:.1f} images/s)")
        except ray.exceptions.RayError as e:
            return session.death_line(e, run.index_dir)
        finally:
            run.t_embed += time.perf_counter() - t0
            close = getattr(rows_done, "close", None)
            if close is not None:         # Ray Data's executor stops before Ray does (no thread left calling it)
                try:
                    close()
                except Exception:         # noqa: BLE001 -- Ray's shutdown follows and ends what is left
                    pass
        return None


def build(job: gallery.BuildJob, tower_args: tuple, workers: int = RETRIEVAL.ray_workers,
          prog: str = "cir_build_ray") -> bool:
    """gallery.build of `job` on Ray: `tower_args` (load_towers' arguments, for the actors) and
    `workers` (actors: one GPU each on CUDA, else one CPU each; capped at the units usable and the
    unfinished chunks, said in one line). The towers are chosen as the single build chooses them
    (gallery.set_towers_mode), once, by the driver; each actor loads the recorded choice.
    RayBuildError (one line, its exit status) when Ray cannot serve; a signal during the Ray phase
    stops Ray, removes its folder, says `PROG: interrupted (SIG...)` and exits 128 + signal."""
    return gallery.build(job, RayEmbedder(tower_args, workers, prog))
