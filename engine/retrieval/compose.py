"""Training-free query composition for composed image retrieval, behind one interface.

A request is (reference image embedding, modification text, optional shared concept).
A `Method` turns it into one unit query vector:

- `text-only`: the text embedding alone (CIR's text-only baseline).
- `sum`: normalise((1 - w) * image + w * text), w = text weight (0.5: the plain sum baseline).
- `slerp`: spherical interpolation from the image to the text embedding by w.

Default, as published: `slerp` (Jang et al., ECCV 2024, "Spherical Linear Interpolation
and Text-Anchoring for Zero-shot Composed Image Retrieval", Slerp without training), text
weight 0.8 for requests with a shared_concept (CIRCO-style) and 0.9 otherwise (the values
Jang et al. report for CIRCO / CIRR), the bare caption as the text (`prompt=plain`, what
their CLIP-only Slerp encodes), no add-ons. See docs/retrieval.md for sources and figures.

Prompt (the text fed to the text tower): a name of `PROMPTS` (each labelled with its
source in `PROMPT_SOURCES`: published, or this kit's own variant) or any template with
`{modification}` and optionally `{shared_concept}`; `auto` is the method's default
(`plain`; `pic2word` for the pic2word method).

Beyond composition (docs/retrieval_quality.md): `pic2word` composes through a mapping
learned at build time (engine.retrieval.pic2word), and a method name may add gallery-aware options
after `+`, each `option[:key=value...]`. Each option is one file of engine/retrieval/options/ and
one line of its `OPTIONS` table (its keys, defaults, checks and hooks: options/base.py); a
`Method` is the base below plus an ordered tuple of option instances:

    slerp+gap+qbnorm:beta=20+aqe:n=3      pic2word+csls:k=10+reinspect:n=100:crops=3

- `gap[:text=captions|bank][:shift=L]`: modality-gap shift along the gap vector (Liang et
  al., NeurIPS 2022); `gap-centre[:text=requests|bank|both|captions]`: this kit's variant,
  each modality centred on its own mean (transductive with `text=requests`);
- one hubness scorer: `isoftmax[:beta=20]`, `qbnorm[:beta=20]` (dynamic inverted softmax),
  `dual-softmax[:temp=100]`, `csls[:k=10]`, each with `bank=gallery|requests|both`
  (default `gallery`: the index's gallery-derived texts; `requests`, the call's own
  composed queries, is transductive and used only when named);
- `aqe[:n=3:alpha=3]` (alpha query expansion with scale-free weights, this kit's variant),
  `dba[:n=3:alpha=3]` (database-side augmentation); `reinspect[:n=100:crops=3]`
  (multi-view re-scoring, n <= 100, this kit's variant).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.presets.retrieval import RETRIEVAL

METHODS = ("slerp", "sum", "text-only", "pic2word")          # the composition (base) names
# where each name comes from: published (with its source) or this kit's own variant (shown by --help)
METHOD_SOURCES = {
    "slerp": "published: Slerp without training (Jang et al., ECCV 2024); the default",
    "sum": "published baseline: image + text sum (as reported by Saito et al., CVPR 2023)",
    "text-only": "published baseline: the caption alone (as reported by Baldrati et al., ICCV 2023)",
    "pic2word": "published method (Saito et al., CVPR 2023), mapping trained on the gallery: this kit's variant",
}
PROMPTS = {"plain": "{modification}",
           "pic2word": "a photo of * , {modification}",
           "searle": "a photo of * that {modification}",
           "magiclens": "find {shared_concept} but {modification}",
           "pic2word-concept": "a photo of * that is {shared_concept} and {modification}"}
PROMPT_SOURCES = {
    "plain": "published: the bare caption, what Slerp's CLIP-only setting encodes (Jang et al., ECCV 2024)",
    "pic2word": "published: Pic2Word's prompt (Saito et al., CVPR 2023)",
    "searle": "published: SEARLE's prompt (Baldrati et al., ICCV 2023; its $ written *)",
    "magiclens": "published for MagicLens (Zhang et al., ICML 2024), a trained model; never with CLIP-only Slerp",
    "pic2word-concept": "this kit's variant (Pic2Word's pseudo-word with the shared concept)",
}
DEFAULT_PROMPTS = {"pic2word": "pic2word"}
_PSEUDO_WORD_PROMPTS = ("pic2word", "searle", "pic2word-concept")   # the prompt `auto` stands for; every other method: plain
DEFAULT_WEIGHTS = RETRIEVAL.text_weights   # method -> (with concept, without)


def prompt_help() -> str:
    """One line per prompt name with its template and source (for --help)."""
    return "; ".join(f"{k} = {PROMPTS[k]!r} ({PROMPT_SOURCES[k]})" for k in PROMPTS)


def method_help() -> str:
    """Every base name and option with its source (for --help)."""
    from engine.retrieval.options import named

    return "; ".join(f"{k}: {v}" for k, v in {**METHOD_SOURCES,
                                                **{n: cls.source for n, cls in named().items()}}.items())


_R = RETRIEVAL   # every default below is the retrieval table's (engine/presets/retrieval.py)
_BASE_FIELDS = ("name", "weight_concept", "weight_plain", "prompt")   # the flat record's fields before the options'


@dataclass(frozen=True)
class Method:
    """A composition (the base: name, text weights, prompt) and its options
    (engine.retrieval.options, in the table's order: the order their hooks run)."""
    name: str = _R.method          # composition: slerp | sum | text-only | pic2word
    weight_concept: float = _R.text_weights[_R.method][0]   # text weight for requests with a shared_concept
    weight_plain: float = _R.text_weights[_R.method][1]     # ... for requests without one (CIRR-style)
    prompt: str = "plain"          # a PROMPTS name, auto (the method's default) or a template string
    options: tuple = ()            # engine.retrieval.options.Option instances, one per group

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.name!r}")
        for w in (self.weight_concept, self.weight_plain):
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"text weights must lie in [0, 1], got {w}")
        template = PROMPTS.get(self.prompt, self.prompt)
        if self.name == "pic2word" and self.prompt != "auto":
            if "*" not in template or "{modification}" not in template:
                raise ValueError(f"a pic2word prompt must be auto, pic2word, searle, pic2word-concept or a template "
                                 f"with * and {{modification}}, got {self.prompt!r}")
        elif self.prompt != "auto" and "{modification}" not in template:
            raise ValueError(f"prompt must be auto, one of {', '.join(PROMPTS)} or a template with "
                             f"{{modification}}, got {self.prompt!r}")
        elif self.name != "pic2word" and self.prompt in _PSEUDO_WORD_PROMPTS:
            raise ValueError(f"prompt {self.prompt!r} holds Pic2Word's pseudo-word *: it needs method pic2word")
        object.__setattr__(self, "options", _ordered(self.options))

    def to_dict(self) -> dict:
        """The flat method record (meta.json `method`, a run's identity): the base's fields, then
        every option's fields (their `off` values for options not named)."""
        from engine.retrieval.options import record_defaults

        out = {f: getattr(self, f) for f in _BASE_FIELDS}
        out.update(record_defaults())
        for o in self.options:
            out.update(o.record())
        return out

    @classmethod
    def from_dict(cls, flat: dict) -> Method:
        """The method a flat record (to_dict) holds; TypeError / ValueError when it is not one."""
        from engine.retrieval.options import OPTIONS, record_defaults

        unknown = set(flat) - set(_BASE_FIELDS) - set(record_defaults())
        if unknown:
            raise TypeError(f"the recorded method has unknown fields {sorted(unknown)}")
        opts = [o for c in OPTIONS.values() if not c.base for o in [c.from_record(flat)] if o is not None]
        m = cls(**{f: flat[f] for f in _BASE_FIELDS if f in flat}, options=tuple(opts))
        mine = m.to_dict()
        differ = sorted(f for f, v in flat.items() if mine.get(f) != v)
        if differ:
            raise ValueError(f"the recorded method's {', '.join(differ)} name no option this engine knows "
                             f"(the record: {flat})")
        return m

    def option(self, name: str):
        """The option `name` of this method (implied by its base or named), or None."""
        return next((o for o in self.steps if o.name == name), None)

    @property
    def steps(self) -> tuple:
        """Every option the pipeline runs: those the base implies and those named, in the table's order."""
        from engine.retrieval.options import implied

        return _ordered((*implied(self.name), *self.options))

    @property
    def label(self) -> str:
        """The canonical name: base + options with their non-default values (make_method reads it back)."""
        return "+".join([self.name, *(o.label for o in self.options)])

    @property
    def uses_bank(self) -> bool:
        """Whether the call's own requests must be encoded before any is answered."""
        return any(o.uses_requests for o in self.options)


