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

The pipeline itself knows no option: it holds the rows and the call, and asks each option of the
method (`Method.steps`) at its hooks (engine/retrieval/options/base.py lists them). Methods that
need the call's own requests (gap-centre with the requests' text mean, a hubness scorer with a
requests bank) encode every request of the call first (`prepare`), so the answers do not depend
on batching or on where a killed call resumed. Plain methods encode batch by batch, as before.
`report()` says what was used (bank source and size, means, re-inspection counts) for the run's
summary. `results` gives each request's rows as {"image_id", "score"} dicts, the rows a run writes.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
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


class QueryPipeline:
    """`queries` names the requests' source in messages (`source:line: query ...`); `k`: results
    per request; `settings`: QuerySettings."""

    Error = PipelineError

    def __init__(self, index, towers, method, warn, queries: Path | str, k: int,
                 settings: QuerySettings = QuerySettings()):
        self.index, self.towers, self.method, self.warn, self.queries = index, towers, method, warn, queries
        self.k = min(k, len(index.ids))
        self.corpus, self.bank_chunk = settings.corpus, settings.bank_chunk
        self.allow_outside_corpus = settings.allow_outside_corpus   # records paths may leave the corpus folder
        self.max_reinspect = settings.max_reinspect
        self.steps = method.steps                                     # the options, in the table's order
        # the method's scorer: the option that scores rows (row_state and scores: a hubness scorer)
        self.scorer = next((o for o in self.steps if hasattr(o, "row_state")), None)
        dev = towers.device
        # [N, D] unit rows; FP16 on disk, FP32 for scoring (ties and order as the reference computes them)
        self.raw = torch.from_numpy(np.array(index.emb)).to(dev).float()   # copy: the mmap is read-only
        self.rows_of = index.rows()
        self.unreadable = {str(u.get("image_id")) for u in index.meta.get("unreadable", [])}
        self.info: dict = {"method_label": method.label}
        self.cached: dict[str, torch.Tensor] = {}     # query_id -> [D] composed query (prepare)
        # what the options' hooks set: the mapping, the means and gap vector, bank statistics, re-inspector
        self.mapping = self.image_mean = self.text_mean = self.delta = self.stats = self.reinspector = None
        for o in self.steps:
            o.load(self)
        self.text_bank = self._load_text_bank() if any(o.needs_text_bank() for o in self.steps) else None
        base = self.raw
        for o in self.steps:
            base = o.gallery_rows(self, base)
        self.base = self.gallery = base            # gallery before / after the comparison space (gap)
        for o in self.steps:
            o.setup(self)

    # ------------------------------------------------------------ set-up
    @staticmethod
    def log(msg: str) -> None:
        _log(msg)

    def extra_rows(self, name: str) -> torch.Tensor | None:
        """The index's extra array file `name` (text_bank, dba) as FP32 rows on the towers' device, or None."""
        data = self.index.extra_bytes(name)
        if data is None:
            return None
        return torch.from_numpy(npy_from_bytes(data).astype(np.float32)).to(self.towers.device)

    def _load_text_bank(self) -> torch.Tensor | None:
        bank = self.extra_rows("text_bank")
        if bank is None:
            _log("the index has no gallery-derived text bank (build with --mapping pic2word)")
        return bank

    def image_side(self, x: torch.Tensor) -> torch.Tensor:
        """Image rows [*, D] as the method compares them (gap-corrected when asked)."""
        for o in self.steps:
            x = o.image_side(self, x)
        return x

    def text_side(self, t: torch.Tensor) -> torch.Tensor:
        """Text rows [*, D] as the method compares them (gap-corrected when asked)."""
        for o in self.steps:
            t = o.text_side(self, t)
        return t

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
        for o in self.steps:
            out = o.encode_texts(self, batch, texts, ref_t)
            if out is not None:
                return out
        return towers.encode_tokens(tokens)

    def _compose(self, batch, text: torch.Tensor, ref_t: torch.Tensor) -> torch.Tensor:
        from engine.retrieval.compose import compose, text_weight

        image = self.raw[ref_t.clamp(min=0)] if len(self.raw) else torch.zeros_like(text)
        image, text = self.image_side(image), self.text_side(text)
        weights = torch.tensor([text_weight(self.method, r.shared_concept) for r in batch], device=text.device)
        return compose(self.method, image, ref_t >= 0, text, weights)          # [B, D] unit rows

    def prepare(self, requests) -> None:
        """Per-call statistics (the options' `prepare` hooks), encoding every request first when an
        option needs them. Each call's prepare replaces the one before, so one pipeline serves call after call."""
        self.cached = {}
        for o in self.steps:
            o.begin_call(self)
        call = Call(list(requests))
        if any(o.needs_requests(self) for o in self.steps) and requests:
            t0 = time.perf_counter()
            texts, refs = [], []
            step = RETRIEVAL.query_batch
            for lo in range(0, len(requests), step):                   # every request of the call
                refs.append(self._refs(requests[lo:lo + step]))
                texts.append(self._texts(requests[lo:lo + step], refs[-1]))
            call.texts, call.refs = torch.cat(texts), torch.cat(refs)    # [M, D], [M]
            self.info["prepare_s"] = round(time.perf_counter() - t0, 3)
        for o in self.steps:
            o.prepare_texts(self, call)
        if call.texts is not None:
            call.queries = self._compose(requests, call.texts, call.refs)   # [M, D]
            self.cached = {str(r.query_id): q for r, q in zip(requests, call.queries)}
        for o in self.steps:
            o.prepare(self, call)

    # ------------------------------------------------------------ answering
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

    def answer(self, batch) -> list[list[tuple[int, float]]]:
        """[(gallery row, score), ...] per request: at most k, best first, the reference excluded."""
        from engine import settings as engine_settings
        from engine.retrieval.index import KERNEL_DIR
        from kernels.topk import to_host
        from kernels.topk import topk as kernel_topk

        stored = self.index.dir / KERNEL_DIR                               # compiled at build time, if any
        backend = engine_settings.topk_backend()                           # KERNELS_TOPK: auto, cupy or torch

        def topk(scores, k, exclude):
            return kernel_topk(scores, k, exclude, backend=backend, stored=stored, backend_from="KERNELS_TOPK")

        ref_t = self._refs(batch) if not self.cached else torch.tensor(
            [self.rows_of.get(r.reference, -1) if r.reference is not None else -1 for r in batch],
            dtype=torch.int64, device=self.towers.device)
        if self.cached:
            q = torch.stack([self.cached[str(r.query_id)] for r in batch])
        else:
            q = self._compose(batch, self._texts(batch, ref_t), ref_t)
        scored = self.score(q, ref_t)
        for o in self.steps:
            scored = o.expand(self, scored, ref_t, topk)
        depth = min(max(self.k, *(o.depth(self) for o in self.steps), 0), len(self.index.ids))
        vals, idx = topk(scored.scores, depth, ref_t)                      # [B, depth] each
        for o in self.steps:
            vals, idx = o.rescore(self, batch, scored, vals, idx)
        out = []
        vals, idx = to_host(vals[:, :self.k], idx[:, :self.k])             # one host sync for both
        for vs, js in zip(vals.tolist(), idx.tolist()):
            out.append([(j, v) for v, j in zip(vs, js) if j >= 0 and np.isfinite(v)])
        return out

    def results(self, batch) -> list[list[dict]]:
        """Each request's rows as a run writes them: {"image_id" (as the index holds it), "score"}, best first."""
        ids = self.index.ids
        return [[{"image_id": ids[j], "score": v} for j, v in hits if math.isfinite(v)] for hits in self.answer(batch)]

    def report(self) -> dict:
        from engine.retrieval.options import OPTIONS

        out = dict(self.info)
        for cls in OPTIONS.values():
            out.update(cls.summary(self))
        return out
