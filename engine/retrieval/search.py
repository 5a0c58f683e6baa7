"""Retrieval in this process: a committed index opened with the CLIP that built it.

    import engine.retrieval

    idx = engine.retrieval.open_index("cir/index")      # the CLIP: clip_dir, CLIP_MODEL_DIR, or the index's own
    hits = idx.search(1234, "make it red", shared_concept=None, k=50, method="slerp")
    # [{"image_id": ..., "score": ...}, ...]: best first, at most k, the reference left out
    rows = idx.search_many([{"query_id": 7, "reference_image_id": 1234, "relative_caption": "..."}])

`search_many` takes request objects as the requests JSONL holds them (engine.retrieval.jsonl:
query_id, reference_image_id, modification or its synonyms, shared_concept) and answers
them as one call: its rows are the ones scripts/run.sh writes for the same requests, method
and k (the same pipeline, engine.retrieval.query, batch by batch, `batch_size` requests per
batch). `search` is a call of one request: the row run.sh --batch-size 1 writes for it (a
larger batch is rounded differently by the CPU's BLAS, by ~1e-7). Methods are named as scripts/run.sh --method names
them (engine.retrieval.compose); each (method, k) keeps its pipeline for the next call.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.presets.retrieval import RETRIEVAL

DEFAULT_K = RETRIEVAL.top_k   # results per request unless asked


@dataclass(frozen=True)
class SearchSettings:
    """A Searcher's settings: `corpus`, image files for re-inspecting methods (default: the
    index's); records paths confined to the corpus; requests per batch; bank queries per block of
    the streamed bank statistics; `warn` (default: stderr); the re-inspection limit per request;
    `source`, how warnings name the requests."""
    corpus: Path | None = None
    confine_to_corpus: bool = False
    batch_size: int = RETRIEVAL.query_batch
    bank_chunk: int = RETRIEVAL.bank_chunk
    warn: object = None
    max_reinspect: int | None = None
    source: str | os.PathLike = "requests"


@dataclass(frozen=True)
class ClipChoice:
    """How clip_for picks and loads an index's CLIP besides its folder: the folder used when none
    is named and it exists, CLIP_DEVICE / CLIP_PRECISION's values, the architecture of a bare state
    dict, whether a CLIP other than the index's is accepted (said through `say`), and the hint
    that ends the refusal otherwise."""
    default_clip_dir: Path | None = None
    device: str | None = None
    precision: str | None = None
    model_name: str | None = None
    allow_model_mismatch: bool = False
    say: object = None
    mismatch_hint: str = "pass allow_model_mismatch=True to search anyway"


class Searcher:
    """An open index: `index` (engine.retrieval.index.Index), `towers` (engine.clip.towers.ClipTowers)
    and `info`, engine.clip.load's record of their CLIP; `settings`: SearchSettings."""

    def __init__(self, index, towers, info: dict, settings: SearchSettings = SearchSettings()):
        from engine.retrieval.jsonl import stderr_warn

        self.index, self.towers, self.info = index, towers, info
        self.corpus, self.batch_size, self.bank_chunk = settings.corpus, settings.batch_size, settings.bank_chunk
        # records paths are followed as the build followed them, unless confined (here or at build time)
        self.confine = settings.confine_to_corpus or bool(index.meta.get("confine_to_corpus"))
        self.warn = settings.warn or stderr_warn("retrieval")
        # source: how warnings name the requests
        self.max_reinspect, self.source = settings.max_reinspect, settings.source
        self._pipelines: dict[tuple[str, int], object] = {}

    def pipeline(self, method, k: int = DEFAULT_K):
        """The query pipeline (engine.retrieval.query.QueryPipeline) of `method` (a name or a
        compose.Method) and `k`, made once and kept: prepare(requests), then results(batch)."""
        from engine.retrieval.compose import Method, make_method
        from engine.retrieval.query import QueryPipeline, QuerySettings

        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        m = method if isinstance(method, Method) else make_method(method, max_reinspect=self.max_reinspect)
        key = (m.label, json.dumps(m.to_dict(), sort_keys=True), k)   # the label names options without record fields
        if key not in self._pipelines:
            settings = QuerySettings(self.corpus, self.bank_chunk, not self.confine, self.max_reinspect)
            self._pipelines[key] = QueryPipeline(self.index, self.towers, m, self.warn, self.source, k, settings)
        return self._pipelines[key]

    def search(self, reference_image_id, modification: str, shared_concept: str | None = None,
               k: int = DEFAULT_K, method=RETRIEVAL.method) -> list[dict]:
        """One request's rows: [{"image_id", "score"}, ...], best first, at most k. A reference
        of None (or one the index lacks, said on stderr) answers from the text alone."""
        from engine.retrieval.jsonl import Request, is_id

        if reference_image_id is not None and not is_id(reference_image_id):
            raise TypeError(f"reference_image_id must be a str or int id (or None), got {reference_image_id!r}")
        if not isinstance(modification, str):
            raise TypeError(f"modification must be a str, got {type(modification).__name__}")
        if shared_concept is not None and not isinstance(shared_concept, str):
            raise TypeError(f"shared_concept must be a str or None, got {type(shared_concept).__name__}")
        ref = None if reference_image_id is None else str(reference_image_id)
        return self._call([Request(1, 0, ref, modification, shared_concept or None)], k, method)[0]

    def search_many(self, requests, k: int = DEFAULT_K, method=RETRIEVAL.method) -> list[list[dict]]:
        """Each request's rows, in request order. `requests`: objects as the requests JSONL holds
        them; one without a query_id takes its position. ValueError for a request that is not an
        object, or a query_id given twice."""
        from engine.retrieval.jsonl import parse_request

        parsed, seen = [], {}
        for i, obj in enumerate(requests):
            if not isinstance(obj, dict):
                raise ValueError(f"requests[{i}]: expected a dict, got {type(obj).__name__}")
            r = parse_request(obj, f"requests[{i}]", self.warn, line=i + 1, query_id=i)
            if r is None:
                raise ValueError(f"requests[{i}]: no usable query_id (a str or int)")
            if str(r.query_id) in seen:
                raise ValueError(f"requests[{i}]: query_id {r.query_id!r} also at requests[{seen[str(r.query_id)]}]")
            seen[str(r.query_id)] = i
            parsed.append(r)
        return self._call(parsed, k, method)

    def _call(self, requests, k: int, method) -> list[list[dict]]:
        pipe = self.pipeline(method, k)
        pipe.prepare(requests)
        out: list[list[dict]] = []
        for lo in range(0, len(requests), self.batch_size):
            out += pipe.results(requests[lo:lo + self.batch_size])
        return out


