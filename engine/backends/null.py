"""`null`: loads nothing and answers class 0 for every image (MLPerf's backend_null).

For evaluator tests and pipeline measurements that need no model: the whole ABI runs
(manifest, reads, decode, output) in milliseconds per batch.
"""
from __future__ import annotations

import torch

NAME = "null"
FILES: tuple[str, ...] = ()
COMPILED: tuple[str, ...] = ()
NEEDS_WEIGHTS = False
COMPILES = False
AUTO = False


def save(net, spec, device: str, out_dir, margin: bool = False) -> dict:
    return {}


def load(artifact, device: torch.device):
    def top1(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], dtype=torch.int32, device=device)  # [B] class 0, on the artifact's device

    return top1
