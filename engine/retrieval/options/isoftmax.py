"""`isoftmax[:beta=20][:bank=...]`: inverted softmax (Smith et al., ICLR 2017), log form:
beta * s_qj - log sum_b exp(beta * s_bj) over the query bank (engine.retrieval.rescore)."""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key
from engine.retrieval.options.hubness import BANK_KEY, HubnessScorer


class ISoftmax(HubnessScorer):
    name = "isoftmax"
    source = "published: inverted softmax (Smith et al., ICLR 2017)"
    keys = {"beta": Key("beta", RETRIEVAL.beta, float), "bank": BANK_KEY}
    record_field = "beta"
    record_defaults = {**HubnessScorer.record_defaults, "beta": RETRIEVAL.beta}

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ValueError("beta and temp must be > 0")
