"""Local checkpoint loading for timm classifiers. Never touches the network.

Weights are read apart from the model (safetensors or a torch state dict, memory-mapped),
key remapping lives in one filter function, and key sets and shapes are checked with
messages that name what differs.

The model is built on the meta device (shapes only: no storage, no random initialisation)
and the checkpoint's tensors are assigned into it (`load_state_dict(assign=True)`, no copy).
Buffers no state dict holds (EVA-02's RoPE tables and zero k-bias) are then computed on
the CPU by their module's own `init_non_persistent_buffers`, as timm's constructor computes
them. The reference twin builds on the CPU with random weights and copies the checkpoint
in (`meta=False`, the off switch); a module whose buffers cannot be computed falls back to
it, saying why on stderr.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from engine.core.spec import Spec

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


def create_model(spec: Spec, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The timm architecture of `spec`, FP32, eval mode: randomly initialised on the CPU, or
    with device="meta" shapes only (no storage, no initialisation work) for `assign_weights`."""
    import timm

    kwargs = dict(spec.model_kwargs)
    kwargs.setdefault("img_size", spec.input_size)
    try:
        with torch.device(device):
            model = timm.create_model(spec.arch, pretrained=False, num_classes=spec.num_classes, **kwargs)
    except RuntimeError as e:
        raise CheckpointError(f"timm cannot build {spec.arch!r}: {e}") from e
    return model.eval()


class MetaLoadError(CheckpointError):
    """A meta-built model holds tensors that neither the state dict nor its modules can fill."""


def materialize_buffers(model: torch.nn.Module) -> None:
    """Allocate on the CPU the buffers still on the meta device (non-persistent ones: in no
    state dict) and compute them with their module's `init_non_persistent_buffers` (timm's hook
    for meta-built models: RoPE bands and tables, EVA's zero k-bias). Raises MetaLoadError
    when a module has such buffers but no hook, or when any tensor is still meta after."""
    owners = []
    for name, m in model.named_modules():
        meta = [b for b, t in m._buffers.items() if t is not None and t.is_meta]
        if not meta:
            continue
        if not callable(getattr(m, "init_non_persistent_buffers", None)):
            raise MetaLoadError(f"{type(m).__name__} {name or '<root>'} has buffers {meta} outside the state "
                                "dict and no init_non_persistent_buffers to compute them")
        for b in meta:
            m._buffers[b] = torch.empty_like(m._buffers[b], device="cpu")
        owners.append(m)
    with torch.no_grad():
        for m in owners:
            m.init_non_persistent_buffers()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise MetaLoadError(f"{len(left)} tensors are still on the meta device after loading: {left[:_SHOW]}")


def assign_weights(model: torch.nn.Module, sd: dict[str, torch.Tensor], path: Path | str) -> torch.nn.Module:
    """`model` (built on the meta device) holding `sd`'s tensors themselves (cast only where the
    dtype differs from the architecture's), its non-persistent buffers computed."""
    check_state_dict(model, sd, path)
    want = model.state_dict()
    model.load_state_dict({k: v if v.dtype == want[k].dtype else v.to(want[k].dtype) for k, v in sd.items()},
                          assign=True)
    materialize_buffers(model)
    return model


def model_with_weights(spec: Spec, sd: dict[str, torch.Tensor], path: Path | str,
                       meta: bool = True) -> torch.nn.Module:
    """`spec`'s model (eval, CPU) holding `sd`: built on the meta device and assigned (the default),
    or built with random weights and `sd` copied in (`meta=False`, the reference twin)."""
    if meta:
        try:
            return assign_weights(create_model(spec, "meta"), sd, path)
        except MetaLoadError as e:
            print(f"[engine] meta-device load of {spec.arch} failed ({e}); building it on the CPU", file=sys.stderr)
    model = create_model(spec)
    check_state_dict(model, sd, path)
    model.load_state_dict(sd)
    return model


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


def load_model(spec: Spec, checkpoint: str | os.PathLike, meta: bool = True) -> torch.nn.Module:
    """Build `spec`'s model and load `checkpoint` into it (FP32, eval, CPU; see model_with_weights)."""
    sd = read_state_dict(checkpoint)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    return model_with_weights(spec, sd, checkpoint, meta)
