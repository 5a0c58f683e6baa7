"""Top1Model: normalisation + network + top-1 in one graph, the module every backend runs."""
from __future__ import annotations

import torch

from engine.core.precision import apply_policy
from engine.core.spec import Spec


class Top1Model(torch.nn.Module):
    """Only uint8 pixels cross to the device; the int32 top-1 comes back (and, for a guarded
    low-precision graph, the FP32 margin between the two highest logits)."""

    def __init__(self, net: torch.nn.Module, spec: Spec, margin: bool = False):
        super().__init__()
        self.net = net
        self.margin = margin
        self.register_buffer("mean", torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, S, 3] uint8 -> [B, 3, S, S] float32 in [0, 1], as ToTensor + Normalize do
        x = x.permute(0, 3, 1, 2).float().div(255.0)
        x = (x - self.mean) / self.std
        return self.net(x).float()  # [B, num_classes]; the policy keeps the head in FP32

    def forward(self, x: torch.Tensor):
        logits = self.logits(x)
        top1 = logits.argmax(dim=-1).to(torch.int32)                 # [B]
        if not self.margin:
            return top1
        top2 = logits.topk(2, dim=-1).values                          # [B, 2]
        return top1, top2[:, 0] - top2[:, 1]                          # [B] int32, [B] float32


class OnDevice:
    """A backend's graph behind its one input move: a batch on any device in, run on `device`.

    Every backend's `load` returns one, so no caller can hand a graph the wrong device (a
    host tensor reaching a CUDA graph raises in eager mode, and reaches AOTInductor's
    kernels as a host pointer). The move is a no-op for a batch already there (the
    runtime's upload ring, a GPU decoder's output, a CUDA graph's static input).
    """

    def __init__(self, fn, device: str | torch.device):
        self.fn, self.device = fn, torch.device(device)

    def __call__(self, x: torch.Tensor):
        return self.fn(x.to(self.device, non_blocking=True))


def wrap(net: torch.nn.Module, spec: Spec, device: str, margin: bool = False, copy: bool = True) -> Top1Model:
    """Top1Model of `net` (FP32) under the mixed-precision policy of the spec's precision, on `device`
    (`copy=False`: the policy is applied to `net` itself, for a caller that holds it alone)."""
    model = Top1Model(apply_policy(net, spec.precision, copy=copy), spec, margin).to(device).eval()
    if spec.precision == "fp8-torchao":   # torchao quantizes on the device the model runs on
        from engine.core.fp8_torchao import finish

        finish(model, torch.device(device))
    return model


def export_top1(net: torch.nn.Module, spec: Spec, device: str, margin: bool = False):
    """(torch.export program of the policy Top1Model, its example input) at the static batch shape."""
    model = wrap(net, spec, device, margin=margin)
    example = torch.zeros((spec.batch_size, spec.input_size, spec.input_size, 3), dtype=torch.uint8,
                          device=device)  # [B, S, S, 3] uint8: the static shape the run pads to
    with torch.inference_mode():
        return torch.export.export(model, (example,), strict=False), example
