"""Modality-gap correction: CLIP's image and text embeddings sit in two separate cones.

`shift` is the correction of Liang et al. (NeurIPS 2022, "Mind the Gap", their repository's
`move_features`): with the gap vector delta = mean(images) - mean(texts),

    image' = normalise(image - lam * delta / 2)      text' = normalise(text + lam * delta / 2)

so at lam = 1 the two means meet (before the renormalisation); lam = 0 changes nothing.
Liang et al. sweep the shift and report gains on some tasks and losses on others: no
value is known to be best for composed retrieval.

The means must not depend on the other requests of a call (an answer would then change
with its neighbours): the image mean is the gallery's (stored at build time), the text
mean is that of `CAPTIONS`, a fixed set of short captions and edit instructions written
for this purpose (encoded once per call, identical for every call with the same CLIP),
or of the index's gallery-derived text bank when asked (`gap:text=bank`).

This kit's variant `gap-centre` (engine.retrieval.rescore.center) instead subtracts each
modality's own mean, which moves both cones to the origin rather than onto each other.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.presets.retrieval import RETRIEVAL

_SUBJECTS = ("a dog", "a cat", "two people", "a man", "a woman", "a child", "a car", "a bus", "a bird",
             "a horse", "a plate of food", "a bedroom", "a kitchen", "a street", "a beach", "a laptop")
_FORMS = ("a photo of {}", "{} outdoors in the sun", "make it {} at night",
          "show {} from a different angle, in black and white")
CAPTIONS = tuple(form.format(s) for s in _SUBJECTS for form in _FORMS)   # 64 texts


def gap_vector(image_mean: torch.Tensor, text_mean: torch.Tensor) -> torch.Tensor:
    """[D] delta = image mean - text mean (not normalised: its length is the gap)."""
    return image_mean.float() - text_mean.to(image_mean.device).float()


def shift(x: torch.Tensor, delta: torch.Tensor, toward_text: bool, lam: float = RETRIEVAL.gap_shift) -> torch.Tensor:
    """Unit rows x [*, D] moved by half of lam * delta [D]: images toward the texts
    (`toward_text`), texts toward the images, then renormalised."""
    step = (0.5 * lam) * delta.to(x)
    return F.normalize(x - step if toward_text else x + step, dim=-1)
