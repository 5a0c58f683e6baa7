"""`gap[:text=captions|bank][:shift=L]`: shift along the modality-gap vector (Liang et al., NeurIPS 2022).

The gallery's image mean (stored at build time: this option's extra) and a text mean that does
not depend on the call (the fixed captions of engine.retrieval.gap, or the index's
gallery-derived texts with `text=bank`) give the gap vector; images move toward the texts and
texts toward the images by half of `shift` times it (engine.retrieval.gap.shift).
"""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key, Option

GAP_TEXT = ("captions", "bank")              # text-mean sources of the gap shift (none depends on the call)


def image_mean(space):
    """[D] the image mean of the gallery rows the pipeline compares (stored at build time when
    the rows are the stored ones)."""
    import torch

    stored = space.meta.get("gallery_mean")
    if stored and space.base is space.raw:
        space.info["image_mean"] = "stored at build time"
        return torch.tensor(stored, dtype=torch.float32, device=space.raw.device)
    space.info["image_mean"] = "computed from the gallery rows" + (" (DBA)" if space.base is not space.raw else "")
    if not stored and space.base is space.raw:
        space.log("the index has no stored gallery mean (built before it was recorded): computing it")
    return space.base.mean(0)


def caption_mean(space):
    """[D] the text mean of engine.retrieval.gap's fixed captions, encoded by the pipeline's towers."""
    from engine.retrieval.gap import CAPTIONS

    tokens, _ = space.towers.tokenize(list(CAPTIONS))
    return space.towers.encode_tokens(tokens).float().mean(0)


class Gap(Option):
    name = "gap"
    source = "published: shift along the modality-gap vector (Liang et al., NeurIPS 2022)"
    keys = {"text": Key("text", "captions", str), "shift": Key("shift", RETRIEVAL.gap_shift, float)}
    group = "gap correction"
    record_defaults = {"gap": "", "gap_mode": "shift", "gap_shift": RETRIEVAL.gap_shift}

    def validate(self) -> None:
        if self.text not in GAP_TEXT:
            raise ValueError(f"gap text source must be one of {GAP_TEXT}")
        if not 0.0 <= self.shift <= 2.0:
            raise ValueError("gap shift must lie in [0, 2]")

    def record(self) -> dict:
        return {"gap": self.text, "gap_mode": "shift", "gap_shift": self.shift}

    @classmethod
    def from_record(cls, flat: dict):
        if flat.get("gap") and flat.get("gap_mode", "shift") == "shift":
            return cls(text=flat["gap"], shift=flat.get("gap_shift", RETRIEVAL.gap_shift))
        return None

    def missing(self, meta: dict, corpus) -> str | None:
        from engine.retrieval.options.pic2word import no_text_bank

        if self.text in ("bank", "both") and not meta.get("text_bank"):
            return f"gap with text={self.text} needs the gallery-derived texts' mean, and {no_text_bank(meta)}"
        return None

    def needs_text_bank(self) -> bool:
        return self.text == "bank"

    def setup(self, space) -> None:
        from engine.retrieval.gap import CAPTIONS, gap_vector

        space.image_mean = image_mean(space)
        if self.text == "bank" and space.text_bank is not None:
            space.text_mean = space.text_bank.mean(0)
            space.info["text_mean"] = f"{len(space.text_bank)} gallery-derived texts"
        else:
            if self.text == "bank":
                space.log("gap shift: no gallery-derived text bank; using the fixed caption set's text mean")
            space.text_mean = caption_mean(space)
            space.info["text_mean"] = f"{len(CAPTIONS)} fixed captions (engine.retrieval.gap)"
        space.delta = gap_vector(space.image_mean, space.text_mean)       # [D] image mean - text mean
        space.info["gap_norm"] = round(float(space.delta.norm()), 4)
        space.gallery = self.image_side(space, space.base)

    def image_side(self, space, rows):
        from engine.retrieval.gap import shift

        return shift(rows, space.delta, toward_text=True, lam=self.shift)

    def text_side(self, space, rows):
        from engine.retrieval.gap import shift

        return shift(rows, space.delta, toward_text=False, lam=self.shift)

    @classmethod
    def extras(cls, ctx) -> tuple[dict, dict]:
        """The gallery's image mean (always stored: any gap option of a later run reads it)."""
        x = ctx.rows
        return {"gallery_mean": [float(v) for v in x.mean(0)] if len(x) else []}, {}     # [D]
