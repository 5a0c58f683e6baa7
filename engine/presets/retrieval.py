"""The retrieval engine's defaults, in one table: composition, the query run, the index build,
Pic2Word, the Ray build and the CLIP towers (engine.clip). Every module of engine/retrieval,
engine/clip and evaluator/cir takes its default from `RETRIEVAL` here; none holds a literal
copy (tests/test_presets.py checks the field names, and the other names each field lists).

Why a table of its own, beside the engine's (engine/presets/classification.py) rather than a section of it:
the classification table has one column per device because nearly every build default
depends on it, while a retrieval default hardly ever does (the two that do, `image_batch` and
`tower_batches`, map a device to their value); and the retrieval engine reads this table
without importing the classification build's. `python -m engine.presets` prints both tables,
this one as docs/retrieval.md shows it (a test keeps the two equal).

Not here, by design: switches whose default is "off" or "derived" (`--dba 0`, `--text-bank -1`,
`--p2w-steps 0`, `--p2w-warmup -1`, the stop hooks), limits the callers set (the caller's results
per request and re-inspection cap: evaluator.cir's; `top_k` is only the API's default), checks'
thresholds (engine.clip.tune's COS_MIN) and facts of a model (engine.clip.spec's CLIP geometry).
"""
from __future__ import annotations

import dataclasses


