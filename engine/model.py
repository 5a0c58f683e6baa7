"""Top1Model: normalisation + network + argmax in one graph, the module every backend runs."""
from __future__ import annotations

import torch

from engine.spec import Spec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Top1Model(torch.nn.Module):
    """Only uint8 pixels cross to the device; the int32 top-1 comes back."""

    def __init__(self, net: torch.nn.Module, spec: Spec):
        super().__init__()
        self.net = net
        self.dtype = DTYPES[spec.precision]
        self.register_buffer("mean", torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, S, 3] uint8 -> [B, 3, S, S] float32 in [0, 1], as ToTensor + Normalize do
        x = x.permute(0, 3, 1, 2).float().div(255.0)
        x = (x - self.mean) / self.std
        return self.net(x.to(self.dtype)).float()  # [B, num_classes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x).argmax(dim=-1).to(torch.int32)  # [B]


def wrap(net: torch.nn.Module, spec: Spec, device: str) -> Top1Model:
    """Top1Model in the spec's precision on `device` (norm buffers stay FP32)."""
    return Top1Model(net.to(DTYPES[spec.precision]), spec).to(device).eval()
