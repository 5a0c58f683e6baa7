"""The CLIP spec: the image `Spec` every decoder reads, plus the text side's facts.

CLIP's eval preprocessing (open_clip `image_transform`, resize_mode `shortest`) is
Resize(short side -> S, bicubic) + CenterCrop(S) + Normalize(OpenAI mean/std): in
`engine.core.spec.Spec` terms crop_mode `center`, crop_pct 1.0. So the same PIL / DALI
decoders that serve the classifier serve the image tower, with no CLIP-specific code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.core.spec import Spec
from engine.presets.retrieval import RETRIEVAL

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
TOKENIZERS = ("clip-bpe",)        # open_clip's SimpleTokenizer (ships its BPE vocab: no download)
LAYOUTS = ("open_clip", "openai", "hf")
_RESIZE_MODES = {"shortest": "center", "squash": "squash"}  # open_clip resize_mode -> Spec.crop_mode
_HF_RESAMPLE = {3: "bicubic", 2: "bilinear", 0: "nearest"}  # PIL resample codes in preprocessor_config.json


@dataclass(frozen=True)
class ClipSpec:
    image: Spec                      # decoders + image tower input (size, crop, interpolation, mean/std)
    context_length: int = 77         # text tower sequence length; longer prompts are truncated
    tokenizer: str = "clip-bpe"
    vocab_size: int = 49408
    embed_dim: int = 512             # joint embedding width D
    layout: str = "open_clip"        # which on-disk layout the weights came from
    arch: str = ""                   # open_clip architecture name when known (e.g. ViT-L-14)

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.context_length < 2 or self.embed_dim < 1:
            raise ValueError("context_length must be >= 2 and embed_dim >= 1")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["image"] = self.image.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClipSpec:
        d = dict(d)
        d["image"] = Spec.from_dict(d["image"])
        return cls(**d)


def _square(size, what: str) -> int:
    """An int side from an int or an (h, w) pair; CLIP towers here are square."""
    if isinstance(size, (list, tuple)):
        if len(size) != 2 or size[0] != size[1]:
            raise ValueError(f"{what}: only square inputs are supported, got {size}")
        size = size[0]
    return int(size)


def image_spec_from_open_clip(model_cfg: dict, preprocess_cfg: dict | None, name: str,
                              batch_size: int = RETRIEVAL.image_batch["cpu"]) -> Spec:
    """Spec from an open_clip model_cfg (+ optional preprocess_cfg, open_clip's field names)."""
    pp = dict(preprocess_cfg or {})
    vision = model_cfg.get("vision_cfg", {})
    size = _square(vision.get("image_size", pp.get("size", 224)), f"{name} vision_cfg.image_size")
    if "size" in pp and _square(pp["size"], f"{name} preprocess_cfg.size") != size:
        raise ValueError(f"{name}: preprocess size {pp['size']} differs from the tower's image_size {size}")
    mode = pp.get("resize_mode", "shortest")
    if mode not in _RESIZE_MODES:
        raise ValueError(f"{name}: resize_mode {mode!r} is not supported (only {sorted(_RESIZE_MODES)})")
    return Spec(model=name, input_size=size, crop_mode=_RESIZE_MODES[mode], crop_pct=1.0,
                interpolation=pp.get("interpolation", "bicubic"),
                mean=tuple(float(v) for v in pp.get("mean", OPENAI_MEAN)),
                std=tuple(float(v) for v in pp.get("std", OPENAI_STD)),
                batch_size=batch_size, num_classes=0)


def image_spec_from_hf(vision_size: int, processor: dict | None, name: str,
                       batch_size: int = RETRIEVAL.image_batch["cpu"]) -> Spec:
    """Spec from a Hugging Face `preprocessor_config.json` (CLIPImageProcessor fields)."""
    p = dict(processor or {})
    crop = p.get("crop_size", vision_size)
    crop = _square((crop["height"], crop["width"]) if isinstance(crop, dict) else crop, f"{name} crop_size")
    if crop != vision_size:
        raise ValueError(f"{name}: preprocessor crop_size {crop} differs from vision image_size {vision_size}")
    short = p.get("size", crop)
    short = int(short.get("shortest_edge", crop)) if isinstance(short, dict) else int(short)
    if not p.get("do_center_crop", True) or short < crop:
        raise ValueError(f"{name}: only resize-short-side + center crop preprocessing is supported")
    resample = p.get("resample", 3)
    if resample not in _HF_RESAMPLE:
        raise ValueError(f"{name}: resample {resample} is not supported ({_HF_RESAMPLE})")
    return Spec(model=name, input_size=crop, crop_mode="center", crop_pct=crop / short,
                interpolation=_HF_RESAMPLE[resample],
                mean=tuple(float(v) for v in p.get("image_mean", OPENAI_MEAN)),
                std=tuple(float(v) for v in p.get("image_std", OPENAI_STD)),
                batch_size=batch_size, num_classes=0)
