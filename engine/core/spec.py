"""One record per model: everything that decides its numbers.

The spec is resolved from timm's `pretrained_cfg` (no network: the cfg is registry
data shipped with timm), every field overridable, and written into each artifact's
manifest so that every preprocessing backend reads the same values.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

CROP_MODES = ("center", "squash")
PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "fp8-torchao", "int8")  # fp8: rowwise-scaled e4m3 GEMMs
# (engine.core.precision); fp8-torchao: the same recipe from torchao (engine.core.fp8_torchao); int8: CPU
# PT2E static quantization (engine.core.int8)
INTERPOLATIONS = ("bicubic", "bilinear", "nearest")


def _static_batch() -> int:
    """A spec's batch when none is given: a spec names no device, so the CPU preset's static batch
    (engine/presets/classification.py; the build always gives the batch it builds)."""
    from engine.presets import preset

    return preset("cpu").static_batch_size


@dataclass(frozen=True)
class Spec:
    model: str                      # timm name, e.g. eva02_large_patch14_448.mim_m38m_ft_in22k_in1k
    input_size: int                 # square side S of the network input
    crop_mode: str = "center"       # center: short side -> S/crop_pct, center crop; squash: (S, S) directly
    crop_pct: float = 1.0
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    precision: str = "fp32"
    batch_size: int = field(default_factory=_static_batch)
    num_classes: int = 1000
    # extra timm constructor kwargs (tiny test models shrink depth/width here)
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode must be one of {CROP_MODES}, got {self.crop_mode!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        if self.input_size <= 0 or self.batch_size <= 0:
            raise ValueError("input_size and batch_size must be positive")

    @property
    def arch(self) -> str:
        """timm architecture name without the weights tag."""
        return self.model.split(".", 1)[0]

    @property
    def scale_size(self) -> int:
        """Resize target before the crop, as timm computes it (floor(S / crop_pct))."""
        import math

        return math.floor(self.input_size / self.crop_pct)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Spec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown spec fields: {sorted(unknown)}")
        d = dict(d)
        for k in ("mean", "std"):
            if k in d:
                d[k] = tuple(float(v) for v in d[k])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def resolve_spec(model: str, **overrides: Any) -> Spec:
    """Spec from timm's pretrained_cfg for `model`, then `overrides` (None values ignored).

    Unknown tags fall back to the architecture's default cfg; a name timm does not know
    at all needs every preprocessing field given explicitly.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    base: dict[str, Any] = {"model": model}
    cfg = _pretrained_cfg(model)
    if cfg is not None:
        base.update(
            input_size=int(cfg.input_size[-1]),
            crop_mode=cfg.crop_mode or "center",
            crop_pct=float(cfg.crop_pct or 0.875),
            interpolation=cfg.interpolation or "bicubic",
            mean=tuple(cfg.mean),
            std=tuple(cfg.std),
            num_classes=int(cfg.num_classes or 1000),
        )
    elif "input_size" not in overrides:
        raise ValueError(f"timm has no pretrained cfg for {model!r}: pass --input-size and the other fields")
    base.update(overrides)
    return Spec.from_dict(base)


def _pretrained_cfg(model: str):
    """timm's cfg for `model`; an unknown tag falls back to the architecture's default cfg."""
    from timm.models import get_pretrained_cfg

    names = [model, model.split(".", 1)[0]] if "." in model else [model]
    for name in names:
        try:
            cfg = get_pretrained_cfg(name)
        except (RuntimeError, KeyError):
            continue
        if cfg is not None:
            return cfg
    return None
