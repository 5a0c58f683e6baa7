"""Embed a gallery into an index folder: records -> decode -> CLIP image tower -> unit FP16 rows.

Chunked and resumable (engine.retrieval.index.ChunkStore): a stopped build restarts at its
first unfinished chunk. Images no decoder can read are listed in meta.json and left out.
Then the build-time extras (engine.retrieval.extras), the top-k kernel compiled for this
GPU (kernels.topk.store_compiled), and one commit (engine.retrieval.index.commit). An index
whose embeddings are up to date but whose extras or recorded method differ keeps its
embeddings and redoes the rest. meta.json `model` records the CLIP that built it (its
folder, absolute, and its digest), so a reader can find it again.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path


def _log(msg: str) -> None:
    print(f"[cir_build] {msg}", file=sys.stderr, flush=True)


def model_record(info: dict) -> dict:
    """engine.clip.load's info, its folder made absolute (meta.json `model`)."""
    return {**info, "dir": os.path.abspath(info["dir"])}


def build(records, records_sha: str, towers, info: dict, method: dict, *, corpus: Path, index_dir: Path,
          extras, decoder: str = "auto", batch_size: int = 64, chunk_size: int = 4096, readers: int = 8,
          confine_to_corpus: bool = False, force: bool = False, stop_after_chunks: int = 0,
          t_start: float | None = None, t_loaded: float | None = None) -> bool:
    """Embed every pending chunk of `records` (engine.retrieval.jsonl.Record), then commit the index.

    `info`: engine.clip.load's record of the CLIP in `towers`; `method`: the composition method
    recorded for the query runs (Method.to_dict()); `extras`: an ExtrasConfig. True when the index
    is committed or already up to date; False when stopped early as asked (`stop_after_chunks`, or
    the extras' training hook): resumable. IndexLoadError when stored chunks or the index in place
    cannot be read."""
    import numpy as np

    from engine import settings as engine_settings
    from engine.decoders import default_decoder, make_decoder
    from engine.progress import Progress
    from engine.retrieval.embed import embed_images
    from engine.retrieval.extras import extras_key
    from engine.retrieval.index import ChunkStore, read_meta
    from engine.retrieval.jsonl import record_reader

    t_start = time.perf_counter() if t_start is None else t_start
    t_loaded = t_start if t_loaded is None else t_loaded
    decoder_name = decoder if decoder != "auto" else (
        engine_settings.decoder() or default_decoder(towers.device.type))
    spec = towers.spec
    dec = make_decoder(decoder_name, spec.image, batch_size, isolate=engine_settings.decoder_isolate())
    key = {"records_sha256": records_sha, "records": len(records), "model_digest": info["digest"],
           "clip_spec": spec.to_dict(), "decoder": dec.name,
           "precision": towers.precision, "device": towers.device.type, "chunk_size": chunk_size,
           "embed_dim": spec.embed_dim}
    # which files the records reach: confinement makes a different build
    key["records_paths"] = "confined" if confine_to_corpus else "followed"
    ekey = extras_key(extras, method)
    old = read_meta(index_dir)
    if old is not None and old.get("build_key") == key and not force:
        if old.get("extras_key") == ekey:
            _log(f"index in {index_dir} is up to date ({old.get('count')} images); --force rebuilds it")
            return True
        return reuse_embeddings(index_dir, corpus, old, towers, info, extras, ekey, method)
    store = ChunkStore(index_dir, key)
    done = store.open()
    n_chunks = (len(records) + chunk_size - 1) // chunk_size
    if done:
        _log(f"resuming: {len(done)} of {n_chunks} chunks already built")
    pending = [i for i in range(len(records)) if i // chunk_size not in done]
    read = record_reader(corpus, [r.path for r in records], confine_to_corpus)

    bar = Progress(len(records), "[cir_build] embedding", unit="images", initial=len(records) - len(pending))
    acc: dict[int, dict] = {}      # chunk -> {"rows": [...], "emb": [...], "failed": [...], "seen": n}
    saved = embedded = 0
    t0 = time.perf_counter()
    for b in embed_images(read, pending, dec, towers.encode_images, batch_size, readers):
        k = 0
        for j, item in enumerate(b.items):
            c = acc.setdefault(item // chunk_size, {"rows": [], "emb": [], "failed": [], "seen": 0})
            c["seen"] += 1
            if b.ok[j]:
                c["rows"].append(item)
                c["emb"].append(b.emb[k])
                k += 1
            else:
                r = records[item]
                c["failed"].append({"image_id": r.image_id, "path": r.path, "line": r.line,
                                    "reason": b.failed[item]})
                _log(f"unreadable image {r.image_id!r} ({r.path}, records line {r.line}): {b.failed[item]}")
        embedded += k
        bar.update(len(b.items))
        for chunk in sorted(acc):
            size = min(chunk_size, len(records) - chunk * chunk_size)
            if acc[chunk]["seen"] < size:
                break
            c = acc.pop(chunk)
            emb = np.stack(c["emb"]) if c["emb"] else np.zeros((0, spec.embed_dim), np.float16)
            store.save(chunk, np.asarray(c["rows"], np.int64), emb, c["failed"])
            saved += 1
            if bar.mode != "bar":
                _log(f"chunk {chunk + 1}/{n_chunks} done")
            if stop_after_chunks and saved >= stop_after_chunks:
                bar.close()
                _log(f"stopping after {saved} chunks, as asked (resumable)")
                return False
    bar.close()
    if towers.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    t_embed = time.perf_counter() - t0
    rows, emb, failed = store.load(range(n_chunks))
    ids = [records[i].image_id for i in rows.tolist()]
    rate = embedded / t_embed if t_embed > 0 else 0.0
    meta = {"build_key": key, "model": model_record(info), "clip_spec": spec.to_dict(), "method": method,
            "decoder": dec.name, "device": towers.device.type, "precision": towers.precision,
            "records": {"path": str(corpus / "records.jsonl"), "sha256": records_sha, "usable": len(records)},
            "corpus": str(corpus.resolve()), "confine_to_corpus": confine_to_corpus,
            "unreadable": failed, "counts": {"records": len(records), "indexed": len(ids), "unreadable": len(failed)},
            "timing": {"load_s": round(t_loaded - t_start, 3), "embed_s": round(t_embed, 3),
                       "images_embedded_this_run": embedded, "images_per_s": round(rate, 2),
                       "resumed_chunks": len(done)}}
    if not commit_with_extras(index_dir, emb, ids, meta, towers, info, extras, ekey):
        return False
    store.clear()
    _log(f"index: {len(ids)} images, {len(failed)} unreadable, dim {spec.embed_dim} -> {index_dir}")
    _log(f"embedded {embedded} images in {t_embed:.2f} s: {rate:.1f} images/s "
         f"(decoder {dec.name}, {towers.device.type} {towers.precision}; model load {t_loaded - t_start:.2f} s)")
    return True


def commit_with_extras(index_dir: Path, emb, ids: list, meta: dict, towers, info: dict, extras, ekey: dict) -> bool:
    """Compute the extras (engine.retrieval.extras), then commit; False when the training hook fires."""
    from engine.retrieval.extras import build_extras
    from engine.retrieval.index import BUILD_DIR, commit
    from engine.retrieval.pic2word import Stopped

    t0 = time.perf_counter()
    try:
        extra_meta, files = build_extras(extras, emb, towers, info["digest"], index_dir / BUILD_DIR)
    except Stopped as e:
        _log(f"pic2word: {e} (stopped as asked; resumable)")
        return False
    meta = {**meta, **extra_meta, "extras_key": ekey, "kernels": store_kernels(index_dir)}
    meta["timing"] = {**meta.get("timing", {}), "extras_s": round(time.perf_counter() - t0, 3)}
    commit(index_dir, emb, ids, meta, files)
    return True


def store_kernels(index_dir: Path) -> dict:
    """Compile the query run's kernels now (CUDA + CuPy present), so the run loads them without
    NVRTC: {"topk": what kernels.topk.store_compiled stored, or why nothing was}."""
    from engine.retrieval.index import KERNEL_DIR
    from kernels.topk import store_compiled

    topk = store_compiled(index_dir / KERNEL_DIR)
    _log(f"top-k kernel: stored {topk['file']} (sm_{topk['arch']})" if topk["stored"]
         else f"top-k kernel: not stored ({topk['reason']}); a CUDA query run compiles it")
    return {"topk": topk}


def reuse_embeddings(index_dir: Path, corpus: Path, old: dict, towers, info: dict, extras, ekey: dict,
                     method: dict) -> bool:
    """The embeddings are up to date but the extras or the recorded method differ: redo only those.
    IndexLoadError (naming --force) when the index in place cannot be read."""
    import numpy as np

    from engine.retrieval.index import BUILD_DIR, IndexLoadError, load_index

    try:
        idx = load_index(index_dir)
    except IndexLoadError as e:
        raise IndexLoadError(f"{e}; pass --force to rebuild") from e
    _log(f"embeddings in {index_dir} are up to date; recomputing the extras only")
    keep = ("build_key", "model", "clip_spec", "decoder", "device", "precision", "records", "corpus",
            "confine_to_corpus", "unreadable", "counts", "timing")
    meta = {k: old[k] for k in keep if k in old}
    meta["model"] = model_record(info)        # the same digest (the build key says so); where it is now
    meta["method"] = method
    meta["corpus"] = str(corpus.resolve())
    meta["timing"] = {**meta.get("timing", {}), "reused_embeddings": True}
    done = commit_with_extras(index_dir, np.asarray(idx.emb), idx.ids, meta, towers, info, extras, ekey)
    if done:
        shutil.rmtree(index_dir / BUILD_DIR / "pic2word", ignore_errors=True)
    return done
