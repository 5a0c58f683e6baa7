"""One retrieval call's query pipeline: encode -> compose -> gallery-aware scores -> top k [-> re-inspect].

    q = compose(image, text)                      engine.retrieval.compose
    then the method's options (engine.retrieval.options, one file each), their hooks in the table's order:
    gap:       image, text and gallery shifted along the gap vector before composing (gap-centre: centred)
    pic2word:  the text side from the prompt with the reference's pseudo-word (a trained mapping)
    hubness:   scores = scorer(q . G, per-item bank statistics)      (isoftmax, qbnorm, dual-softmax, csls)
    aqe:       q <- alpha_qe(q, its top n, similarities relative to the best one), scored again
    dba:       G <- DBA rows (stored at build time, else computed here)
    reinspect: the top R candidates re-scored with multi-view rows (views of every request of a
               batch decoded and embedded together)

The pipeline itself knows no option. It reads the index once, at set-up: its rows, its meta.json,
and the stored files each option asks for (`Option.reads`) or the text bank one needs. The
options never see the index: their hooks get a `Workspace` (the rows, that data, the towers and
what the hooks set), and the pipeline calls only the hooks an option defines (`Hooks`), in the
table's order (engine/retrieval/options/base.py lists them). Methods that need the call's own
requests (gap-centre with the requests' text mean, a hubness scorer with a requests bank) encode
every request of the call first (`prepare`), so the answers do not depend on batching or on
where a killed call resumed. Plain methods encode batch by batch, as before. `report()` says
what was used (bank source and size, means, re-inspection counts) for the run's summary.
`results` gives each request's rows as {"image_id", "score"} dicts, the rows a run writes.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.index import npy_from_bytes


class PipelineError(RuntimeError):
    """The method cannot run on this index (the message says what is missing)."""


def _log(msg: str) -> None:
    print(f"[cir_run] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class QuerySettings:
    """A pipeline's settings besides its method: `corpus`, the image files of re-inspecting methods
    (default: the index's); requests per bank-statistics block (0: the reference twin); whether
    records paths may leave the corpus folder; the re-inspection budget's hard limit per request
    (None: the method's own count)."""
    corpus: Path | None = None
    bank_chunk: int = RETRIEVAL.bank_chunk
    allow_outside_corpus: bool = False
    max_reinspect: int | None = None


@dataclass
class Call:
    """A call's requests as `prepare` encoded them: text rows [M, D], reference rows [M] (-1: none)
    and composed queries [M, D]; None when no option needed them."""
    requests: list
    texts: torch.Tensor | None = None
    refs: torch.Tensor | None = None
    queries: torch.Tensor | None = None


@dataclass
class Scored:
    """A batch's queries [B, D], their cosines with the gallery [B, N], scores [B, N] and the
    scorer's per-row decisions (engine.retrieval.rescore.RowState)."""
    q: torch.Tensor
    cos: torch.Tensor
    scores: torch.Tensor
    state: object


class Hooks:
    """The options of a method that define each hook (engine/retrieval/options/base.py), in the
    table's order, found once: `hooks.prepare` is the list of options with their own `prepare`."""

    def __init__(self, steps) -> None:
        from engine.retrieval.options.base import HOOKS, defines

        for name in HOOKS:
            setattr(self, name, [o for o in steps if defines(type(o), name)])


@dataclass
class Workspace:
    """What a method's options read and set for one pipeline, without the index itself: the
    index's meta.json and ids, the stored files the options asked for (`stored`: name -> bytes or
    None), the gallery rows at each stage (`raw` [N, D] as stored, `base` after `gallery_rows`
    (DBA), `gallery` in the comparison space (gap)), the towers, and what the hooks set (a
    mapping, means and the gap vector, bank statistics, a re-inspector). `info` feeds the report."""
    towers: object
    meta: dict
    ids: list
    raw: torch.Tensor
    k: int
    settings: QuerySettings
    warn: Callable[[str], None]
    hooks: Hooks
    scorer: object = None                 # the option that scores rows (row_state and scores: a hubness scorer)
    stored: dict = field(default_factory=dict)
    text_bank: torch.Tensor | None = None
    base: torch.Tensor | None = None
    gallery: torch.Tensor | None = None
    info: dict = field(default_factory=dict)
    mapping: object = None
    image_mean: torch.Tensor | None = None
    text_mean: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    stats: object = None
    reinspector: object = None

    Error = PipelineError

    @staticmethod
    def log(msg: str) -> None:
        _log(msg)

    def stored_rows(self, name: str) -> torch.Tensor | None:
        """The stored array file `name` (read at set-up) as FP32 rows on the towers' device, or None."""
        data = self.stored.get(name)
        if data is None:
            return None
        return torch.from_numpy(npy_from_bytes(data).astype(np.float32)).to(self.towers.device)

    def image_side(self, x: torch.Tensor) -> torch.Tensor:
        """Image rows [*, D] as the method compares them (gap-corrected when asked)."""
        for o in self.hooks.image_side:
            x = o.image_side(self, x)
        return x

    def text_side(self, t: torch.Tensor) -> torch.Tensor:
        """Text rows [*, D] as the method compares them (gap-corrected when asked)."""
        for o in self.hooks.text_side:
            t = o.text_side(self, t)
        return t

    def score(self, q: torch.Tensor, ref_t: torch.Tensor) -> Scored:
        """Queries q [B, D] scored against the gallery by the method's scorer (cosines without one)."""
        from engine.retrieval.rescore import RowState

        cos = q @ self.gallery.T                                           # [B, N] cosine similarities
        if self.scorer is None:
            return Scored(q, cos, cos, RowState())
        state = self.scorer.row_state(self, cos, ref_t)
        return Scored(q, cos, self.scorer.scores(self, cos, state), state)

    def scores_of_row(self, state, b: int, cos: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Scores [1, C] of batch row `b` from its cosines [1, C] with gallery columns cols [1, C]."""
        from engine.retrieval.rescore import RowState

        if self.scorer is None:
            return cos
        st = RowState(*(None if t is None else t[b:b + 1] for t in (state.normalised, state.r_q)))
        return self.scorer.scores(self, cos, st, cols)


class QueryPipeline:
    """`queries` names the requests' source in messages (`source:line: query ...`); `k`: results
    per request; `settings`: QuerySettings."""

    Error = PipelineError

    def __init__(self, index, towers, method, warn, queries: Path | str, k: int,
                 settings: QuerySettings = QuerySettings()):
        self.index, self.towers, self.method, self.warn, self.queries = index, towers, method, warn, queries
        steps = method.steps                                          # the options, in the table's order
        self.hooks = hooks = Hooks(steps)
        # [N, D] unit rows; FP16 on disk, FP32 for scoring (ties and order as the reference computes them)
        raw = torch.from_numpy(np.array(index.emb)).to(towers.device).float()   # copy: the mmap is read-only
        self.space = space = Workspace(towers, index.meta, index.ids, raw, min(k, len(index.ids)), settings, warn,
                                       hooks, scorer=next((o for o in steps if hasattr(o, "row_state")), None),
                                       info={"method_label": method.label})
        self.rows_of = index.row_of
        self.unreadable = {str(u.get("image_id")) for u in index.meta.get("unreadable", [])}
        self.cached: dict[str, torch.Tensor] = {}     # query_id -> [D] composed query (prepare)
        # the index read once: each option's stored files, the gallery-derived text bank if one needs it
        # (Index.extras: the bytes read and verified when the index was opened)
        space.stored = {name: index.extras.get(name) for o in hooks.reads for name in o.reads(index.meta)}
        if any(o.needs_text_bank() for o in hooks.needs_text_bank):
            space.stored["text_bank"] = index.extras.get("text_bank")
            space.text_bank = space.stored_rows("text_bank")
            if space.text_bank is None:
                _log("the index has no gallery-derived text bank (build with --mapping pic2word)")
        with self._naming_index():
            for o in hooks.load:
                o.load(space)
            base = raw
            for o in hooks.gallery_rows:
                base = o.gallery_rows(space, base)
            space.base = space.gallery = base       # gallery before / after the comparison space (gap)
            for o in hooks.setup:
                o.setup(space)

    @contextlib.contextmanager
    def _naming_index(self):
        """Where an option cannot run on this index, its one line names the index folder."""
        try:
            yield
        except PipelineError as e:
            raise PipelineError(f"{self.index.dir}: {e}") from None

    # ------------------------------------------------------------ set-up
    @property
    def k(self) -> int:
        return self.space.k

    @property
    def info(self) -> dict:
        return self.space.info

    # ------------------------------------------------------------ encoding
    def _refs(self, batch) -> torch.Tensor:
        ref = []
        for r in batch:
            row = self.rows_of.get(r.reference, -1) if r.reference is not None else -1
            if row < 0 and r.reference is not None:
                why = "was unreadable at build time" if r.reference in self.unreadable else "is not in the index"
                self.warn(f"{self.queries}:{r.line}: query {r.query_id!r}: reference image {r.reference!r} {why}; "
                          "answering from the text alone")
            ref.append(row)
        return torch.tensor(ref, dtype=torch.int64, device=self.towers.device)   # [B], -1 = none

    def _texts(self, batch, ref_t: torch.Tensor) -> torch.Tensor:
        """[B, D] unit text-side embeddings (an option may encode them its own way: pic2word)."""
        from engine.retrieval.compose import prompt_text

        m, towers = self.method, self.towers
        texts = [prompt_text(m, r.modification, r.shared_concept) for r in batch]
        tokens, cut = towers.tokenize(texts)
        for r, c in zip(batch, cut):
            if c:
                self.warn(f"{self.queries}:{r.line}: query {r.query_id!r}: prompt longer than "
                          f"{towers.spec.context_length} tokens; truncated")
        for o in self.hooks.encode_texts:
            out = o.encode_texts(self.space, batch, texts, ref_t)
            if out is not None:
                return out
        return towers.encode_tokens(tokens)

    def _compose(self, batch, text: torch.Tensor, ref_t: torch.Tensor) -> torch.Tensor:
        from engine.retrieval.compose import compose, text_weight

        raw, space = self.space.raw, self.space
        image = raw[ref_t.clamp(min=0)] if len(raw) else torch.zeros_like(text)
        image, text = space.image_side(image), space.text_side(text)
        weights = torch.tensor([text_weight(self.method, r.shared_concept) for r in batch], device=text.device)
        return compose(self.method, image, ref_t >= 0, text, weights)          # [B, D] unit rows

    def prepare(self, requests) -> None:
        """Per-call statistics (the options' `prepare` hooks), encoding every request first when an
        option needs them. Each call's prepare replaces the one before, so one pipeline serves call after call."""
        space, hooks = self.space, self.hooks
        self.cached = {}
        with self._naming_index():
            for o in hooks.begin_call:
                o.begin_call(space)
        call = Call(list(requests))
        if any(o.needs_requests(space) for o in hooks.needs_requests) and requests:
            t0 = time.perf_counter()
            texts, refs = [], []
            step = RETRIEVAL.query_batch
            for lo in range(0, len(requests), step):                   # every request of the call
                refs.append(self._refs(requests[lo:lo + step]))
                texts.append(self._texts(requests[lo:lo + step], refs[-1]))
            call.texts, call.refs = torch.cat(texts), torch.cat(refs)    # [M, D], [M]
            space.info["prepare_s"] = round(time.perf_counter() - t0, 3)
        for o in hooks.prepare_texts:
            o.prepare_texts(space, call)
        if call.texts is not None:
            call.queries = self._compose(requests, call.texts, call.refs)   # [M, D]
            self.cached = {str(r.query_id): q for r, q in zip(requests, call.queries)}
        for o in hooks.prepare:
            o.prepare(space, call)

    # ------------------------------------------------------------ answering
    def answer(self, batch) -> list[list[tuple[int, float]]]:
        """[(gallery row, score), ...] per request: at most k, best first, the reference excluded."""
        import functools

        from engine import settings as engine_settings
        from engine.retrieval.index import KERNEL_DIR
        from kernels.topk import to_host
        from kernels.topk import topk as kernel_topk

        space, hooks, k = self.space, self.hooks, self.space.k
        # topk(scores, k, exclude): the stored kernel compiled at build time, if any; KERNELS_TOPK: auto, cupy or torch
        topk = functools.partial(kernel_topk, backend=engine_settings.topk_backend(),
                                 stored=self.index.dir / KERNEL_DIR, backend_from="KERNELS_TOPK")

        ref_t = self._refs(batch) if not self.cached else torch.tensor(
            [self.rows_of.get(r.reference, -1) if r.reference is not None else -1 for r in batch],
            dtype=torch.int64, device=self.towers.device)
        if self.cached:
            q = torch.stack([self.cached[str(r.query_id)] for r in batch])
        else:
            q = self._compose(batch, self._texts(batch, ref_t), ref_t)
        scored = space.score(q, ref_t)
        for o in hooks.expand:
            scored = o.expand(space, scored, ref_t, topk)
        depth = min(max(k, *(o.depth(space) for o in hooks.depth), 0), len(space.ids))
        vals, idx = topk(scored.scores, depth, ref_t)                      # [B, depth] each
        for o in hooks.rescore:
            vals, idx = o.rescore(space, batch, scored, vals, idx)
        out = []
        vals, idx = to_host(vals[:, :k], idx[:, :k])                       # one host sync for both
        for vs, js in zip(vals.tolist(), idx.tolist()):
            out.append([(j, v) for v, j in zip(vs, js) if j >= 0 and np.isfinite(v)])
        return out

    def results(self, batch) -> list[list[dict]]:
        """Each request's rows as a run writes them: {"image_id" (as the index holds it), "score"}, best first."""
        ids = self.space.ids
        return [[{"image_id": ids[j], "score": v} for j, v in hits if math.isfinite(v)] for hits in self.answer(batch)]

    def report(self) -> dict:
        from engine.retrieval.options import summaries

        out = dict(self.space.info)
        out.update(summaries(self.space))
        return out
