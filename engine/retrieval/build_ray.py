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
Ray is imported in this module only.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from engine.retrieval import gallery
from engine.retrieval.presets import RETRIEVAL


def _log(msg: str) -> None:
    print(f"[cir_build_ray] {msg}", file=sys.stderr, flush=True)


def start_ray(workers: int, object_store_mb: int = RETRIEVAL.ray_object_store_mb):
    """Join RAY_ADDRESS's cluster, or start a small local Ray (its files under TMPDIR)."""
    import logging

    import ray
    import ray.data

    for name in ("ray", "ray.data"):     # Ray Data's INFO lines (its plan, its log folder) stay in its logs
        logging.getLogger(name).setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False   # ours: chunks done, images/s
    if ray.is_initialized():
        return ray
    from engine import settings as engine_settings

    if engine_settings.ray_address():          # ray.init reads RAY_ADDRESS itself
        ray.init(log_to_driver=False, logging_level=logging.WARNING)
    else:
        import tempfile

        ray.init(num_cpus=max(workers, 1), include_dashboard=False, log_to_driver=False,
                 object_store_memory=object_store_mb * 1024 * 1024, logging_level=logging.WARNING,
                 _temp_dir=os.path.join(tempfile.gettempdir(), "ray"))
    return ray


def load_towers(model_dir, model_name, batch_size: int, device, precision):
    """CLIP towers as the single build loads them: (towers, info)."""
    from engine.clip.load import load_clip
    from engine.clip.towers import ClipTowers

    model, spec, info = load_clip(model_dir, model_name, batch_size)
    return ClipTowers(model, spec, device, precision), info


class ChunkEmbedder:
    """A Ray actor: towers and decoder loaded once; each row of a batch is one chunk to embed
    and save. Returns each chunk's record (chunk, sha256, decoder, rows)."""

    def __init__(self, tower_args: tuple, key: dict, corpus: str, index_dir: str, decoder: str,
                 batch_size: int, readers: int, confine: bool, towers_record: dict | None = None):
        from engine import settings as engine_settings
        from engine.clip import tune
        from engine.decoders import make_decoder
        from engine.retrieval.index import ChunkStore
        from engine.retrieval.jsonl import record_reader

        recs = read_own_records(Path(corpus), key)
        towers, _ = load_towers(*tower_args)
        # the towers the driver measured and chose (engine.clip.tune), loaded without compiling
        self.towers = tune.load_recorded(towers, Path(index_dir), towers_record, _log)
        self.dec = make_decoder(decoder, self.towers.spec.image, batch_size,
                                isolate=engine_settings.decoder_isolate())
        self.store = ChunkStore(Path(index_dir), key)
        self.paths = [r.path for r in recs]
        self.ids, self.lines = [r.image_id for r in recs], [r.line for r in recs]
        self.read = record_reader(Path(corpus), self.paths, confine)
        self.batch_size, self.readers = batch_size, readers

    def __call__(self, batch: dict) -> dict:
        import json

        out = {"chunk": [], "record": []}
        for c, lo, hi in zip(batch["chunk"], batch["lo"], batch["hi"]):
            rec = self.embed_chunk(int(c), int(lo), int(hi))
            out["chunk"].append(int(c))
            out["record"].append(json.dumps(rec))
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


class _RayRun(gallery._Run):
    """gallery's build with `_embed` spread over Ray actors (everything else is the single build's)."""

    def __init__(self, *args, workers: int, tower_args: tuple):
        super().__init__(*args)
        self.workers, self.tower_args = workers, tower_args

    def _embed(self, chunks: list[int]) -> bool:
        import json

        ray = start_ray(self.workers)
        n, size = len(self.records), self.chunk_size
        todo = chunks[:self.stop_after] if self.stop_after else chunks
        rows = [{"chunk": c, "lo": c * size, "hi": min((c + 1) * size, n)} for c in todo]
        gpu = self.towers.device.type == "cuda"
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            ChunkEmbedder, batch_size=1, compute=ray.data.ActorPoolStrategy(size=self.workers),
            **({"num_gpus": 1} if gpu else {"num_cpus": 1}),
            fn_constructor_kwargs=dict(
                tower_args=self.tower_args, key=self.key, corpus=str(self.corpus), index_dir=str(self.index_dir),
                decoder=self.dec.name, batch_size=self.batch_size, readers=self.readers, confine=self.confine,
                towers_record=self.towers_record))
        t0 = time.perf_counter()
        images = 0
        for i, row in enumerate(ds.iter_rows(), 1):
            rec = json.loads(row["record"])
            self.store.decoders[int(row["chunk"])] = rec["decoder"]
            self.embedded += rec["rows"]
            images += rec["rows"] + rec["failed"]
            self.saved += 1
            dt = time.perf_counter() - t0
            _log(f"chunk {int(row['chunk']) + 1}/{self.n_chunks} done ({i}/{len(todo)} this run, "
                 f"{images / dt if dt > 0 else 0.0:.1f} images/s)")
        self.t_embed += time.perf_counter() - t0
        if self.stop_after and self.saved >= self.stop_after and len(todo) < len(chunks):
            _log(f"stopping after {self.saved} chunks, as asked (resumable)")
            return False
        return True


def build(records, records_sha: str, towers, info: dict, method: dict, *, tower_args: tuple,
          workers: int = RETRIEVAL.ray_workers, **kwargs) -> bool:
    """gallery.build on Ray: the same arguments (`kwargs`), plus `tower_args` (load_towers' arguments,
    for the actors) and `workers` (actors: one GPU each on CUDA, else one CPU each). The towers are
    chosen as the single build chooses them (gallery.set_towers_mode), once, by the driver; each
    actor loads the recorded choice."""
    import functools

    return gallery.build(records, records_sha, towers, info, method,
                         make_run=functools.partial(_RayRun, workers=workers, tower_args=tower_args), **kwargs)
