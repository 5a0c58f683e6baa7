"""CLIP towers from a local directory (the caller's, else `CLIP_MODEL_DIR`). No network.

Three layouts are accepted (`find_layout` says which, or names what is missing):

- open_clip: `open_clip_config.json` (`model_cfg`, optional `preprocess_cfg`) + weights
  `open_clip_model.safetensors` / `open_clip_pytorch_model.{safetensors,bin,pth}`;
- openai: one state-dict file (`.pt` TorchScript archive as OpenAI ships it, `.pth`, `.bin`,
  `.safetensors`) + an architecture name (`model_name`, env `CLIP_MODEL_NAME`, or
  `model_name.txt`), an open_clip built-in name or `DIR/NAME.json`; with no name the
  OpenAI ViT architecture is inferred from tensor shapes (heads = width / 64, QuickGELU);
- hf: a transformers `CLIPModel` folder, `config.json` + `model.safetensors` (or
  `pytorch_model.bin`), optional `preprocessor_config.json`; converted by `engine.clip.hf`.

Every layout ends in the same open_clip model built with `pretrained=None` semantics
(random init, then our own state-dict load with key/shape checks), and one `ClipSpec`.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import settings
from engine.clip.spec import ClipSpec, image_spec_from_hf, image_spec_from_open_clip
from engine.core.checkpoint import CheckpointError, check_state_dict, filter_state_dict, read_state_dict
from engine.presets.retrieval import RETRIEVAL

OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth")
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
_OPENAI_EXTRA = ("input_resolution", "context_length", "vocab_size")  # ints in OpenAI's archives


class ClipLoadError(CheckpointError):
    """The directory does not hold a usable CLIP; the message names what is missing."""


@dataclass
class Layout:
    kind: str                   # open_clip | openai | hf
    weights: Path
    config: Path | None = None  # open_clip_config.json / config.json / NAME.json
    extra: list[Path] = field(default_factory=list)  # other files that decide the numbers
    arch: str = ""

    def files(self) -> list[Path]:
        """Every file that decides the model's numbers."""
        return [self.weights] + ([self.config] if self.config else []) + self.extra


def model_dir(path: str | os.PathLike | None = None) -> Path:
    """`path`, else env CLIP_MODEL_DIR; ClipLoadError when neither names one."""
    found = path or settings.clip_model_dir()
    if not found:
        raise ClipLoadError("no CLIP model folder given: pass one or set CLIP_MODEL_DIR")
    return Path(found)


def find_layout(path: str | os.PathLike, model_name: str | None = None) -> Layout:
    """Which layout `path` holds (a directory, or a single state-dict file)."""
    p = Path(path)
    if not p.exists():
        raise ClipLoadError(f"CLIP model path not found: {p} (set CLIP_MODEL_DIR or --model-dir)")
    if p.is_file():
        return _openai_layout(p.parent, p, model_name)
    oc_cfg, hf_cfg = p / "open_clip_config.json", p / "config.json"
    if oc_cfg.is_file():
        w = _first(p, OPEN_CLIP_WEIGHTS)
        if w is None:
            raise ClipLoadError(f"{p}: open_clip_config.json found but no weights: expected one of "
                                f"{', '.join(OPEN_CLIP_WEIGHTS)}")
        return Layout("open_clip", w, oc_cfg)
    if hf_cfg.is_file():
        w = _first(p, HF_WEIGHTS)
        if w is None:
            raise ClipLoadError(f"{p}: config.json (Hugging Face CLIPModel) found but no weights: expected "
                                f"{' or '.join(HF_WEIGHTS)}")
        pre = p / "preprocessor_config.json"
        return Layout("hf", w, hf_cfg, [pre] if pre.is_file() else [])
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in STATE_DICT_SUFFIXES)
    if len(files) == 1:
        return _openai_layout(p, files[0], model_name)
    if len(files) > 1:
        raise ClipLoadError(f"{p}: several state-dict files {[f.name for f in files]}; point CLIP_MODEL_DIR "
                            "at one of them")
    raise ClipLoadError(
        f"no CLIP model in {p}: expected (a) open_clip_config.json + {OPEN_CLIP_WEIGHTS[1]} (or .bin), "
        "(b) one .pt/.pth/.bin/.safetensors state dict [+ model_name.txt], or "
        f"(c) Hugging Face config.json + {HF_WEIGHTS[0]}")


def _first(d: Path, names) -> Path | None:
    return next((d / n for n in names if (d / n).is_file()), None)


