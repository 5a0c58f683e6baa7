"""Embed a gallery into an index folder: records -> decode -> CLIP image tower -> unit FP16 rows.

One build per index (engine.retrieval.index.BuildLock, held for the build's life). Chunked
and resumable (engine.retrieval.index.ChunkStore): a stopped build restarts at its first
unfinished chunk, each kept chunk checked against its sha256. Each chunk records the
decoder that decoded it (an isolated decoder may give way to PIL); chunks of another
decoder than the one decoding now are rebuilt, so meta.json `decoder` and its `build_key`
name the decoder of every row. Images no decoder can read are listed in meta.json and left out.
Then the build-time extras (engine.retrieval.index_extras), the top-k kernel compiled for this
GPU (kernels.topk.store_compiled), and one commit (engine.retrieval.index.commit). An index
whose embeddings are up to date but whose extras or recorded method differ keeps its
embeddings and redoes the rest. meta.json `model` records the CLIP that built it (its
folder, absolute, and its digest), so a reader can find it again. With CLIP_TOWERS=auto the
gallery is embedded with towers measured and verified first (engine.clip.tune), recorded in
meta.json `towers`, their compiled files in INDEX_DIR/towers-<tag>/.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.presets.retrieval import RETRIEVAL


def _log(msg: str) -> None:
    print(f"[cir_build] {msg}", file=sys.stderr, flush=True)


def model_record(info: dict) -> dict:
    """engine.clip.load's info, its folder made absolute (meta.json `model`)."""
    return {**info, "dir": os.path.abspath(info["dir"])}


@dataclass
class BuildJob:
    """One index build: the records (engine.retrieval.jsonl.Record) and their sha256, the CLIP
    `towers` and `info` (engine.clip.load's record of it), the composition `method` recorded for
    the query runs (Method.to_dict()), the corpus and index folders, the `extras`
    (engine.retrieval.index_extras.ExtrasConfig), and the build's settings."""
    records: list
    records_sha: str
    towers: object
    info: dict
    method: dict
    corpus: Path
    index_dir: Path
    extras: object
    decoder: str = "auto"
    batch_size: int = RETRIEVAL.image_batch["cpu"]
    chunk_size: int = RETRIEVAL.chunk_size
    readers: int = RETRIEVAL.image_readers
    confine_to_corpus: bool = False
    force: bool = False
    stop_after_chunks: int = 0      # stop (resumably) after this many chunks; 0: never
    t_start: float | None = None    # perf_counter at the process's start (the timing's origin)
    t_loaded: float | None = None   # ... once the CLIP was loaded
    towers_mode: str | None = None  # auto | eager; None: CLIP_TOWERS, else auto on CUDA, eager on CPU


def build(job: BuildJob, embedder=None) -> bool:
    """Embed every pending chunk of `job.records`, then commit the index.

    True when the index is committed or already up to date; False when stopped early as asked
    (`stop_after_chunks`, or the extras' training hook): resumable. IndexLoadError when stored
    chunks or the index in place cannot be read; IndexBusyError when another build holds the index
    (one build per index). `towers_mode` auto measures the compiled CLIP towers and embeds with the
    chosen ones (engine.clip.tune). `embedder`: what embeds the pending chunks, an object with
    `embed(build, chunks) -> bool` (False: stopped as asked); default LocalEmbedder, this process
    (engine.retrieval.build_ray.RayEmbedder spreads them over Ray actors)."""
    from engine import settings as engine_settings
    from engine.decoders import default_decoder, make_decoder
    from engine.retrieval.index import BuildLock

    job.t_start = time.perf_counter() if job.t_start is None else job.t_start
    job.t_loaded = job.t_start if job.t_loaded is None else job.t_loaded
    decoder_name = job.decoder if job.decoder != "auto" else (
        engine_settings.decoder() or default_decoder(job.towers.device.type))
    with BuildLock(job.index_dir):
        dec = make_decoder(decoder_name, job.towers.spec.image, job.batch_size,
                           isolate=engine_settings.decoder_isolate())
        dec.decode([None])   # an isolated decoder that cannot start gives way now: dec.name is what decodes
        run = GalleryBuild(job, dec, embedder or LocalEmbedder())
        set_towers_mode(run, job.towers_mode)
        return run.build(job.force)


