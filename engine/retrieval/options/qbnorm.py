"""`qbnorm[:beta=20][:bank=...]`: QB-Norm's dynamic inverted softmax (Bogolin et al., CVPR 2022):
the inverted softmax only in rows whose raw top-1 some other bank query has as its top-1
(engine.retrieval.rescore)."""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key
from engine.retrieval.options.hubness import BANK_KEY, HubnessScorer


class QBNorm(HubnessScorer):
    name = "qbnorm"
    source = "published: QB-Norm's dynamic inverted softmax (Bogolin et al., CVPR 2022)"
    keys = {"beta": Key("beta", RETRIEVAL.beta, float), "bank": BANK_KEY}
    record_field = "beta"

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ValueError("beta and temp must be > 0")
