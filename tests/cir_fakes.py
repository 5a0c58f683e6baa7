"""Small stand-ins for the CIR query pipeline's inputs: an index held in memory and CLIP towers
whose embeddings are chosen by hand, so a constructed case has a known answer."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.clip.spec import ClipSpec
from engine.core.spec import Spec


class FakeIndex:
    """emb [N, D] float16 unit rows, ids, meta.json as a dict, the index folder (no extras)."""

    def __init__(self, emb, ids, meta, d):
        self.emb, self.ids, self.meta, self.dir = emb, ids, {"decoder": "pil", **meta}, d
        self.row_of = {str(i): r for r, i in enumerate(ids)}
        self.extras: dict[str, bytes] = {}

    def rows(self):
        return {str(i): r for r, i in enumerate(self.ids)}

    def extra(self, name):
        return None


class OneHotTowers:
    """Text: always e0. Images: the one-hot of the dominant colour channel (red e0, green e2, blue e1)."""
    device, precision, trim_text = torch.device("cpu"), "fp32", True
    spec = ClipSpec(image=Spec(model="fake", input_size=16, crop_pct=1.0), context_length=77, embed_dim=4)

    def tokenize(self, texts):
        return torch.zeros(len(texts), 77, dtype=torch.long), [False] * len(texts)

    def encode_tokens(self, tokens):
        return F.one_hot(torch.zeros(len(tokens), dtype=torch.long), 4).float()

    def encode_images(self, px):
        dominant = torch.as_tensor(px).float().mean((1, 2)).argmax(1)           # 0 red, 1 green, 2 blue
        return F.one_hot(torch.tensor([0, 2, 1])[dominant], 4).float()
