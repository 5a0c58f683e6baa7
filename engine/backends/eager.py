"""`eager`: the timm modules themselves, weights converted to the run precision at build time."""
from __future__ import annotations

import torch

from engine.model import wrap

NAME = "eager"
FILES = ("weights.safetensors",)
COMPILED: tuple[str, ...] = ()
NEEDS_WEIGHTS = True


def save(net: torch.nn.Module, spec, device: str, out_dir) -> dict:
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in wrap(net, spec, "cpu").net.state_dict().items()}
    save_file(sd, str(out_dir / FILES[0]))
    return {}


def load(artifact, device: torch.device):
    from safetensors.torch import load_file

    from engine.checkpoint import check_state_dict, create_model

    net = create_model(artifact.spec)
    sd = load_file(str(artifact.path(FILES[0])))
    check_state_dict(net, sd, artifact.path(FILES[0]))
    net.load_state_dict(sd)
    return wrap(net, artifact.spec, str(device))
