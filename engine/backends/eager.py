"""`eager`: the timm modules themselves; the reference form of every precision.

The artifact keeps the FP32 weights; the precision policy (engine.core.precision) is applied
when the run loads them, so one file serves the low-precision graph and its FP32 twin.
"""
from __future__ import annotations

import torch

from engine.core.model import OnDevice, wrap

NAME = "eager"
FILES = ("weights.safetensors",)
COMPILED: tuple[str, ...] = ()
NEEDS_WEIGHTS = True
COMPILES = False
AUTO = True


def save(net: torch.nn.Module, spec, device: str, out_dir, margin: bool = False) -> dict:
    from safetensors.torch import save_file

    sd = {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
          for k, v in net.state_dict().items()}
    save_file(sd, str(out_dir / FILES[0]))
    return {}


def load(artifact, device: torch.device):
    from safetensors.torch import load_file

    from engine.core.checkpoint import model_with_weights

    # built on the meta device, the file's tensors assigned (no random init, no copy); the policy
    # is applied to this model itself: nothing else holds it
    path = artifact.path(FILES[0])
    net = model_with_weights(artifact.spec, load_file(str(path)), path)
    margin = bool(artifact.meta.get("guard"))
    return OnDevice(wrap(net, artifact.spec, str(device), margin=margin, copy=False), device)
