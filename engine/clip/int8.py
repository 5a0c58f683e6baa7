"""INT8 CLIP towers on the CPU: torchao's dynamic INT8 recipe, a tower candidate like fp16 on CUDA.

`Int8DynamicActivationInt8WeightConfig`: every Linear of the tower graph (the MLPs' c_fc and
c_proj, the bulk of a ViT's GEMMs) holds int8 weights scaled per output channel, and its
input is quantized per token at run time; attention (nn.MultiheadAttention's packed
projections), norms, the patch embedding and the final projection stay FP32. No calibration
data: the weights alone decide the quantized model, so the query run rebuilds exactly the
tower the index build measured from the same FP32 checkpoint.

The tower criterion decides (engine.clip.tune: cosine and top-50 against FP32 eager on the
gallery's own sample); the candidate table records each int8 row as it records the others.
torchao is imported only here. `CLIP_TOWERS_INT8=0` (engine.settings) measures no int8
candidate, and a query run of an index that chose one runs eager towers, said in one line.
"""
from __future__ import annotations

import torch
from torch import nn

PRECISION = "int8"


def unavailable(device: str) -> str | None:
    """Why an int8 tower cannot be built on `device` here, or None."""
    from engine import settings

    if not settings.clip_towers_int8():
        return "switched off (CLIP_TOWERS_INT8=0)"
    if device != "cpu":
        return f"int8 towers are a CPU candidate, not {device}'s"
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_  # noqa: F401
    except ImportError as e:
        return f"torchao is not importable ({e})"
    return None


def _gemm_linears(graph: nn.Module) -> set[int]:
    """ids of the Linears the recipe quantizes: all but a MultiheadAttention's out_proj (its
    forward reads the weight itself, outside nn.Linear)."""
    inside_mha = {id(m.out_proj) for m in graph.modules() if isinstance(m, nn.MultiheadAttention)}
    return {id(m) for m in graph.modules() if isinstance(m, nn.Linear) and id(m) not in inside_mha}


def quantize(graph: nn.Module, device: str = "cpu") -> nn.Module:
    """`graph` (an FP32 tower graph, engine.clip.compiled) with its GEMM Linears dynamic INT8, in
    place. RuntimeError saying why when int8 towers cannot be built here."""
    why = unavailable(device)
    if why is not None:
        raise RuntimeError(f"int8 towers unavailable: {why}")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    chosen = _gemm_linears(graph)
    if not chosen:
        raise RuntimeError("int8 towers: the graph has no Linear to quantize")
    quantize_(graph, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
              filter_fn=lambda m, fqn: id(m) in chosen)
    return graph


def int8_linears(graph: nn.Module) -> int:
    """How many Linears of `graph` hold torchao int8 weights."""
    return sum(1 for m in graph.modules() if isinstance(m, nn.Linear)
               and getattr(getattr(m.weight, "qdata", None), "dtype", None) == torch.int8)
