"""Training-free query composition for composed image retrieval, behind one interface.

A request is (reference image embedding, modification text, optional shared concept).
A `Method` turns it into one unit query vector:

- `text-only`: the text embedding alone (CIR's text-only baseline).
- `sum`: normalise((1 - w) * image + w * text), w = text weight (0.5: the plain sum baseline).
- `slerp`: spherical interpolation from the image to the text embedding by w.

Default: `slerp`, the best published training-free CLIP-only setting in our references
(shared/REFERENCES.md, "Slerp, no training": Jang et al. 2024, "Spherical Linear
Interpolation and Text-Anchoring for Zero-shot Composed Image Retrieval": CIRR R@1
24.43 with ViT-L/14, vs 12.4 for the plain sum); text weight 0.8 for CIRCO-style
requests (those with a shared_concept) and 0.9 otherwise, the values reported for
CIRCO / CIRR. See docs/retrieval.md.

Prompt (the text fed to the text tower): `auto` uses MagicLens's CIRCO template
"find {shared_concept} but {modification}" when a shared concept is given and the bare
modification otherwise; `plain` always the bare modification; any other string is a
template with `{modification}` and optionally `{shared_concept}`. The Slerp weights were
published without this template: the combination is our choice, not a published number.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

METHODS = ("slerp", "sum", "text-only")
PROMPTS = {"plain": "{modification}", "magiclens": "find {shared_concept} but {modification}"}
DEFAULT_WEIGHTS = {"slerp": (0.8, 0.9), "sum": (0.5, 0.5), "text-only": (1.0, 1.0)}  # (with concept, without)


@dataclass(frozen=True)
class Method:
    name: str = "slerp"
    weight_concept: float = 0.8    # text weight for requests with a shared_concept (CIRCO-style)
    weight_plain: float = 0.9      # text weight for requests without one (CIRR-style)
    prompt: str = "auto"           # auto | plain | magiclens | a template string

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.name!r}")
        for w in (self.weight_concept, self.weight_plain):
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"text weights must lie in [0, 1], got {w}")
        if self.prompt not in ("auto", *PROMPTS) and "{modification}" not in self.prompt:
            raise ValueError(f"prompt must be auto, plain, magiclens or a template with {{modification}}, "
                             f"got {self.prompt!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_method(name: str = "slerp", text_weight: float | None = None, prompt: str | None = None) -> Method:
    """A method preset by name; `text_weight` overrides both per-request weights."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {name!r}")
    wc, wp = DEFAULT_WEIGHTS[name]
    if text_weight is not None:
        wc = wp = float(text_weight)
    return Method(name, wc, wp, prompt or "auto")


def prompt_text(method: Method, modification: str, shared_concept: str | None) -> str:
    """The string the text tower encodes for one request."""
    template = method.prompt
    if template == "auto":
        template = "magiclens" if shared_concept else "plain"
    template = PROMPTS.get(template, template)
    if "{shared_concept}" in template and not shared_concept:
        template = PROMPTS["plain"]  # the template needs a concept this request lacks
    return template.replace("{shared_concept}", shared_concept or "").replace("{modification}", modification)


def text_weight(method: Method, shared_concept: str | None) -> float:
    return method.weight_concept if shared_concept else method.weight_plain


def slerp(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Row-wise spherical interpolation of unit rows a, b [Q, D] by t [Q] (0 -> a, 1 -> b).

    slerp = sin((1-t) th) / sin th * a + sin(t th) / sin th * b, th = angle(a, b); rows whose
    angle is ~0 (or ~pi, where the arc is undefined) use the normalised linear blend.
    """
    t = t.to(a.dtype).unsqueeze(1)                          # [Q, 1]
    cos = (a * b).sum(-1, keepdim=True).clamp(-1.0, 1.0)    # [Q, 1]
    theta = torch.acos(cos)
    sin = torch.sin(theta)
    ok = sin > 1e-6
    safe = torch.where(ok, sin, torch.ones_like(sin))
    arc = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / safe
    lin = (1 - t) * a + t * b
    return F.normalize(torch.where(ok, arc, lin), dim=-1)


def compose(method: Method, image: torch.Tensor, has_image: torch.Tensor, text: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """Unit query rows [Q, D] from unit image rows [Q, D] (ignored where has_image [Q] is False:
    the reference is unknown, so the text alone answers), unit text rows [Q, D], weights [Q]."""
    if method.name == "text-only":
        return F.normalize(text, dim=-1)
    if method.name == "slerp":
        q = slerp(image, text, weights)
    else:
        w = weights.to(text.dtype).unsqueeze(1)
        q = F.normalize((1 - w) * image + w * text, dim=-1)
    return torch.where(has_image.unsqueeze(1), q, F.normalize(text, dim=-1))
