"""`csls[:k=10][:bank=...]`: CSLS (Conneau et al., ICLR 2018): 2 s_qj - r_j - r_q with r the mean
of the k largest similarities on each side (engine.retrieval.rescore)."""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key
from engine.retrieval.options.hubness import BANK_KEY, HubnessScorer


class CSLS(HubnessScorer):
    name = "csls"
    source = "published: CSLS (Conneau et al., ICLR 2018)"
    keys = {"k": Key("k", RETRIEVAL.csls_k, int), "bank": BANK_KEY}
    record_field = "csls_k"
    record_defaults = {"csls_k": RETRIEVAL.csls_k}

    def validate(self) -> None:
        super().validate()
        if self.k < 1:
            raise ValueError("csls k must be >= 1")