def set_towers_mode(run, towers_mode: str | None) -> None:
    """The build's CLIP towers mode (auto: measured, engine.clip.tune; eager): `towers_mode`, else
    CLIP_TOWERS, else auto on CUDA and eager on the CPU; auto is part of the build key (the towers
    decide the rows: another mode is another build)."""
    from engine import settings as engine_settings
    from engine.backends import REFERENCE

    run.towers_mode = towers_mode or engine_settings.clip_towers() or (
        "auto" if run.towers.device.type == "cuda" else REFERENCE)
    if run.towers_mode == "auto":
        run.key["towers"] = "auto"
        run.store.key = run.key


def build_key(records, records_sha: str, towers, info: dict, chunk_size: int, confine_to_corpus: bool) -> dict:
    """What decides the rows of every chunk, the decoder aside (each chunk records its own)."""
    spec = towers.spec
    return {"records_sha256": records_sha, "records": len(records), "model_digest": info["digest"],
            "clip_spec": spec.to_dict(), "precision": towers.precision, "device": towers.device.type,
            "chunk_size": chunk_size, "embed_dim": spec.embed_dim,
            # which files the records reach: confinement makes a different build
            "records_paths": "confined" if confine_to_corpus else "followed"}


class GalleryBuild:
    """One build under the index's lock: the up-to-date check, the chunks, the commit.

    What an embedder (`embed(build, chunks)`) reads and updates: `records`, `chunk_size`,
    `n_chunks`, `stop_after`, `towers`, `towers_record`, `dec` (the decoder), `batch_size`,
    `readers`, `read` (row -> bytes), `confine`, `corpus`, `index_dir`, `key` (the build key),
    `store` (the ChunkStore: each saved chunk's decoder in `store.decoders`), and the counters
    `saved` (chunks), `embedded` (images) and `t_embed` (seconds)."""

    MAX_PASSES = 3   # passes over chunks whose decoder differs from the one decoding now

    def __init__(self, job: BuildJob, dec, embedder):
        from engine.retrieval.index import ChunkStore
        from engine.retrieval.index_extras import extras_key
        from engine.retrieval.jsonl import record_reader

        records, chunk_size, confine = job.records, job.chunk_size, job.confine_to_corpus
        self.job, self.embedder = job, embedder
        self.records, self.records_sha, self.towers, self.info = records, job.records_sha, job.towers, job.info
        self.method, self.corpus, self.index_dir, self.extras, self.dec = job.method, job.corpus, job.index_dir, \
            job.extras, dec
        self.batch_size, self.chunk_size, self.readers = job.batch_size, chunk_size, job.readers
        self.confine, self.stop_after, self.t_start, self.t_loaded = confine, job.stop_after_chunks, \
            job.t_start, job.t_loaded
        self.key = build_key(records, job.records_sha, job.towers, job.info, chunk_size, confine)
        self.ekey = extras_key(job.extras, job.method)
        self.store = ChunkStore(job.index_dir, self.key)
        self.n_chunks = (len(records) + chunk_size - 1) // chunk_size
        self.read = record_reader(job.corpus, [r.path for r in records], confine)
        self.saved = self.embedded = 0
        self.t_embed = 0.0
        from engine.backends import REFERENCE

        self.towers_mode, self.towers_record = REFERENCE, {"mode": REFERENCE}

    def build(self, force: bool) -> bool:
        from engine.retrieval.index import IndexLoadError, load_index, read_meta

        for tmp in self.index_dir.glob(".tmp-*"):     # left by a killed commit (the lock: no writer runs)
            tmp.unlink(missing_ok=True)
        old = read_meta(self.index_dir)
        if old is not None and old.get("build_key") == {**self.key, "decoder": self.dec.name} and not force:
            try:
                idx = load_index(self.index_dir)          # up to date only if it is whole
            except IndexLoadError as e:
                raise IndexLoadError(f"{e}; pass --force to rebuild") from e
            if old.get("extras_key") == self.ekey:
                _log(f"index in {self.index_dir} is up to date ({old.get('count')} images); --force rebuilds it")
                return True
            return self.reuse_embeddings(old, idx)
        done = self.store.open(self.n_chunks, _log)
        if self.towers_mode == "auto":
            self._choose_towers()
            done = [c for c in done if c in self.store.decoders]      # less those embedded by other towers
        if done:
            _log(f"resuming: {len(done)} of {self.n_chunks} chunks already built")
        resumed = len(done)
        for _ in range(self.MAX_PASSES):
            self._drop_other_decoders()
            pending = [c for c in range(self.n_chunks) if c not in self.store.decoders]
            if not pending:
                break
            if not self.embedder.embed(self, pending):
                return False
        else:
            if any(d != self.dec.name for d in self.store.decoders.values()):
                raise IndexLoadError(f"the decoder kept changing while building ({self.dec.name} now); "
                                     "run the build again")
        return self._commit(resumed)

    def _choose_towers(self) -> None:
        """The CLIP towers this build embeds with (engine.clip.tune): a resumed build's recorded
        choice, else measured now on a gallery sample; their files go to INDEX_DIR/towers-<tag>/."""
        import uuid

        from engine.clip import tune
        from engine.retrieval.embed import embed_images
        from engine.retrieval.index import BUILD_DIR

        build_dir = self.index_dir / BUILD_DIR
        old = tune.read_resume(build_dir)
        if old is not None:
            towers = tune.load_recorded(self.towers, self.index_dir, old, _log)
            if towers is not self.towers:
                _log(f"towers: the resumed build's choice ({old['dir']})")
                self.towers, self.towers_record = towers, old
                return
            # the recorded towers cannot run here (a damaged file, another device kind): the chunks
            # they embedded are rebuilt with the towers chosen now, so no index mixes two choices
            built = sorted(self.store.decoders)
            if built:
                _log(f"rebuilding {len(built)} of {self.n_chunks} chunks embedded with the resumed build's "
                     "towers, which cannot be loaded here: the towers are measured again")
                for c in built:
                    self.store.drop(c)
        preset = tune.PRESETS.get(self.towers.device.type, tune.PRESETS["cuda"])
        items = range(min(preset.sample, len(self.records)))
        # the sample's decoded pixels: uint8 values pass the fp16 rows of embed_images exactly
        s = self.towers.spec.image.input_size
        pix = [b.emb.reshape(-1, s, s, 3) for b in embed_images(
            self.read, items, self.dec, torch_flat, self.batch_size, self.readers) if len(b.emb)]
        if not pix:
            _log("towers: no readable image to measure them on; eager towers")
            return
        import numpy as np
        import torch

        images = torch.from_numpy(np.concatenate(pix).astype(np.uint8))
        _log(f"towers: measuring the candidates on {len(images)} gallery images")
        self.towers, self.towers_record = tune.tune(self.towers, images, self.index_dir / f"towers-{uuid.uuid4().hex[:12]}",
                                                    _log)
        tune.save_resume(build_dir, self.towers_record)

    def _drop_other_decoders(self) -> None:
        """Chunks decoded by another decoder than the one decoding now are rebuilt (one line):
        an index's rows all come from the decoder its meta.json and build key name."""
        other = sorted(c for c, d in self.store.decoders.items() if d != self.dec.name)
        if other:
            was = sorted({self.store.decoders[c] for c in other})
            _log(f"rebuilding {len(other)} of {self.n_chunks} chunks decoded with {', '.join(was)}: "
                 f"this build decodes with {self.dec.name}")
            for c in other:
                self.store.drop(c)

    def _commit(self, resumed: int) -> bool:
        towers, spec, dec = self.towers, self.towers.spec, self.dec
        rows, emb, failed = self.store.load(range(self.n_chunks))
        ids = [self.records[i].image_id for i in rows.tolist()]
        rate = self.embedded / self.t_embed if self.t_embed > 0 else 0.0
        key = {**self.key, "decoder": dec.name}   # every chunk's decoder (_drop_other_decoders saw to it)
        meta = {"build_key": key, "model": model_record(self.info), "clip_spec": spec.to_dict(),
                "method": self.method, "decoder": key["decoder"], "device": towers.device.type,
                "precision": towers.precision, "towers": self.towers_record,
                "records": {"path": str(self.corpus / "records.jsonl"), "sha256": self.records_sha,
                            "usable": len(self.records)},
                "corpus": str(self.corpus.resolve()), "confine_to_corpus": self.confine, "unreadable": failed,
                "counts": {"records": len(self.records), "indexed": len(ids), "unreadable": len(failed)},
                "timing": {"load_s": round(self.t_loaded - self.t_start, 3), "embed_s": round(self.t_embed, 3),
                           "images_embedded_this_run": self.embedded, "images_per_s": round(rate, 2),
                           "resumed_chunks": resumed}}
        if not self.commit_with_extras(emb, ids, meta):
            return False
        self.store.clear()
        _log(f"index: {len(ids)} images, {len(failed)} unreadable, dim {spec.embed_dim} -> {self.index_dir}")
        _log(f"embedded {self.embedded} images in {self.t_embed:.2f} s: {rate:.1f} images/s "
             f"(decoder {dec.name}, {towers.device.type} {towers.precision}; "
             f"model load {self.t_loaded - self.t_start:.2f} s)")
        return True

    def commit_with_extras(self, emb, ids: list, meta: dict) -> bool:
        """Compute the extras (engine.retrieval.index_extras), then commit; False when the training hook fires."""
        from engine.retrieval.index import BUILD_DIR, commit
        from engine.retrieval.index_extras import build_extras
        from engine.retrieval.pic2word import Stopped

        index_dir = self.index_dir
        t0 = time.perf_counter()
        try:
            extra_meta, files = build_extras(self.extras, emb, self.towers, self.info["digest"], index_dir / BUILD_DIR)
        except Stopped as e:
            _log(f"pic2word: {e} (stopped as asked; resumable)")
            return False
        meta = {**meta, **extra_meta, "extras_key": self.ekey, "kernels": store_kernels(index_dir)}
        meta["timing"] = {**meta.get("timing", {}), "extras_s": round(time.perf_counter() - t0, 3)}
        commit(index_dir, emb, ids, meta, files)
        drop_other_towers(index_dir, meta.get("towers"))
        return True

    def reuse_embeddings(self, old: dict, idx=None) -> bool:
        """The embeddings are up to date but the extras or the recorded method differ: redo only those.
        `old`: the meta.json in place; `idx`: the index in place, verified (default: loaded here).
        IndexLoadError (naming --force) when it cannot be read."""
        import numpy as np

        from engine.retrieval.index import BUILD_DIR, IndexLoadError, load_index

        index_dir = self.index_dir
        if idx is None:
            try:
                idx = load_index(index_dir)
            except IndexLoadError as e:
                raise IndexLoadError(f"{e}; pass --force to rebuild") from e
        _log(f"embeddings in {index_dir} are up to date; recomputing the extras only")
        keep = ("build_key", "model", "clip_spec", "decoder", "device", "precision", "towers", "records", "corpus",
                "confine_to_corpus", "unreadable", "counts", "timing")
        meta = {k: old[k] for k in keep if k in old}
        meta["model"] = model_record(self.info)   # the same digest (the build key says so); where it is now
        meta["method"] = self.method
        meta["corpus"] = str(self.corpus.resolve())
        meta["timing"] = {**meta.get("timing", {}), "reused_embeddings": True}
        done = self.commit_with_extras(np.asarray(idx.emb), idx.ids, meta)
        if done:
            shutil.rmtree(index_dir / BUILD_DIR / "pic2word", ignore_errors=True)
        return done


