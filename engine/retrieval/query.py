"""One retrieval call's query pipeline: encode -> compose -> gallery-aware scores -> top k [-> re-inspect].

    q = compose(image, text)                      engine.retrieval.compose (pic2word: the pseudo-word prompt)
    gap:      image, text and gallery shifted along the gap vector before composing  engine.retrieval.gap
              (gap-centre: each centred on its modality's mean)
    hubness:  scores = scorer(q . G, per-item bank statistics)      engine.retrieval.rescore
    aqe:      q <- alpha_qe(q, its top n, similarities relative to the best one), scored again
    dba:      G <- DBA rows (stored at build time, else computed here)
    reinspect: the top R candidates re-scored with multi-view rows  engine.retrieval.reinspect
              (views of every request of a batch decoded and embedded together)

Methods that need the call's own requests (gap-centre with the requests' text mean, a hubness
scorer with a requests bank) encode every request of the call first (`prepare`), so the
answers do not depend on batching or on where a killed call resumed. Plain methods encode
batch by batch, as before. `report()` says what was used (bank source and size, means,
re-inspection counts) for the run's summary. `results` gives each request's rows as
{"image_id", "score"} dicts, the rows a run writes.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.index import npy_from_bytes

GAP_MIN_TEXTS = RETRIEVAL.gap_min_texts   # fewer request texts than this make no text mean (said on stderr)


class PipelineError(RuntimeError):
    """The method cannot run on this index (the message says what is missing)."""


def _log(msg: str) -> None:
    print(f"[cir_run] {msg}", file=sys.stderr, flush=True)


class _Lookup(dict):
    """image id -> records path; a missing id is a KeyError naming it (the image fails alone)."""

    def __missing__(self, key):
        raise KeyError(f"image {key!r} has no record in the corpus")


class QueryPipeline:
    """`queries` names the requests' source in messages (`source:line: query ...`); `k`: results
    per request; `max_reinspect`: the re-inspection budget's hard limit per request (None: the
    method's own count)."""

    def __init__(self, index, towers, method, warn, queries: Path | str, corpus: Path | None, k: int,
                 bank_chunk: int = RETRIEVAL.bank_chunk, allow_outside_corpus: bool = False, max_reinspect: int | None = None):
        from engine.retrieval.rescore import center

        self.index, self.towers, self.method, self.warn, self.queries = index, towers, method, warn, queries
        self.k = min(k, len(index.ids))
        self.max_reinspect = max_reinspect
        dev = towers.device
        # [N, D] unit rows; FP16 on disk, FP32 for scoring (ties and order as the reference computes them)
        self.raw = torch.from_numpy(np.array(index.emb)).to(dev).float()   # copy: the mmap is read-only
        self.rows_of = index.rows()
        self.unreadable = {str(u.get("image_id")) for u in index.meta.get("unreadable", [])}
        self.info: dict = {"method_label": method.label}
        self.cached: dict[str, torch.Tensor] = {}     # query_id -> [D] composed query (prepare)
        self.bank_chunk = bank_chunk        # requests per bank-statistics block; 0: the reference twin
        self.allow_outside_corpus = allow_outside_corpus   # records paths may leave the corpus folder
        self.mapping = self._load_mapping() if method.name == "pic2word" else None
        self.text_bank = self._load_text_bank() if method.gap in ("bank", "both") or (
            method.hubness and method.bank in ("gallery", "both")) else None
        self.base = self._dba() if method.dba else self.raw             # gallery before gap correction
        self.image_mean = self.text_mean = self.delta = None
        if method.gap and method.gap_mode == "shift":
            self.image_mean = self._image_mean()
            self.delta = self._gap_vector()
            self.gallery = self.image_side(self.base)
        elif method.gap:
            self.image_mean = self._image_mean()
            self.gallery = center(self.base, self.image_mean)
        else:
            self.gallery = self.base
        self.stats = None
        self.reinspector = self._reinspector(corpus) if method.reinspect else None

    # ------------------------------------------------------------ set-up
    def _load_mapping(self):
        from safetensors.torch import load

        from engine.retrieval.pic2word import load_mapping

        data, meta = self.index.extra_bytes("pic2word"), self.index.meta.get("pic2word")
        if data is None or meta is None:
            raise PipelineError(f"method pic2word: the index in {self.index.dir} has no mapping; "
                                "build it with scripts/build.sh ... --mapping pic2word")
        self.info["pic2word"] = {k: meta.get(k) for k in ("steps", "final_loss", "seed", "stopped_early")}
        return load_mapping(load(data), meta).to(self.towers.device)

    def _load_text_bank(self) -> torch.Tensor | None:
        data = self.index.extra_bytes("text_bank")
        if data is None:
            _log("the index has no gallery-derived text bank (build with --mapping pic2word)")
            return None
        return torch.from_numpy(npy_from_bytes(data).astype(np.float32)).to(self.towers.device)

    def _dba(self) -> torch.Tensor:
        from engine.retrieval.rescore import dba

        m, stored = self.method, self.index.meta.get("dba") or {}
        data = self.index.extra_bytes("dba")
        if stored.get("n") == m.dba and stored.get("alpha") == m.dba_alpha and data is not None:
            self.info["dba"] = "stored at build time"
            return torch.from_numpy(npy_from_bytes(data).astype(np.float32)).to(self.raw.device)
        t0 = time.perf_counter()
        out = dba(self.raw, m.dba, m.dba_alpha, chunk=RETRIEVAL.dba_chunk if self.bank_chunk else 0)
        _log(f"DBA n={m.dba} alpha={m.dba_alpha:g} is not stored in the index (build --dba {m.dba} "
             f"--dba-alpha {m.dba_alpha:g} stores it): computed here in {time.perf_counter() - t0:.2f} s")
        self.info["dba"] = "computed at query time"
        return out

    def _image_mean(self) -> torch.Tensor:
        stored = self.index.meta.get("gallery_mean")
        if stored and self.base is self.raw:
            self.info["image_mean"] = "stored at build time"
            return torch.tensor(stored, dtype=torch.float32, device=self.raw.device)
        self.info["image_mean"] = "computed from the gallery rows" + (" (DBA)" if self.method.dba else "")
        if not stored and self.base is self.raw:
            _log("the index has no stored gallery mean (built before it was recorded): computing it")
        return self.base.mean(0)

    def _gap_vector(self) -> torch.Tensor:
        """[D] image mean - text mean for the gap shift; neither depends on the call's requests."""
        from engine.retrieval.gap import CAPTIONS, gap_vector

        if self.method.gap == "bank" and self.text_bank is not None:
            self.text_mean = self.text_bank.mean(0)
            self.info["text_mean"] = f"{len(self.text_bank)} gallery-derived texts"
        else:
            if self.method.gap == "bank":
                _log("gap shift: no gallery-derived text bank; using the fixed caption set's text mean")
            tokens, _ = self.towers.tokenize(list(CAPTIONS))
            self.text_mean = self.towers.encode_tokens(tokens).float().mean(0)
            self.info["text_mean"] = f"{len(CAPTIONS)} fixed captions (engine.retrieval.gap)"
        delta = gap_vector(self.image_mean, self.text_mean)
        self.info["gap_norm"] = round(float(delta.norm()), 4)
        return delta

    def image_side(self, x: torch.Tensor) -> torch.Tensor:
        """Image rows [*, D] as the method compares them (gap-corrected when asked)."""
        from engine.retrieval.gap import shift
        from engine.retrieval.rescore import center

        if self.delta is not None:
            return shift(x, self.delta, toward_text=True, lam=self.method.gap_shift)
        return center(x, self.image_mean) if self.image_mean is not None else x

    def text_side(self, t: torch.Tensor) -> torch.Tensor:
        """Text rows [*, D] as the method compares them (gap-corrected when asked)."""
        from engine.retrieval.gap import shift
        from engine.retrieval.rescore import center

        if self.delta is not None:
            return shift(t, self.delta, toward_text=False, lam=self.method.gap_shift)
        return center(t, self.text_mean) if self.text_mean is not None else t

    def _reinspector(self, corpus: Path | None):
        from engine.retrieval.jsonl import read_records, record_reader
        from engine.retrieval.reinspect import Reinspector

        meta = self.index.meta
        root = corpus or (Path(meta["corpus"]) if meta.get("corpus") else
                          Path(meta["records"]["path"]).parent if meta.get("records", {}).get("path") else None)
        records = root / "records.jsonl" if root else None
        if records is None or not records.is_file():
            _log(f"re-inspection off: no corpus records at {records} (pass --corpus DIR)")
            self.info["reinspection"] = f"off: no records.jsonl at {records}"
            return None
        try:
            paths = {str(r.image_id): r.path for r in read_records(records, self.warn)}
        except (OSError, ValueError) as e:
            raise PipelineError(f"re-inspection: cannot read {records}: {e}") from None
        ids = self.index.ids
        # the same rule as the build: regular files where the records lead, unless confined to the corpus
        read_path = record_reader(root, _Lookup(paths), confine=not self.allow_outside_corpus)

        def read(row: int) -> bytes:
            return read_path(str(ids[row]))

        from engine import settings as engine_settings
        from engine import threads
        from engine.decoders import default_decoder

        # the decoder that built the gallery, so a view and a stored row come from the same pixels
        decoder = self.index.meta.get("decoder") or default_decoder(self.towers.device.type)
        budget = threads.budget(self.towers.device.type)
        self.info["reinspection"] = (f"{self.method.reinspect} candidates x {self.method.crops} views, "
                                     f"decoder {decoder}, corpus {root}")
        return Reinspector(read, self.towers.encode_images, self.towers.spec.image, self.method.crops,
                           self._reinspect_budget(), decoder,
                           batch_size=RETRIEVAL.image_batch_for(self.towers.device.type),
                           readers=budget.readers, isolate=engine_settings.decoder_isolate())

    def _reinspect_budget(self):
        from engine.retrieval.reinspect import ReinspectBudget

        return ReinspectBudget(self.method.reinspect, self.max_reinspect)

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
        """[B, D] unit text-side embeddings (pic2word: the pseudo-word prompt where there is a reference)."""
        from engine.retrieval.compose import make_method, prompt_text

        m, towers = self.method, self.towers
        texts = [prompt_text(m, r.modification, r.shared_concept) for r in batch]
        tokens, cut = towers.tokenize(texts)
        for r, c in zip(batch, cut):
            if c:
                self.warn(f"{self.queries}:{r.line}: query {r.query_id!r}: prompt longer than "
                          f"{towers.spec.context_length} tokens; truncated")
        if self.mapping is None:
            return towers.encode_tokens(tokens)
        from engine.retrieval.pic2word import encode_prompts

        has = (ref_t >= 0).tolist()
        out = torch.empty(len(batch), towers.spec.embed_dim, device=towers.device)
        if any(has):
            sel = [i for i, h in enumerate(has) if h]
            out[sel] = encode_prompts(towers, self.mapping, self.raw[ref_t[sel]], [texts[i] for i in sel])
        if not all(has):             # no image for the pseudo-word: the bare modification alone
            plain = make_method("text-only")
            sel = [i for i, h in enumerate(has) if not h]
            out[sel] = towers.encode_texts([prompt_text(plain, batch[i].modification, None) for i in sel])
        return out

    def _compose(self, batch, text: torch.Tensor, ref_t: torch.Tensor) -> torch.Tensor:
        from engine.retrieval.compose import compose, text_weight

        image = self.raw[ref_t.clamp(min=0)] if len(self.raw) else torch.zeros_like(text)
        if self.method.gap:
            image, text = self.image_side(image), self.text_side(text)
        weights = torch.tensor([text_weight(self.method, r.shared_concept) for r in batch], device=text.device)
        return compose(self.method, image, ref_t >= 0, text, weights)          # [B, D] unit rows

    def prepare(self, requests) -> None:
        """Per-call statistics: the text mean, the hubness bank (encoding every request when needed).
        Each call's prepare replaces the one before, so one pipeline serves call after call."""
        from engine.retrieval.rescore import bank_stats

        self.cached = {}
        if self.reinspector is not None:           # each call's requests start with their whole budget
            self.reinspector.budget = self._reinspect_budget()
        m, bank = self.method, self.text_bank
        centre = m.gap_mode == "centre"
        use_requests_mean = centre and (m.gap in ("requests", "both") or (m.gap == "bank" and bank is None))
        if m.hubness and m.bank in ("gallery", "both") and bank is None:
            raise PipelineError(f"{m.hubness}: bank={m.bank} needs the index's gallery-derived text bank, which "
                                f"{self.index.dir} lacks (build it with --mapping pic2word), or name bank=requests "
                                "(transductive: each answer then depends on the call's other requests)")
        use_requests_bank = bool(m.hubness) and m.bank in ("requests", "both")   # only when named: transductive
        text_all = ref_all = None
        if (use_requests_mean or use_requests_bank) and requests:
            t0 = time.perf_counter()
            texts, refs = [], []
            step = RETRIEVAL.query_batch
            for lo in range(0, len(requests), step):                   # every request of the call
                refs.append(self._refs(requests[lo:lo + step]))
                texts.append(self._texts(requests[lo:lo + step], refs[-1]))
            text_all, ref_all = torch.cat(texts), torch.cat(refs)       # [M, D], [M]
            self.info["prepare_s"] = round(time.perf_counter() - t0, 3)
        if m.gap and centre:
            means, src = [], []
            if use_requests_mean and text_all is not None and len(text_all) >= GAP_MIN_TEXTS:
                means.append(text_all.mean(0))
                src.append(f"{len(text_all)} request texts")
            elif use_requests_mean:
                _log(f"gap correction: {len(requests)} request texts are too few for a text mean "
                     f"(< {GAP_MIN_TEXTS}); texts are not centred")
            if m.gap in ("bank", "both") and bank is not None:
                means.append(bank.mean(0))
                src.append(f"{len(bank)} gallery-derived texts")
            if m.gap == "captions":
                from engine.retrieval.gap import CAPTIONS

                means.append(self.towers.encode_tokens(self.towers.tokenize(list(CAPTIONS))[0]).float().mean(0))
                src.append(f"{len(CAPTIONS)} fixed captions (engine.retrieval.gap)")
            self.text_mean = torch.stack(means).mean(0) if means else None
            self.info["text_mean"] = " + ".join(src) or "none"
        q_all = None
        if text_all is not None:
            q_all = self._compose(requests, text_all, ref_all)            # [M, D]
            self.cached = {str(r.query_id): q for r, q in zip(requests, q_all)}
        if m.hubness:
            parts, src, ex = [], [], []
            if use_requests_bank and q_all is not None:
                parts.append(q_all)
                ex.append(ref_all)
                src.append(f"{len(q_all)} request queries")
            if bank is not None and m.bank in ("gallery", "both"):
                tb = self.text_side(bank) if m.gap else bank
                parts.append(tb)
                rows = (self.index.meta.get("text_bank") or {}).get("rows")   # each text's own gallery row
                if not isinstance(rows, list) or len(rows) != len(tb):
                    _log("the gallery text bank does not record its gallery rows (an older build: rebuild "
                         "the extras to mask them); its self-matches are not masked")
                    rows = [-1] * len(tb)
                ex.append(torch.tensor(rows, dtype=torch.int64, device=tb.device))
                src.append(f"{len(tb)} gallery-derived texts")
            if not parts:
                raise PipelineError(f"{m.hubness}: no query bank (no requests and no stored text bank)")
            self.stats = bank_stats(m.hubness, torch.cat(parts), self.gallery, m.beta, m.temp, m.csls_k,
                                    torch.cat(ex), has_queries=use_requests_bank, chunk=self.bank_chunk)
            self.info["bank"] = " + ".join(src)

    # ------------------------------------------------------------ answering
    def _score(self, q: torch.Tensor, ref_t: torch.Tensor):
        from engine.retrieval.rescore import row_state, score_cos

        m = self.method
        cos = q @ self.gallery.T                                           # [B, N] cosine similarities
        state = row_state(m.hubness, cos, self.stats, m.csls_k, ref_t)
        return cos, score_cos(m.hubness, cos, self.stats, state, None, m.beta, m.temp), state

    def answer(self, batch) -> list[list[tuple[int, float]]]:
        """[(gallery row, score), ...] per request: at most k, best first, the reference excluded."""
        from engine import settings as engine_settings
        from engine.retrieval.index import KERNEL_DIR
        from engine.retrieval.rescore import alpha_qe
        from kernels.topk import to_host
        from kernels.topk import topk as kernel_topk

        stored = self.index.dir / KERNEL_DIR                               # compiled at build time, if any
        backend = engine_settings.topk_backend()                           # KERNELS_TOPK: auto, cupy or torch

        def topk(scores, k, exclude):
            return kernel_topk(scores, k, exclude, backend=backend, stored=stored, backend_from="KERNELS_TOPK")

        m = self.method
        ref_t = self._refs(batch) if not self.cached else torch.tensor(
            [self.rows_of.get(r.reference, -1) if r.reference is not None else -1 for r in batch],
            dtype=torch.int64, device=self.towers.device)
        if self.cached:
            q = torch.stack([self.cached[str(r.query_id)] for r in batch])
        else:
            q = self._compose(batch, self._texts(batch, ref_t), ref_t)
        cos, scores, state = self._score(q, ref_t)
        if m.aqe:
            _, nb = topk(scores, min(m.aqe, self.k), ref_t)                # [B, n] (-1 padded)
            ok = (nb >= 0).unsqueeze(-1)
            sims = cos.gather(1, nb.clamp(min=0)).clamp(min=0) * ok.squeeze(-1)
            # scale-free weights: each neighbour's cosine relative to the best one's. alpha-QE's raw
            # s^alpha (alpha = 3, set for image-image cosines ~0.7-0.9) is a near no-op on composed
            # (cross-modal) cosines ~0.2-0.5 (0.3^3 = 0.027); relative, the best neighbour weighs as
            # much as the query and one at 0.3 against a best of 0.5 weighs (0.6)^3 = 0.22
            sims = sims / sims.amax(1, keepdim=True).clamp(min=1e-6)
            q = alpha_qe(q, self.gallery[nb.clamp(min=0)] * ok, sims, m.aqe_alpha)
            cos, scores, state = self._score(q, ref_t)
        depth = min(max(self.k, m.reinspect if self.reinspector else 0), len(self.index.ids))
        vals, idx = topk(scores, depth, ref_t)                             # [B, depth] each
        if self.reinspector is not None:
            vals, idx = self._reinspect(batch, q, vals, idx, state)
        out = []
        vals, idx = to_host(vals[:, :self.k], idx[:, :self.k])             # one host sync for both
        for vs, js in zip(vals.tolist(), idx.tolist()):
            out.append([(j, v) for v, j in zip(vs, js) if j >= 0 and np.isfinite(v)])
        return out

    def results(self, batch) -> list[list[dict]]:
        """Each request's rows as a run writes them: {"image_id" (as the index holds it), "score"}, best first."""
        ids = self.index.ids
        return [[{"image_id": ids[j], "score": v} for j, v in hits if math.isfinite(v)] for hits in self.answer(batch)]

    def _reinspect(self, batch, q, vals, idx, state):
        """Re-score each row's top R candidates with multi-view rows (same scorer).

        Mixing rule: the R re-inspected candidates keep their rank block (ranks 1..R), re-ordered
        by their new scores; the candidates below keep their order, their scores lowered by one
        offset so that none passes the block's lowest new score (the output stays non-increasing).
        Every request's views are decoded and embedded together (Reinspector.embed_many)."""
        from engine.retrieval.rescore import RowState, score_cos

        m = self.method
        vals, idx = vals.clone(), idx.clone()
        cands = [[j for j in idx[b, :m.reinspect].tolist() if j >= 0] for b in range(len(batch))]
        cols = [torch.tensor(c, dtype=torch.int64, device=idx.device) for c in cands]
        rows = self.reinspector.embed_many([(str(r.query_id), c) for r, c in zip(batch, cands)],
                                           [self.base[c] for c in cols])          # [C_b, D] each
        for b, (c, v) in enumerate(zip(cols, rows)):
            n = len(c)
            if not n:
                continue
            if self.method.gap:
                v = self.image_side(v.to(q.device))
            cos = (v.to(q.device) @ q[b]).unsqueeze(0)                      # [1, C]
            st = RowState(*(None if t is None else t[b:b + 1] for t in (state.normalised, state.r_q)))
            new = score_cos(m.hubness, cos, self.stats, st, c.unsqueeze(0), m.beta, m.temp)[0]
            order = torch.sort(new, descending=True, stable=True).indices
            vals[b, :n], idx[b, :n] = new[order], idx[b, :n][order]
            if n < vals.shape[1]:
                offset = (vals[b, n:].max() - vals[b, n - 1]).clamp(min=0)
                vals[b, n:] -= offset
        return vals, idx

    def report(self) -> dict:
        r = self.reinspector
        return {**self.info, "reinspected_per_request_max": r.budget.max_used if r else 0,
                "reinspected_total": r.budget.total if r else 0,
                "reinspect_limit": r.budget.per_request if r else 0,
                "reinspect_unreadable": len(r.failed) if r else 0,
                "reinspect_decoded": r.decoded if r else 0}
