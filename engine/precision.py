"""The mixed-precision policy: which parts of the network run in the low precision.

Casting a whole network to bf16 rounds the residual stream, the norms and the head's
logits, and top-1 flips on near-ties (at a logit of ~20 the bf16 spacing is 0.125).
The policy keeps the numerically delicate parts in FP32 and puts the work in the
low precision:

    GEMMs (every Linear but the classifier head)   low precision, weights stored in it
    attention (SDPA on q, k, v)                     low precision; softmax accumulates in FP32 inside
    RoPE                                            FP32 (timm rotates in the promoted dtype, then rounds)
    LayerNorm / RMSNorm / GroupNorm                 FP32 (inputs upcast)
    residual stream, layer scales, pos embed        FP32 (a low-precision branch output promotes on add)
    patch embedding (conv), classifier head, pool   FP32

The same policy serves CPU and GPU builds; `describe` records it in the artifact.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
_NORMS = (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))


class LowPrecisionLinear(nn.Module):
    """y = x W^T + b with x, W, b in the low precision; y stays low precision (into SDPA or
    the next op; a residual add promotes it back to FP32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class Fp32Linear(nn.Linear):
    """The classifier head: FP32 weights, and its input upcast (whatever precision precedes it)."""

    @classmethod
    def of(cls, lin: nn.Linear) -> Fp32Linear:
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None)
        new.load_state_dict(lin.float().state_dict())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias)


class Fp32Norm(nn.Module):
    """A norm layer that upcasts its input: statistics and affine in FP32, output FP32."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.float())


def describe(precision: str) -> dict:
    """The policy as recorded in an artifact's manifest."""
    if precision == "fp32":
        return {"precision": "fp32", "everything": "fp32"}
    return {"precision": precision, "gemm": precision, "attention": f"{precision} (SDPA; softmax accumulates in fp32)",
            "rope": "fp32", "norms": "fp32", "residual_stream": "fp32", "patch_embed": "fp32",
            "head": "fp32", "weights": f"{precision} for every Linear but the head"}


def apply_policy(net: nn.Module, precision: str) -> nn.Module:
    """A copy of `net` (FP32, eval) with the policy for `precision` applied; fp32 returns a copy as is."""
    net = copy.deepcopy(net).float().eval()
    if precision == "fp32":
        return net
    if precision not in LOW:
        raise ValueError(f"precision must be fp32 or one of {sorted(LOW)}, got {precision!r}")
    dtype = LOW[precision]
    head = net.get_classifier() if hasattr(net, "get_classifier") else None
    _fold_qkv_bias(net)
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if child is head and isinstance(child, nn.Linear):
                setattr(parent, name, Fp32Linear.of(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, LowPrecisionLinear(child.weight, child.bias, dtype))
            elif isinstance(child, _NORMS):
                setattr(parent, name, Fp32Norm(child))
    return net


def _fold_qkv_bias(net: nn.Module) -> None:
    """timm's EvaAttention adds separate q/v biases to a fused qkv GEMM through its weight
    (F.linear(x, qkv.weight, cat(q_bias, k_bias, v_bias))); fold them into the Linear so
    the low-precision Linear owns the whole GEMM. Exact: the same sum, one place."""
    for m in net.modules():
        qkv, q_bias = getattr(m, "qkv", None), getattr(m, "q_bias", None)
        if isinstance(qkv, nn.Linear) and isinstance(q_bias, torch.Tensor):
            bias = torch.cat((m.q_bias, m.k_bias, m.v_bias)).detach()
            if qkv.bias is not None:
                bias = bias + qkv.bias.detach()
            folded = nn.Linear(qkv.in_features, qkv.out_features, bias=True)
            folded.weight, folded.bias = qkv.weight, nn.Parameter(bias)
            m.qkv, m.q_bias, m.k_bias, m.v_bias = folded, None, None, None