class LocalEmbedder:
    """The build's default embedder: the pending chunks embedded in this process, saved as they fill."""

    def embed(self, run: GalleryBuild, chunks: list[int]) -> bool:
        """Embed and save `chunks`; False when stopped as asked (stop_after_chunks)."""
        import numpy as np

        from engine.progress import Progress
        from engine.retrieval.embed import embed_images

        records, size = run.records, run.chunk_size
        pending = [i for c in chunks for i in range(c * size, min((c + 1) * size, len(records)))]
        bar = Progress(len(records), "[cir_build] embedding", unit="images", initial=len(records) - len(pending))
        acc: dict[int, dict] = {}      # chunk -> {"rows", "emb", "failed", "decoders", "seen"}
        t0 = time.perf_counter()
        for b in embed_images(run.read, pending, run.dec, run.towers.encode_images, run.batch_size,
                              run.readers):
            k = 0
            for j, item in enumerate(b.items):
                c = acc.setdefault(item // size, {"rows": [], "emb": [], "failed": [], "decoders": set(), "seen": 0})
                c["seen"] += 1
                c["decoders"].add(b.decoders[j])
                if b.ok[j]:
                    c["rows"].append(item)
                    c["emb"].append(b.emb[k])
                    k += 1
                else:
                    r = records[item]
                    c["failed"].append({"image_id": r.image_id, "path": r.path, "line": r.line,
                                        "reason": b.failed[item]})
                    _log(f"unreadable image {r.image_id!r} ({r.path}, records line {r.line}): {b.failed[item]}")
            run.embedded += k
            bar.update(len(b.items))
            for chunk in sorted(acc):
                if acc[chunk]["seen"] < min(size, len(records) - chunk * size):
                    break
                c = acc.pop(chunk)
                emb = np.stack(c["emb"]) if c["emb"] else np.zeros((0, run.towers.spec.embed_dim), np.float16)
                run.store.save(chunk, np.asarray(c["rows"], np.int64), emb, c["failed"],
                               "+".join(sorted(c["decoders"])))
                run.saved += 1
                if bar.mode != "bar":
                    _log(f"chunk {chunk + 1}/{run.n_chunks} done")
                if run.stop_after and run.saved >= run.stop_after:
                    bar.close()
                    _log(f"stopping after {run.saved} chunks, as asked (resumable)")
                    return False
        bar.close()
        if run.towers.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        run.t_embed += time.perf_counter() - t0
        return True


def torch_flat(a):
    """uint8 [m, S, S, 3] (numpy or torch) -> [m, S*S*3] as a torch tensor (a sample's pixels as rows)."""
    import torch

    t = torch.as_tensor(a)
    return t.reshape(t.shape[0], -1)


def drop_other_towers(index_dir: Path, record) -> None:
    """Remove towers-* folders the committed meta.json does not name (an earlier build's, or an
    unfinished one's); under the build lock, after the commit switched."""
    keep = record.get("dir") if isinstance(record, dict) else None
    for d in index_dir.glob("towers-*"):
        if d.name != keep and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def store_kernels(index_dir: Path) -> dict:
    """Compile the query run's kernels now (CUDA + CuPy present), so the run loads them without
    NVRTC: {"topk": what kernels.topk.store_compiled stored, or why nothing was}."""
    from engine.io import write_atomic
    from engine.retrieval.index import KERNEL_DIR
    from kernels.topk import store_compiled

    topk = store_compiled(index_dir / KERNEL_DIR, write=write_atomic)
    _log(f"top-k kernel: stored {topk['file']} (sm_{topk['arch']})" if topk["stored"]
         else f"top-k kernel: not stored ({topk['reason']}); a CUDA query run compiles it")
    return {"topk": topk}


