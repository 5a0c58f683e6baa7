"""Local checkpoint loading for timm classifiers. Never touches the network.

Weights are read apart from the model (safetensors or a torch state dict, memory-mapped),
key remapping lives in one filter function, and key sets and shapes are checked with
messages that name what differs.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.spec import Spec

_WRAPPER_KEYS = ("state_dict", "model", "module", "model_ema", "state_dict_ema")
_SHOW = 8  # how many differing keys an error message lists


class CheckpointError(RuntimeError):
    """The checkpoint file cannot be used for the requested model."""


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a `.safetensors`, `.pth`, `.pt` or `.bin` file, memory-mapped where possible."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint is not a file: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # every reader error becomes one clear message
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    return filter_state_dict(sd, path)


def filter_state_dict(sd: object, path: Path | str = "<memory>") -> dict[str, torch.Tensor]:
    """Unwrap training wrappers and strip DataParallel / compile prefixes: all remapping is here."""
    for _ in range(2):
        if isinstance(sd, dict):
            for k in _WRAPPER_KEYS:
                if k in sd and isinstance(sd[k], dict):
                    sd = sd[k]
                    break
    if not isinstance(sd, dict) or not sd:
        raise CheckpointError(f"{path}: no state dict found (got {type(sd).__name__})")
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        while k.startswith(("module.", "_orig_mod.")):  # any nesting: compile(DDP(model)), DDP(compile(...))
            k = k.split(".", 1)[1]
        out[k] = v
    if not out:
        raise CheckpointError(f"{path}: the state dict holds no tensors")
    return out


def create_model(spec: Spec) -> torch.nn.Module:
    """The timm architecture of `spec`, randomly initialised, FP32, eval mode, on CPU."""
    import timm

    kwargs = dict(spec.model_kwargs)
    kwargs.setdefault("img_size", spec.input_size)
    try:
        model = timm.create_model(spec.arch, pretrained=False, num_classes=spec.num_classes, **kwargs)
    except RuntimeError as e:
        raise CheckpointError(f"timm cannot build {spec.arch!r}: {e}") from e
    return model.eval()


def check_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor], path: Path | str) -> None:
    """Raise CheckpointError naming missing / unexpected keys and shape mismatches."""
    want = model.state_dict()
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match architecture {type(model).__name__}: "
            f"{len(missing)} missing keys {missing[:_SHOW]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:_SHOW]}"
        )
    bad = [(k, tuple(sd[k].shape), tuple(v.shape)) for k, v in want.items() if sd[k].shape != v.shape]
    if bad:
        lines = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, a, b in bad[:_SHOW])
        raise CheckpointError(f"{path}: {len(bad)} tensors have the wrong shape: {lines}")


def load_model(spec: Spec, checkpoint: str | os.PathLike) -> torch.nn.Module:
    """Build `spec`'s model and load `checkpoint` into it (FP32, eval, CPU)."""
    sd = read_state_dict(checkpoint)
    model = create_model(spec)
    check_state_dict(model, sd, checkpoint)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
    return model