def _openai_layout(d: Path, weights: Path, model_name: str | None) -> Layout:
    name_file = d / "model_name.txt"
    try:
        name = model_name or settings.clip_model_name() or (
            name_file.read_text(encoding="utf-8").strip() if name_file.is_file() else "")
    except (OSError, UnicodeDecodeError) as e:
        raise ClipLoadError(f"cannot read {name_file}: {e}") from e
    extra = [name_file] if name_file.is_file() and not model_name else []
    cfg = d / f"{name}.json" if name else None
    return Layout("openai", weights, cfg if cfg is not None and cfg.is_file() else None, extra, name)


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ClipLoadError(f"cannot read {path}: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise ClipLoadError(f"{path}: a JSON {type(raw).__name__}, not a config object")
    return raw


def read_weights(layout: Layout) -> dict[str, torch.Tensor]:
    """Tensors in open_clip key names, whatever the layout."""
    try:
        sd = read_state_dict(layout.weights)
    except CheckpointError as first:
        if layout.weights.suffix != ".pt":
            raise
        try:  # OpenAI ships TorchScript archives, which torch.load(weights_only=True) refuses
            sd = filter_state_dict(torch.jit.load(str(layout.weights), map_location="cpu").state_dict(),
                                   layout.weights)
        except Exception as e:  # noqa: BLE001 - report both readers' errors
            raise ClipLoadError(f"{layout.weights}: neither a state dict ({first}) nor a TorchScript "
                                f"archive ({type(e).__name__}: {e})") from e
    if layout.kind == "hf":
        from engine.clip.hf import hf_to_open_clip

        sd = hf_to_open_clip(sd)
    for k in _OPENAI_EXTRA:
        sd.pop(k, None)
    sd.pop("text.transformer.embeddings.position_ids", None)
    return sd


def model_cfg_for(layout: Layout, sd: dict[str, torch.Tensor]) -> tuple[dict, dict, str]:
    """(open_clip model_cfg, preprocess hints, arch name) for a layout."""
    import open_clip

    if layout.kind == "open_clip":
        raw = _read_json(layout.config)
        if "model_cfg" not in raw:
            raise ClipLoadError(f"{layout.config}: no 'model_cfg' key")
        return copy.deepcopy(raw["model_cfg"]), dict(raw.get("preprocess_cfg") or {}), raw.get("model_name", "")
    if layout.kind == "hf":
        from engine.clip.hf import is_hf_clip_config, model_cfg_from_hf

        raw = _read_json(layout.config)
        if not is_hf_clip_config(raw):
            raise ClipLoadError(f"{layout.config}: not a Hugging Face CLIPModel config (model_type "
                                f"{raw.get('model_type')!r})")
        pre = _read_json(layout.extra[0]) if layout.extra else {}
        return model_cfg_from_hf(raw), pre, raw.get("_name_or_path", "")
    if layout.config is not None:                      # DIR/NAME.json, open_clip's model-config format
        raw = _read_json(layout.config)
        return raw.get("model_cfg", raw), dict(raw.get("preprocess_cfg") or {}), layout.arch
    if layout.arch:
        cfg = open_clip.get_model_config(layout.arch)
        if cfg is None:
            raise ClipLoadError(f"model name {layout.arch!r} is neither an open_clip built-in config nor a file "
                                f"{layout.weights.parent / (layout.arch + '.json')}")
        return cfg, dict(cfg.pop("preprocess_cfg", None) or {}), layout.arch
    print(f"[engine] {layout.weights}: no model name given (model_name.txt / CLIP_MODEL_NAME); inferring an "
          "OpenAI ViT CLIP from tensor shapes (heads = width/64, QuickGELU)", file=sys.stderr)
    return infer_openai_cfg(sd, layout.weights), {}, ""


def infer_openai_cfg(sd: dict[str, torch.Tensor], where: Path | str = "<memory>") -> dict:
    """model_cfg of an OpenAI-architecture ViT CLIP from its tensors (as open_clip's
    `build_model_from_openai_state_dict` infers it, without building the model)."""
    if "visual.proj" not in sd or "visual.conv1.weight" not in sd:
        raise ClipLoadError(f"{where}: cannot infer the architecture (not a ViT CLIP state dict): "
                            "give the model name in model_name.txt or CLIP_MODEL_NAME")
    vw = sd["visual.conv1.weight"].shape[0]
    patch = sd["visual.conv1.weight"].shape[-1]
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    tw = sd["ln_final.weight"].shape[0]
    return {
        "embed_dim": sd["text_projection"].shape[1], "quick_gelu": True,
        "vision_cfg": {"layers": len({k.split(".")[3] for k in sd if k.startswith("visual.transformer.resblocks.")}),
                       "width": vw, "patch_size": patch, "image_size": patch * grid},
        "text_cfg": {"context_length": sd["positional_embedding"].shape[0],
                     "vocab_size": sd["token_embedding.weight"].shape[0], "width": tw, "heads": tw // 64,
                     "layers": len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})},
    }


