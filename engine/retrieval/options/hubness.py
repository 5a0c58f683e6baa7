"""What the four hubness scorers share (isoftmax.py, qbnorm.py, dual_softmax.py, csls.py): a query
bank (`bank=gallery|requests|both`), its per-item statistics made once per call
(engine.retrieval.rescore.bank_stats), and the scores of a row from its cosines.

`bank=gallery` (the default) is the index's gallery-derived texts, which no call changes;
`requests`, the call's own composed queries, is transductive and used only when named.
"""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key, Option

BANKS = ("requests", "gallery", "both")      # where a hubness scorer's query bank comes from
BANK_KEY = Key("bank", "gallery", str)


class HubnessScorer(Option):
    group = "hubness scorer"
    record_defaults = {"hubness": "", "bank": "gallery"}
    record_field: str = ""          # the flat record's field of the scorer's own setting (beta, temp, csls_k)
    # the settings the scorer does not take keep the table's values (rescore.bank_stats ignores them)
    beta = RETRIEVAL.beta
    temp = RETRIEVAL.temp
    k = RETRIEVAL.csls_k

    def validate(self) -> None:
        if self.bank not in BANKS:
            raise ValueError(f"bank must be one of {BANKS}")

    def _setting(self) -> str:
        return next(k.attr for k in self.keys.values() if k.attr != "bank")

    def record(self) -> dict:
        return {"hubness": self.name, "bank": self.bank, self.record_field: getattr(self, self._setting())}

    @classmethod
    def from_record(cls, flat: dict):
        if flat.get("hubness") != cls.name:
            return None
        setting = next(k.attr for k in cls.keys.values() if k.attr != "bank")
        fields = {"bank": "bank", setting: cls.record_field}
        return cls(**{attr: flat[f] for attr, f in fields.items() if f in flat})

    @property
    def uses_requests(self) -> bool:
        return self.bank in ("requests", "both")

    def needs_text_bank(self) -> bool:
        return self.bank in ("gallery", "both")

    def needs_requests(self, space) -> bool:
        return self.uses_requests

    def missing(self, meta: dict, corpus) -> str | None:
        from engine.retrieval.options.pic2word import no_text_bank

        if self.bank in ("gallery", "both") and not meta.get("text_bank"):
            return (f"hubness scoring with bank={self.bank} (the default) needs a query bank of gallery-derived "
                    f"texts, and {no_text_bank(meta)}; :bank=requests uses the call's own requests instead")
        return None

    def begin_call(self, space) -> None:
        if self.bank in ("gallery", "both") and space.text_bank is None:
            raise space.Error(f"{self.name}: bank={self.bank} needs the index's gallery-derived text bank, which "
                              "it lacks (build it with --mapping pic2word), or name bank=requests "
                              "(transductive: each answer then depends on the call's other requests)")

    def prepare(self, space, call) -> None:
        """The bank's per-item statistics over the pipeline's gallery: the call's composed queries
        and/or the gallery-derived texts, each bank query's own gallery row masked."""
        import torch

        from engine.retrieval.rescore import ScorerParams, bank_stats

        parts, src, ex = [], [], []
        if self.uses_requests and call.queries is not None:
            parts.append(call.queries)
            ex.append(call.refs)
            src.append(f"{len(call.queries)} request queries")
        bank = space.text_bank
        if bank is not None and self.bank in ("gallery", "both"):
            tb = space.text_side(bank)
            parts.append(tb)
            rows = (space.meta.get("text_bank") or {}).get("rows")   # each text's own gallery row
            if not isinstance(rows, list) or len(rows) != len(tb):
                space.log("the gallery text bank does not record its gallery rows (an older build: rebuild "
                         "the extras to mask them); its self-matches are not masked")
                rows = [-1] * len(tb)
            ex.append(torch.tensor(rows, dtype=torch.int64, device=tb.device))
            src.append(f"{len(tb)} gallery-derived texts")
        if not parts:
            raise space.Error(f"{self.name}: no query bank (no requests and no stored text bank)")
        params = ScorerParams(self.beta, self.temp, self.k)
        space.stats = bank_stats(self.name, torch.cat(parts), space.gallery, params, torch.cat(ex),
                                has_queries=self.uses_requests, chunk=space.settings.bank_chunk)
        space.info["bank"] = " + ".join(src)

    def row_state(self, space, cos, ref_t):
        """What the scorer decides per row from its cosines [B, N] (rescore.row_state)."""
        from engine.retrieval.rescore import row_state

        return row_state(self.name, cos, space.stats, self.k, ref_t)

    def scores(self, space, cos, state, cols=None):
        """Scores [B, C] from cosines [B, C] of gallery columns `cols` (None: all)."""
        from engine.retrieval.rescore import score_cos

        return score_cos(self.name, cos, space.stats, state, cols, self.beta, self.temp)