def _field(doc: str, default, names: tuple[str, ...] = ()):
    """A table field: its value, what it means (markdown() prints it) and what other code calls it
    (`name` anywhere, `Owner.name` in that class or function only: tests/test_presets.py)."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"doc": doc, "names": names})
    return dataclasses.field(default=default, metadata={"doc": doc, "names": names})


@dataclasses.dataclass(frozen=True)
class RetrievalPreset:
    # composition (engine.retrieval.compose): a method's fields when its name does not set them
    method: str = _field("the composition method when none is given (build `--method`, the run's fallback, "
                         "the API's `method`)", "slerp")
    text_weights: dict = _field("text weight per method: with a shared concept / without (Slerp: Jang et al.'s "
                                "CIRCO / CIRR values; `--text-weight` sets both)",
                                {"slerp": (0.8, 0.9), "sum": (0.5, 0.5), "text-only": (1.0, 1.0),
                                 "pic2word": (1.0, 1.0)}, names=("weight_concept", "weight_plain"))
    gap_shift: float = _field("`gap:shift=`: the fraction of the modality-gap vector closed (1: the means meet)",
                              1.0, names=("shift.lam",))
    beta: float = _field("`isoftmax:beta=`, `qbnorm:beta=`: the inverse temperature (QB-Norm's)", 20.0)
    temp: float = _field("`dual-softmax:temp=`: the inverse temperature on cosines (CLIP's logit scale)", 100.0)
    csls_k: int = _field("`csls:k=`: the neighbourhood size (Conneau et al.)", 10,
                         names=("ScorerParams.k", "row_state.k"))
    aqe_neighbours: int = _field("`aqe` without `n=`: the neighbours alpha-QE adds", 3)
    aqe_alpha: float = _field("`aqe:alpha=`: the exponent on similarities relative to the best neighbour's", 3.0)
    dba_neighbours: int = _field("`dba` without `n=`: the neighbours DBA adds to a gallery row", 3)
    dba_alpha: float = _field("`dba:alpha=`, build `--dba-alpha`: DBA's exponent on similarities", 3.0)
    reinspect_candidates: int = _field("`reinspect` without `n=`: candidates re-inspected per request", 100)
    crops: int = _field("`reinspect:crops=`: extra views per re-inspected candidate (1..5)", 3)
    reinspect_zoom: float = _field("a re-inspection view's zoom: the share of the short side its centre crop "
                                   "keeps", 0.8)
    gap_min_texts: int = _field("`gap` centred on a call's own request texts: fewer texts than this make no "
                                "text mean (said on stderr)", 8)
    # the query run (evaluator.cir.run, engine.retrieval.search and .query)
    top_k: int = _field("results per request when the caller asks for no `k` (the API's default); the CLIP "
                        "towers' tuning compares top-k lists this deep", 50)
    query_batch: int = _field("requests per batch: run `--batch-size`, ablate `--batch-size`, the API's "
                              "`batch_size`; also the blocks a call's requests are encoded in for its statistics", 256)
    bank_chunk: int = _field("run `--bank-chunk`: bank queries per block of the streamed bank statistics "
                             "(0: one [M, N] matrix, the reference twin)", 256, names=("bank_stats.chunk",))
    text_batch: int = _field("texts per call of the text tower (ClipTowers.encode_texts, Pic2Word's prompts)", 256)
    reinspect_cache_rows: int = _field("multi-view rows a re-inspecting run keeps cached per call", 50_000,
                                       names=("ViewDecoding.cache_rows",))
    # the index build (evaluator.cir.build, engine.retrieval.gallery and .index_extras)
    image_batch: dict = _field("images per call of the image tower, by device: build `--batch-size`, "
                               "re-inspection, a loaded CLIP's spec (no device named: the CPU's)",
                               {"cpu": 64, "cuda": 256})
    chunk_size: int = _field("build `--chunk-size`: images per resumable chunk", 4096)
    image_readers: int = _field("build `--readers`: file reader threads of the gallery's decode (re-inspection "
                                "takes the thread budget's)", 8,
                                names=("BuildConfig.readers", "build.readers", "embed_images.readers",
                                       "ViewDecoding.readers"))
    decode_ahead: int = _field("decoded batches in flight ahead of the image tower", 2,
                               names=("embed_images.depth",))
    text_bank_size: int = _field("build `--text-bank` -1: gallery-derived texts stored with a mapping (none "
                                 "without one)", 4096)
    dba_chunk: int = _field("build `--dba-chunk`, query-time DBA: gallery rows per DBA block (0: one [N, N] "
                            "matrix, the reference twin)", 1024, names=("dba.chunk",))
    norm_check_block: int = _field("rows per block of an index's unit-norm check (FP32 blocks that stay in cache)",
                                   1024, names=("bad_row.block",))
    # Pic2Word (engine.retrieval.pic2word), build `--mapping pic2word`
    p2w_hidden: int = _field("`--p2w-hidden`: the mapping's MLP width (Pic2Word's)", 512,
                             names=("Pic2WordConfig.hidden",))
    p2w_layers: int = _field("the mapping's hidden layers (Pic2Word's)", 2, names=("Pic2WordConfig.layers",))
    p2w_dropout: float = _field("the mapping's dropout", 0.1, names=("Pic2WordConfig.dropout",))
    p2w_epochs: int = _field("`--p2w-epochs`: passes over the gallery (when `--p2w-steps` is 0)", 20,
                             names=("Pic2WordConfig.epochs",))
    p2w_batch_size: int = _field("`--p2w-batch-size`: training batch (InfoNCE negatives: batch - 1)", 256)
    p2w_lr: float = _field("`--p2w-lr`: the peak learning rate (after the warm-up)", 1e-4,
                           names=("Pic2WordConfig.lr",))
    p2w_weight_decay: float = _field("AdamW's weight decay", 0.1, names=("Pic2WordConfig.weight_decay",))
    p2w_seed: int = _field("`--p2w-seed`: initialisation, data order, dropout and the text bank's rows", 0,
                           names=("Pic2WordConfig.seed",))
    p2w_ckpt_every: int = _field("`--p2w-ckpt-every`: training steps between checkpoints", 200,
                                 names=("Pic2WordConfig.ckpt_every",))
    p2w_time_budget: float = _field("`--p2w-time-budget`: seconds of training at most (then it stops, recorded)",
                                    2400.0, names=("Pic2WordConfig.time_budget_s",))
    # the Ray build (engine.retrieval.build_ray), build `--ray`
    ray_workers: int = _field("`--workers`: Ray actors (one GPU each on CUDA, else one CPU each)", 2,
                              names=("BuildConfig.workers", "build.workers"))
    ray_object_store_mb: int = _field("MiB of object store a local Ray starts with (rows are chunk numbers, not "
                                      "pixels)", 200, names=("start_ray.object_store_mb",))
    # the CLIP towers measured at index build (engine.clip.tune)
    tower_batches: dict = _field("static batches each tower is measured at, by device", {"cpu": (32,),
                                                                                          "cuda": (16, 32, 64)})
    tower_sample: int = _field("gallery images the towers are checked and timed on", 256, names=("Preset.sample",))
    tower_queries: int = _field("of which held-out queries (top-k equal to the FP32 reference's)", 32,
                                names=("Preset.queries",))
    tower_rounds: int = _field("timings per candidate (their median is its rate)", 3, names=("Preset.rounds",))
    # python -m engine.clip.bench
    bench_image_batch: int = _field("bench `--image-batch`: images per timed call", 32)
    bench_text_batch: int = _field("bench `--text-batch`: texts per timed call", 64)
    bench_rounds: int = _field("bench `--rounds`: eager / aot timing rounds", 7, names=("bench.rounds",))
    bench_min_s: float = _field("bench: seconds one timing lasts at least", 0.5, names=("_rate.min_s",))

    def image_batch_for(self, device: str | None) -> int:
        """`image_batch` of `device` ("cuda", "cuda:1", "cpu"; None: the CPU's)."""
        return self.image_batch["cuda" if device and device.startswith("cuda") else "cpu"]


RETRIEVAL = RetrievalPreset()


def _cell(value, inner: bool = False) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v, True)}" for k, v in value.items())
    if isinstance(value, tuple):
        return (" / " if inner else ", ").join(map(str, value))
    return str(value)


def markdown() -> str:
    """The table as Markdown: one row per field, its value and what it means."""
    rows = ["| field | value | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(RetrievalPreset):
        rows.append(f"| `{f.name}` | {_cell(getattr(RETRIEVAL, f.name))} | {f.metadata['doc']} |")
    return "\n".join(rows)