def build_open_clip(model_cfg: dict) -> torch.nn.Module:
    """The open_clip model class for `model_cfg`, randomly initialised, FP32, eval (never downloads)."""
    from open_clip.model import CLIP, CustomTextCLIP

    cfg = copy.deepcopy(model_cfg)
    text = cfg.get("text_cfg", {})
    if text.get("hf_model_name") or text.get("hf_tokenizer_name"):
        raise ClipLoadError("CLIP configs with a Hugging Face text tower/tokenizer need `transformers`, which "
                            "this engine does not use; only CLIP BPE text towers are supported")
    if "multimodal_cfg" in cfg:
        raise ClipLoadError("CoCa configs (multimodal_cfg) are not supported")
    if cfg.get("vision_cfg", {}).get("timm_model_name"):
        cfg["vision_cfg"]["timm_model_pretrained"] = False   # never fetch base weights
    cls = CustomTextCLIP if cfg.pop("custom_text", False) else CLIP
    cfg.pop("preprocess_cfg", None)
    return cls(**cfg).eval()


def _fit_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip's own checkpoint massaging: old text-tower names, scalar logit_scale."""
    from open_clip.model import convert_to_custom_text_state_dict

    if "positional_embedding" in sd and not hasattr(model, "positional_embedding"):
        sd = convert_to_custom_text_state_dict(sd)
    want = model.state_dict()
    for k in ("logit_scale", "logit_bias"):
        if k in sd and k in want and sd[k].ndim != want[k].ndim:
            sd[k] = sd[k].reshape(want[k].shape)
    return sd


def file_digest(paths: list[Path], salt: str = "") -> str:
    """sha256 over `salt` and (name, bytes) of every file that decides the model's numbers."""
    h = hashlib.sha256(salt.encode() + b"\0")
    for p in sorted(paths, key=lambda q: q.name):
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def layout_digest(layout: Layout) -> str:
    """The model digest of a layout (load_clip's info["digest"]), from its files alone."""
    return file_digest(layout.files(), salt=f"{layout.kind}:{layout.arch}")


def load_clip(path: str | os.PathLike | None = None, model_name: str | None = None,
              batch_size: int = RETRIEVAL.image_batch["cpu"]):
    """(open_clip model FP32 eval CPU, ClipSpec, info dict with digest and files) from a local dir.

    Every problem with the files (missing, truncated, malformed, wrong shapes) is one
    ClipLoadError naming the folder and what is wrong.
    """
    root = model_dir(path)
    try:
        return _load_clip(root, model_name, batch_size)
    except ClipLoadError:
        raise
    except (CheckpointError, OSError, KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ClipLoadError(f"{root}: cannot load the CLIP: {type(e).__name__}: {first}") from e


def _load_clip(root: Path, model_name: str | None, batch_size: int):
    layout = find_layout(root, model_name)
    sd = read_weights(layout)
    model_cfg, pre, arch = model_cfg_for(layout, sd)
    try:
        model = build_open_clip(model_cfg)
    except (TypeError, ValueError) as e:
        raise ClipLoadError(f"{root}: open_clip cannot build the model config: {e}") from e
    sd = _fit_state_dict(model, sd)
    check_state_dict(model, sd, layout.weights)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
    arch = arch or layout.arch or f"{layout.kind}-clip"
    if layout.kind == "hf":
        image = image_spec_from_hf(model_cfg["vision_cfg"]["image_size"], pre, arch, batch_size)
    else:
        image = image_spec_from_open_clip(model_cfg, pre, arch, batch_size)
    text = model_cfg.get("text_cfg", {})
    if text.get("vocab_size", 49408) != 49408:
        raise ClipLoadError(f"{root}: text vocab_size {text['vocab_size']} is not CLIP BPE's 49408")
    spec = ClipSpec(image=image, context_length=int(text.get("context_length", 77)),
                    vocab_size=int(text.get("vocab_size", 49408)), embed_dim=int(model_cfg["embed_dim"]),
                    layout=layout.kind, arch=arch)
    info = {"dir": str(root), "layout": layout.kind, "arch": arch, "files": [str(f) for f in layout.files()],
            "digest": layout_digest(layout)}
    return model, spec, info
