"""`gap-centre[:text=requests|bank|both|captions]`: this kit's variant of the gap correction,
each modality centred on its own mean (engine.retrieval.rescore.center); transductive with
`text=requests` (the default) and `both`: the text mean is then the call's own requests'."""
from __future__ import annotations

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Key, Option
from engine.retrieval.options.gap import caption_mean, image_mean

GAP_CENTRE_TEXT = ("requests", "bank", "both", "captions")   # text-mean sources of the centring
GAP_MIN_TEXTS = RETRIEVAL.gap_min_texts   # fewer request texts than this make no text mean (said on stderr)


class GapCentre(Option):
    name = "gap-centre"
    source = "this kit's variant: each modality centred on its own mean (transductive with text=requests)"
    keys = {"text": Key("text", "requests", str)}
    group = "gap correction"

    def validate(self) -> None:
        if self.text not in GAP_CENTRE_TEXT:
            raise ValueError(f"gap-centre text source must be one of {GAP_CENTRE_TEXT}")

    def record(self) -> dict:
        return {"gap": self.text, "gap_mode": "centre"}

    @classmethod
    def from_record(cls, flat: dict):
        return cls(text=flat["gap"]) if flat.get("gap") and flat.get("gap_mode") == "centre" else None

    @property
    def uses_requests(self) -> bool:
        return self.text in ("requests", "both")

    def missing(self, meta: dict, corpus) -> str | None:
        from engine.retrieval.options.pic2word import no_text_bank

        if self.text in ("bank", "both") and not meta.get("text_bank"):
            return f"gap with text={self.text} needs the gallery-derived texts' mean, and {no_text_bank(meta)}"
        return None

    def needs_text_bank(self) -> bool:
        return self.text in ("bank", "both")

    def _requests_mean(self, space) -> bool:
        return self.uses_requests or (self.text == "bank" and space.text_bank is None)

    def needs_requests(self, space) -> bool:
        return self._requests_mean(space)

    def setup(self, space) -> None:
        from engine.retrieval.rescore import center

        space.image_mean = image_mean(space)
        space.gallery = center(space.base, space.image_mean)

    def prepare_texts(self, space, call) -> None:
        """The text mean: the call's request texts, the gallery-derived texts and/or the captions."""
        import torch

        from engine.retrieval.gap import CAPTIONS

        means, src = [], []
        use_requests = self._requests_mean(space)
        if use_requests and call.texts is not None and len(call.texts) >= GAP_MIN_TEXTS:
            means.append(call.texts.mean(0))
            src.append(f"{len(call.texts)} request texts")
        elif use_requests:
            space.log(f"gap correction: {len(call.requests)} request texts are too few for a text mean "
                     f"(< {GAP_MIN_TEXTS}); texts are not centred")
        if self.text in ("bank", "both") and space.text_bank is not None:
            means.append(space.text_bank.mean(0))
            src.append(f"{len(space.text_bank)} gallery-derived texts")
        if self.text == "captions":
            means.append(caption_mean(space))
            src.append(f"{len(CAPTIONS)} fixed captions (engine.retrieval.gap)")
        space.text_mean = torch.stack(means).mean(0) if means else None
        space.info["text_mean"] = " + ".join(src) or "none"

    def image_side(self, space, rows):
        from engine.retrieval.rescore import center

        return center(rows, space.image_mean)

    def text_side(self, space, rows):
        from engine.retrieval.rescore import center

        return center(rows, space.text_mean) if space.text_mean is not None else rows
