"""`aqe[:n=3:alpha=3]`: alpha query expansion (Radenovic et al., TPAMI 2018) with scale-free
weights, this kit's variant: each query moves toward its top n gallery rows, weighted by their
cosines relative to the best one's, and is scored again (engine.retrieval.rescore.alpha_qe)."""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key, NeighbourMean


class AlphaQE(NeighbourMean):
    name = "aqe"
    source = "alpha-QE (Radenovic et al., TPAMI 2018) with scale-free weights: this kit's variant"
    keys = {"n": Key("n", RETRIEVAL.aqe_neighbours, int), "alpha": Key("alpha", RETRIEVAL.aqe_alpha, float)}
    record_defaults = {"aqe": 0, "aqe_alpha": RETRIEVAL.aqe_alpha}

    def expand(self, space, scored, ref_t, topk):
        from engine.retrieval.rescore import alpha_qe

        _, nb = topk(scored.scores, min(self.n, space.k), ref_t)           # [B, n] (-1 padded)
        ok = (nb >= 0).unsqueeze(-1)
        sims = scored.cos.gather(1, nb.clamp(min=0)).clamp(min=0) * ok.squeeze(-1)
        # scale-free weights: each neighbour's cosine relative to the best one's. alpha-QE's raw
        # s^alpha (alpha = 3, set for image-image cosines ~0.7-0.9) is a near no-op on composed
        # (cross-modal) cosines ~0.2-0.5 (0.3^3 = 0.027); relative, the best neighbour weighs as
        # much as the query and one at 0.3 against a best of 0.5 weighs (0.6)^3 = 0.22
        sims = sims / sims.amax(1, keepdim=True).clamp(min=1e-6)
        q = alpha_qe(scored.q, space.gallery[nb.clamp(min=0)] * ok, sims, self.alpha)
        return space.score(q, ref_t)