def clip_for(index, clip_dir: str | os.PathLike | None = None, choice: ClipChoice = ClipChoice()):
    """(towers, info): the CLIP of `index` loaded on its device, with the device's thread budget
    applied. The folder: engine.retrieval.index_clip.resolve (`clip_dir`, else CLIP_MODEL_DIR,
    else `choice.default_clip_dir` when it exists, else the folder the index records when its
    digest matches). A CLIP other than the index's is a ClipLoadError ending in
    `choice.mismatch_hint`, unless `choice.allow_model_mismatch` (then a warning through
    `choice.say`). The towers the index records (meta.json `towers`,
    engine.clip.tune.load_recorded) are loaded, never compiled."""
    from engine import threads
    from engine.clip.load import ClipLoadError, load_clip
    from engine.clip.towers import ClipTowers
    from engine.retrieval.index_clip import mismatch, resolve

    say, model_name = choice.say or _say, choice.model_name
    model, spec, info = load_clip(resolve(clip_dir, index.meta, choice.default_clip_dir, model_name, say), model_name)
    msg = mismatch(index.meta, info)
    if msg and not choice.allow_model_mismatch:
        raise ClipLoadError(f"{msg}; {choice.mismatch_hint}")
    if msg:
        say(f"warning: {msg}")
    towers = ClipTowers(model, spec, choice.device, choice.precision)
    threads.apply_torch(threads.budget(towers.device.type))
    if not msg:   # the recorded towers hold the build's weights: only for the CLIP that built the index
        from engine.clip.tune import load_recorded

        towers = load_recorded(towers, Path(index.dir), index.meta.get("towers"), say)
    return towers, info


def searcher_for(index, clip_dir: str | os.PathLike | None, choice: ClipChoice,
                 settings: SearchSettings = SearchSettings()) -> Searcher:
    """A Searcher over the loaded `index` with its CLIP (clip_for's `clip_dir` and `choice`)."""
    towers, info = clip_for(index, clip_dir, choice)
    return Searcher(index, towers, info, settings)


def _say(msg: str) -> None:
    import sys

    print(f"[retrieval] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class OpenOptions:
    """open_index's keyword arguments (a name it does not know is a TypeError, as for any function)."""
    device: str | None = None
    precision: str | None = None
    model_name: str | None = None
    corpus: str | os.PathLike | None = None
    confine_to_corpus: bool = False
    allow_model_mismatch: bool = False
    batch_size: int = RETRIEVAL.query_batch


def open_index(index_dir: str | os.PathLike, clip_dir: str | os.PathLike | None = None, **options) -> Searcher:
    """The index in `index_dir` with its CLIP loaded (clip_for: `clip_dir`, else CLIP_MODEL_DIR,
    else the folder the index records when its digest matches). Keyword options (OpenOptions):
    `device` / `precision` as CLIP_DEVICE / CLIP_PRECISION; `model_name` for a bare state dict;
    `corpus`: image files for re-inspecting methods (default: the index's), `confine_to_corpus`;
    `batch_size`: requests per batch. IndexLoadError / ClipLoadError say what is missing; a CLIP
    other than the index's is a ClipLoadError unless `allow_model_mismatch=True`."""
    from engine.retrieval.index import load_index

    o = OpenOptions(**options)
    choice = ClipChoice(device=o.device, precision=o.precision, model_name=o.model_name,
                        allow_model_mismatch=o.allow_model_mismatch)
    corpus = Path(o.corpus) if o.corpus is not None else None
    return searcher_for(load_index(index_dir), clip_dir, choice, SearchSettings(corpus, o.confine_to_corpus,
                                                                                   o.batch_size))
