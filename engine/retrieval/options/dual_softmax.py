"""`dual-softmax[:temp=100][:bank=...]`: dual softmax (Cheng et al., 2021), a prior over queries:
s_qj * exp(temp * s_qj - log sum_b exp(temp * s_bj)) (engine.retrieval.rescore)."""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key
from engine.retrieval.options.hubness import BANK_KEY, HubnessScorer


class DualSoftmax(HubnessScorer):
    name = "dual-softmax"
    source = "published: dual softmax (Cheng et al., 2021); temp 100 is this kit's choice"
    keys = {"temp": Key("temp", RETRIEVAL.temp, float), "bank": BANK_KEY}
    record_field = "temp"
    record_defaults = {"temp": RETRIEVAL.temp}

    def validate(self) -> None:
        super().validate()
        if not self.temp > 0:
            raise ValueError("beta and temp must be > 0")
