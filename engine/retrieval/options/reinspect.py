"""`reinspect[:n=100:crops=3]`: this kit's variant, multi-view re-scoring of the top n candidates
of each request (engine.retrieval.reinspect): the candidates' images are decoded again as
`crops` extra views by the decoder that built the gallery, their rows re-embedded and scored by
the method's scorer. n is capped by the caller's per-request re-inspection limit."""
from __future__ import annotations

from pathlib import Path

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key, Option

MAX_CROPS = 5


class _Lookup(dict):
    """image id -> records path; a missing id is a KeyError naming it (the image fails alone)."""

    def __missing__(self, key):
        raise KeyError(f"image {key!r} has no record in the corpus")


class Reinspect(Option):
    name = "reinspect"
    source = "this kit's variant: multi-view re-scoring of the top candidates"
    keys = {"n": Key("n", RETRIEVAL.reinspect_candidates, int), "crops": Key("crops", RETRIEVAL.crops, int)}
    record_defaults = {"reinspect": 0, "crops": RETRIEVAL.crops}

    def validate(self) -> None:
        if self.n < 0:
            raise ValueError("reinspect must be >= 0 candidates per request")
        if not 1 <= self.crops <= MAX_CROPS:
            raise ValueError(f"crops must lie in 1..{MAX_CROPS}")

    @property
    def active(self) -> bool:
        return self.n > 0

    def record(self) -> dict:
        return {"reinspect": self.n, "crops": self.crops}

    @classmethod
    def from_record(cls, flat: dict):
        n = flat.get("reinspect", 0)
        return cls(n=n, crops=flat.get("crops", RETRIEVAL.crops)) if n else None

    def within(self, limit: int | None, say) -> Reinspect:
        if limit is None or self.n <= limit:
            return self
        say(f"[compose] reinspect:n={self.n} asks for more than the {limit} candidates per request allowed; "
            f"clamped to {limit}")
        return Reinspect(n=limit, crops=self.crops)

    def inspected(self) -> int:
        return self.n

    def missing(self, meta: dict, corpus) -> str | None:
        root = corpus or (Path(meta["corpus"]) if meta.get("corpus") else None)
        if root is None or not (root / "records.jsonl").is_file():
            return f"no corpus records for re-inspection at {root} (pass --corpus DIR)"
        return None

    def _budget(self, space):
        from engine.retrieval.reinspect import ReinspectBudget

        return ReinspectBudget(self.n, space.settings.max_reinspect)

    def setup(self, space) -> None:
        """The re-inspector over the corpus's records (none, said, when the records cannot be found)."""
        from engine import settings as engine_settings
        from engine import threads
        from engine.decoders import default_decoder
        from engine.retrieval.jsonl import read_records, record_reader
        from engine.retrieval.reinspect import Reinspector, ViewDecoding

        meta = space.meta
        root = space.settings.corpus or (Path(meta["corpus"]) if meta.get("corpus") else
                               Path(meta["records"]["path"]).parent if meta.get("records", {}).get("path") else None)
        records = root / "records.jsonl" if root else None
        if records is None or not records.is_file():
            space.log(f"re-inspection off: no corpus records at {records} (pass --corpus DIR)")
            space.info["reinspection"] = f"off: no records.jsonl at {records}"
            return
        try:
            paths = {str(r.image_id): r.path for r in read_records(records, space.warn)}
        except (OSError, ValueError) as e:
            raise space.Error(f"re-inspection: cannot read {records}: {e}") from None
        ids = space.ids
        # the same rule as the build: regular files where the records lead, unless confined to the corpus
        read_path = record_reader(root, _Lookup(paths), confine=not space.settings.allow_outside_corpus)

        def read(row: int) -> bytes:
            return read_path(str(ids[row]))

        # the decoder that built the gallery, so a view and a stored row come from the same pixels
        decoder = meta.get("decoder") or default_decoder(space.towers.device.type)
        budget = threads.budget(space.towers.device.type)
        space.info["reinspection"] = f"{self.n} candidates x {self.crops} views, decoder {decoder}, corpus {root}"
        decoding = ViewDecoding(decoder, RETRIEVAL.image_batch_for(space.towers.device.type), budget.readers,
                                engine_settings.decoder_isolate())
        space.reinspector = Reinspector(read, space.towers.encode_images, space.towers.spec.image, self.crops,
                                       self._budget(space), decoding)

    def begin_call(self, space) -> None:
        if space.reinspector is not None:           # each call's requests start with their whole budget
            space.reinspector.budget = self._budget(space)

    def depth(self, space) -> int:
        return self.n if space.reinspector is not None else 0

    def rescore(self, space, batch, scored, vals, idx):
        """Re-score each row's top n candidates with multi-view rows (the method's scorer).

        Mixing rule: the n re-inspected candidates keep their rank block (ranks 1..n), re-ordered
        by their new scores; the candidates below keep their order, their scores lowered by one
        offset so that none passes the block's lowest new score (the output stays non-increasing).
        Every request's views are decoded and embedded together (Reinspector.embed_many)."""
        import torch

        if space.reinspector is None:
            return vals, idx
        q = scored.q
        vals, idx = vals.clone(), idx.clone()
        cands = [[j for j in idx[b, :self.n].tolist() if j >= 0] for b in range(len(batch))]
        cols = [torch.tensor(c, dtype=torch.int64, device=idx.device) for c in cands]
        rows = space.reinspector.embed_many([(str(r.query_id), c) for r, c in zip(batch, cands)],
                                           [space.base[c] for c in cols])          # [C_b, D] each
        for b, (c, v) in enumerate(zip(cols, rows)):
            n = len(c)
            if not n:
                continue
            v = space.image_side(v.to(q.device))
            cos = (v.to(q.device) @ q[b]).unsqueeze(0)                      # [1, C]
            new = space.scores_of_row(scored.state, b, cos, c.unsqueeze(0))[0]
            order = torch.sort(new, descending=True, stable=True).indices
            vals[b, :n], idx[b, :n] = new[order], idx[b, :n][order]
            if n < vals.shape[1]:
                offset = (vals[b, n:].max() - vals[b, n - 1]).clamp(min=0)
                vals[b, n:] -= offset
        return vals, idx

    @classmethod
    def summary(cls, space) -> dict:
        r = getattr(space, "reinspector", None)
        return {"reinspected_per_request_max": r.budget.max_used if r else 0,
                "reinspected_total": r.budget.total if r else 0,
                "reinspect_limit": r.budget.per_request if r else 0,
                "reinspect_unreadable": len(r.failed) if r else 0,
                "reinspect_decoded": r.decoded if r else 0}
