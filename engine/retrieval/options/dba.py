"""`dba[:n=3:alpha=3]`: database-side augmentation (Arandjelovic & Zisserman, CVPR 2012): each
gallery row moves toward its n nearest other rows (engine.retrieval.rescore.dba). The build
stores the rows (`scripts/build.sh --dba N --dba-alpha A`); a run asking for other (n, alpha),
or on an index without them, computes them at query time (said on stderr)."""
from __future__ import annotations

import time

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key, NeighbourMean


class DBA(NeighbourMean):
    name = "dba"
    source = "published: database-side augmentation (Arandjelovic & Zisserman, CVPR 2012)"
    keys = {"n": Key("n", RETRIEVAL.dba_neighbours, int), "alpha": Key("alpha", RETRIEVAL.dba_alpha, float)}
    record_defaults = {"dba": 0, "dba_alpha": RETRIEVAL.dba_alpha}
    extra_files = ("dba",)

    def _stored_here(self, meta: dict) -> bool:
        """Whether the build stored the rows of these (n, alpha)."""
        stored = meta.get("dba") or {}
        return stored.get("n") == self.n and stored.get("alpha") == self.alpha

    def reads(self, meta: dict) -> tuple[str, ...]:
        return ("dba",) if self._stored_here(meta) else ()

    def gallery_rows(self, space, rows):
        from engine.retrieval.rescore import dba

        kept = space.stored_rows("dba")
        if kept is not None:
            space.info["dba"] = "stored at build time"
            return kept
        t0 = time.perf_counter()
        out = dba(rows, self.n, self.alpha, chunk=RETRIEVAL.dba_chunk if space.settings.bank_chunk else 0)
        space.log(f"DBA n={self.n} alpha={self.alpha:g} is not stored in the index (build --dba {self.n} "
                 f"--dba-alpha {self.alpha:g} stores it): computed here in {time.perf_counter() - t0:.2f} s")
        space.info["dba"] = "computed at query time"
        return out

    @classmethod
    def extras(cls, ctx) -> tuple[dict, dict]:
        """With `--dba N`: the augmented gallery rows."""
        cfg = ctx.cfg
        if not cfg.dba:
            return {}, {}
        import numpy as np
        import torch

        from engine.retrieval.rescore import dba

        g = torch.from_numpy(ctx.rows).to(ctx.towers.device)
        rows = dba(g, cfg.dba, cfg.dba_alpha, cfg.dba_chunk)
        return {"dba": {"n": cfg.dba, "alpha": cfg.dba_alpha}}, {"dba": (".f16.npy", ctx.npy(
            rows.cpu().numpy().astype(np.float16)))}