def _ordered(options) -> tuple:
    """Options in the table's order, those their values switch off left out; ValueError for one
    that is not an option a method name may add, or two of one group."""
    from engine.retrieval.options import OPTIONS, Option

    for o in options:
        if not isinstance(o, Option) or OPTIONS.get(o.name) is not type(o):
            raise ValueError(f"not a retrieval option: {o!r}")
    order = list(OPTIONS)
    out = tuple(sorted((o for o in options if o.active), key=lambda o: order.index(o.name)))
    groups = [o.group for o in out if o.group]
    if len(groups) != len(set(groups)) or len({o.name for o in out}) != len(out):
        raise ValueError(f"one option per group and name: {', '.join(o.name for o in out)}")
    return out


def parse_options(spec: str, say=None, max_reinspect: int | None = None) -> tuple[str, tuple]:
    """(base, options) from `base+opt[:key=value...]...` (see the module docstring); a
    re-inspection count past `max_reinspect` (the caller's limit) is clamped and said."""
    from engine.retrieval.options import named

    base, *opts = spec.strip().split("+")
    if base not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (optionally +options), got {spec!r}")
    known = named()
    out: dict = {}                  # name -> option (a name given twice: the last one)
    for opt in opts:
        head, *pairs = opt.split(":")
        if head not in known:
            raise ValueError(f"{spec!r}: unknown option {head!r} (one of {sorted(known)})")
        cls = known[head]
        rival = next((n for n, o in out.items() if cls.group and o.group == cls.group), None)
        if rival is not None:
            raise ValueError(f"{spec!r}: one {cls.group} at a time ({rival} and {head})")
        out[head] = cls.parse(spec, pairs).within(max_reinspect, say or _stderr)
    return base, tuple(out.values())


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_method(name: str = RETRIEVAL.method, text_weight: float | None = None, prompt: str | None = None,
                max_reinspect: int | None = None) -> Method:
    """A method from its name (`base[+option...]`); `text_weight` overrides both per-request weights;
    a re-inspection count past `max_reinspect` is clamped."""
    base, options = parse_options(name, max_reinspect=max_reinspect)
    wc, wp = DEFAULT_WEIGHTS[base]
    if text_weight is not None:
        wc = wp = float(text_weight)
    if prompt in (None, "", "auto"):
        prompt = DEFAULT_PROMPTS.get(base, "plain")
    return Method(base, wc, wp, prompt, options)


def prompt_text(method: Method, modification: str, shared_concept: str | None) -> str:
    """The string the text tower encodes for one request (pic2word: with the `*` placeholder,
    the requests' own `*` characters blanked so the placeholder stays the first one)."""
    template = method.prompt
    if template == "auto":
        template = DEFAULT_PROMPTS.get(method.name, "plain")
    if method.name == "pic2word":
        modification = modification.replace("*", " ")
        shared_concept = shared_concept.replace("*", " ") if shared_concept else shared_concept
    template = PROMPTS.get(template, template)
    if "{shared_concept}" in template and not shared_concept:
        template = PROMPTS["pic2word" if method.name == "pic2word" else "plain"]  # needs a concept it lacks
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
    if method.name in ("text-only", "pic2word"):   # pic2word: the text already carries the image
        return F.normalize(text, dim=-1)
    if method.name == "slerp":
        q = slerp(image, text, weights)
    else:
        w = weights.to(text.dtype).unsqueeze(1)
        q = F.normalize((1 - w) * image + w * text, dim=-1)
    return torch.where(has_image.unsqueeze(1), q, F.normalize(text, dim=-1))
