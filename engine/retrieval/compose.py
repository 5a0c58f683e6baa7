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
after `+`, each `option[:key=value...]` (engine.retrieval.rescore, engine.retrieval.gap,
engine.retrieval.reinspect):

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

import dataclasses
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
HUBNESS = ("isoftmax", "qbnorm", "dual-softmax", "csls")
BANKS = ("requests", "gallery", "both")      # where a hubness scorer's query bank comes from
GAP_TEXT = ("captions", "bank")              # text-mean sources of the gap shift (none depends on the call)
GAP_CENTRE_TEXT = ("requests", "bank", "both", "captions")   # ... of the centring variant
MAX_CROPS = 5
# option -> {key in the name: Method field}; _SWITCH_ON: the field an option sets by its presence
_OPTION_KEYS = {
    "gap": {"text": "gap", "shift": "gap_shift"}, "gap-centre": {"text": "gap"},
    "isoftmax": {"beta": "beta", "bank": "bank"}, "qbnorm": {"beta": "beta", "bank": "bank"},
    "dual-softmax": {"temp": "temp", "bank": "bank"}, "csls": {"k": "csls_k", "bank": "bank"},
    "aqe": {"n": "aqe", "alpha": "aqe_alpha"}, "dba": {"n": "dba", "alpha": "dba_alpha"},
    "reinspect": {"n": "reinspect", "crops": "crops"},
}
_SWITCH_ON = {"gap": ("gap", "captions"), "gap-centre": ("gap", "requests"), "aqe": ("aqe", RETRIEVAL.aqe_neighbours),
              "dba": ("dba", RETRIEVAL.dba_neighbours), "reinspect": ("reinspect", RETRIEVAL.reinspect_candidates)}
OPTION_SOURCES = {
    "gap": "published: shift along the modality-gap vector (Liang et al., NeurIPS 2022)",
    "gap-centre": "this kit's variant: each modality centred on its own mean (transductive with text=requests)",
    "isoftmax": "published: inverted softmax (Smith et al., ICLR 2017)",
    "qbnorm": "published: QB-Norm's dynamic inverted softmax (Bogolin et al., CVPR 2022)",
    "dual-softmax": "published: dual softmax (Cheng et al., 2021); temp 100 is this kit's choice",
    "csls": "published: CSLS (Conneau et al., ICLR 2018)",
    "aqe": "alpha-QE (Radenovic et al., TPAMI 2018) with scale-free weights: this kit's variant",
    "dba": "published: database-side augmentation (Arandjelovic & Zisserman, CVPR 2012)",
    "reinspect": "this kit's variant: multi-view re-scoring of the top candidates",
}


def prompt_help() -> str:
    """One line per prompt name with its template and source (for --help)."""
    return "; ".join(f"{k} = {PROMPTS[k]!r} ({PROMPT_SOURCES[k]})" for k in PROMPTS)


def method_help() -> str:
    """Every base name and option with its source (for --help)."""
    return "; ".join(f"{k}: {v}" for k, v in {**METHOD_SOURCES, **OPTION_SOURCES}.items())


_R = RETRIEVAL   # every default below is the retrieval table's (engine/presets/retrieval.py)


