"""Exact projection fusion at build time: fewer, larger GEMMs, the same arithmetic.

- EvaAttention with separate q/k/v Linears (EVA-02-L) -> one qkv Linear of the stacked
  weights (k has no bias: zeros), read back by timm's own fused path.
- SwiGLU's fc1_g and fc1_x (both read the same input) -> one Linear of the stacked
  weights, split after the GEMM.
Each output element is the same dot product as before: only the launch count changes.
`fuse_projections` returns what it fused, for the artifact's manifest.
"""
from __future__ import annotations

import torch
from torch import nn


class FusedSwiGLU(nn.Module):
    """timm's SwiGLU with fc1_g | fc1_x as one GEMM: [.., D] -> [.., 2H] -> act(gate) * x -> norm -> fc2."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.hidden = mlp.fc1_g.out_features
        g, x = mlp.fc1_g, mlp.fc1_x
        self.fc1 = stacked_linear([g, x])
        self.act, self.norm, self.fc2 = mlp.act, mlp.norm, mlp.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, val = self.fc1(x).split(self.hidden, dim=-1)
        return self.fc2(self.norm(self.act(gate) * val))


def stacked_linear(parts: list[nn.Linear], bias: bool | None = None) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side: weights [sum N_i, K] stacked,
    biases stacked (a part without one adds zeros; `bias=None`: a bias when the first part has
    one). Built on the meta device and assigned: no random initialisation, one copy (the cat)."""
    bias = parts[0].bias is not None if bias is None else bias
    w = parts[0].weight
    lin = nn.Linear(w.shape[1], sum(p.out_features for p in parts), bias=bias, device="meta", dtype=w.dtype)
    with torch.no_grad():
        state = {"weight": torch.cat([p.weight for p in parts])}
        if bias:
            state["bias"] = torch.cat([p.bias if p.bias is not None else w.new_zeros(p.out_features)
                                       for p in parts])
    lin.load_state_dict(state, assign=True)
    return lin


def fuse_projections(net: nn.Module) -> dict:
    """Fuse in place; returns {"qkv": n attention blocks, "swiglu": n MLPs} fused."""
    done = {"qkv": 0, "swiglu": 0}
    for m in net.modules():
        if getattr(m, "qkv", 1) is None and all(isinstance(getattr(m, f"{p}_proj", None), nn.Linear) for p in "qkv"):
            q, k, v = m.q_proj, m.k_proj, m.v_proj
            qkv = stacked_linear([q, k, v], bias=True)
            m.qkv, m.q_proj, m.k_proj, m.v_proj = qkv, None, None, None
            for name in ("q_bias", "k_bias", "v_bias"):
                if not hasattr(m, name):
                    setattr(m, name, None)
            done["qkv"] += 1
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if all(isinstance(getattr(child, f, None), nn.Linear) for f in ("fc1_g", "fc1_x", "fc2")) and \
                    child.fc1_g.in_features == child.fc1_x.in_features:
                setattr(parent, name, FusedSwiGLU(child))
                done["swiglu"] += 1
    return done