@dataclass(frozen=True)
class Method:
    name: str = _R.method          # composition: slerp | sum | text-only | pic2word
    weight_concept: float = _R.text_weights[_R.method][0]   # text weight for requests with a shared_concept
    weight_plain: float = _R.text_weights[_R.method][1]     # ... for requests without one (CIRR-style)
    prompt: str = "plain"          # a PROMPTS name, auto (the method's default) or a template string
    gap: str = ""                  # modality-gap correction: "" off, else the text-mean source
    gap_mode: str = "shift"        # shift (Liang et al., GAP_TEXT) | centre (this kit's variant, GAP_CENTRE_TEXT)
    gap_shift: float = _R.gap_shift   # fraction of the gap vector closed (1: the two means meet)
    hubness: str = ""              # "" off, else one of HUBNESS
    bank: str = "gallery"          # query bank of the hubness scorer (BANKS); requests only when named
    beta: float = _R.beta          # isoftmax / qbnorm inverse temperature (QB-Norm's default)
    temp: float = _R.temp          # dual-softmax inverse temperature on cosines (CLIP's logit scale)
    csls_k: int = _R.csls_k        # CSLS neighbourhood size (Conneau et al.)
    aqe: int = 0                   # alpha-QE neighbours, 0 = off
    aqe_alpha: float = _R.aqe_alpha   # exponent on similarities relative to the best neighbour's
    dba: int = 0                   # database-side augmentation neighbours, 0 = off
    dba_alpha: float = _R.dba_alpha
    reinspect: int = 0             # candidates re-inspected per request, 0 = off
    crops: int = _R.crops          # extra views per re-inspected candidate (1..5)

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
        sources = GAP_TEXT if self.gap_mode == "shift" else GAP_CENTRE_TEXT
        checks = [(self.gap_mode in ("shift", "centre"), "gap mode must be shift or centre"),
                  (self.gap in ("", *sources), f"gap{'' if self.gap_mode == 'shift' else '-centre'} text source "
                                               f"must be one of {sources}"),
                  (0.0 <= self.gap_shift <= 2.0, "gap shift must lie in [0, 2]"),
                  (self.hubness in ("", *HUBNESS), f"hubness scorer must be one of {HUBNESS}"),
                  (self.bank in BANKS, f"bank must be one of {BANKS}"),
                  (self.beta > 0 and self.temp > 0, "beta and temp must be > 0"),
                  (self.csls_k >= 1, "csls k must be >= 1"),
                  (self.aqe >= 0 and self.dba >= 0, "aqe / dba neighbours must be >= 0"),
                  (self.aqe_alpha >= 0 and self.dba_alpha >= 0, "alpha must be >= 0"),
                  (self.reinspect >= 0, "reinspect must be >= 0 candidates per request"),
                  (1 <= self.crops <= MAX_CROPS, f"crops must lie in 1..{MAX_CROPS}")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def label(self) -> str:
        """The canonical name: base + options with their non-default values (make_method reads it back)."""
        parts = [self.name]
        on = [("gap", self.gap != "" and self.gap_mode == "shift"),
              ("gap-centre", self.gap != "" and self.gap_mode == "centre"),
              (self.hubness, self.hubness != ""), ("aqe", self.aqe > 0),
              ("dba", self.dba > 0), ("reinspect", self.reinspect > 0)]
        for opt in (o for o, enabled in on if enabled):
            keys = []
            for key, field in _OPTION_KEYS[opt].items():
                switch = _SWITCH_ON.get(opt, (None, None))
                default = switch[1] if field == switch[0] else Method.__dataclass_fields__[field].default
                value = getattr(self, field)
                if value != default:
                    keys.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
            parts.append(":".join([opt, *keys]))
        return "+".join(parts)

    @property
    def uses_bank(self) -> bool:
        """Whether the call's own requests must be encoded before any is answered."""
        return (self.gap_mode == "centre" and self.gap in ("requests", "both")) or (
            self.hubness != "" and self.bank in ("requests", "both"))


def _parse_value(field: str, raw: str):
    kind = Method.__dataclass_fields__[field].type
    try:
        return int(raw) if kind == "int" else float(raw) if kind == "float" else raw
    except ValueError:
        raise ValueError(f"{field}: {raw!r} is not a number") from None


def parse_options(spec: str, say=None, max_reinspect: int | None = None) -> dict:
    """Method fields from `base+opt[:key=value...]...` (see the module docstring); a
    re-inspection count past `max_reinspect` (the caller's limit) is clamped and said."""
    base, *opts = spec.strip().split("+")
    if base not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (optionally +options), got {spec!r}")
    out: dict = {"name": base}
    for opt in opts:
        head, *pairs = opt.split(":")
        if head not in _OPTION_KEYS:
            raise ValueError(f"{spec!r}: unknown option {head!r} (one of {sorted(_OPTION_KEYS)})")
        if head in ("gap", "gap-centre"):
            if out.get("gap"):
                raise ValueError(f"{spec!r}: one gap correction at a time (gap or gap-centre)")
            out["gap_mode"] = "shift" if head == "gap" else "centre"
        if head in HUBNESS:
            if out.get("hubness"):
                raise ValueError(f"{spec!r}: one hubness scorer at a time ({out['hubness']} and {head})")
            out["hubness"] = head
        if head in _SWITCH_ON:
            field, value = _SWITCH_ON[head]
            out[field] = value
        for pair in pairs:
            key, eq, raw = pair.partition("=")
            if not eq or key not in _OPTION_KEYS[head]:
                raise ValueError(f"{spec!r}: {head} takes {', '.join(k + '=' for k in _OPTION_KEYS[head])} "
                                 f"got {pair!r}")
            out[_OPTION_KEYS[head][key]] = _parse_value(_OPTION_KEYS[head][key], raw)
    if max_reinspect is not None and out.get("reinspect", 0) > max_reinspect:
        (say or _stderr)(f"[compose] reinspect:n={out['reinspect']} asks for more than the {max_reinspect} "
                         f"candidates per request allowed; clamped to {max_reinspect}")
        out["reinspect"] = max_reinspect
    return out


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_method(name: str = RETRIEVAL.method, text_weight: float | None = None, prompt: str | None = None,
                max_reinspect: int | None = None) -> Method:
    """A method from its name (`base[+option...]`); `text_weight` overrides both per-request weights;
    a re-inspection count past `max_reinspect` is clamped."""
    fields = parse_options(name, max_reinspect=max_reinspect)
    wc, wp = DEFAULT_WEIGHTS[fields["name"]]
    if text_weight is not None:
        wc = wp = float(text_weight)
    if prompt in (None, "", "auto"):
        prompt = DEFAULT_PROMPTS.get(fields["name"], "plain")
    return Method(weight_concept=wc, weight_plain=wp, prompt=prompt, **fields)


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
