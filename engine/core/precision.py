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

`fp8` (Hopper) takes the GEMMs one step further: every such Linear runs as a rowwise-
scaled float8 e4m3 GEMM (`torch._scaled_mm`: weights quantized per output row at build
time, activations per token at run time, accumulation and output in bf16), its K and N
zero-padded to multiples of 16 inside the layer (exact: zero columns add nothing, padded
outputs are cut off); attention stays bf16, and everything FP32 above stays FP32.

The same policy serves CPU and GPU builds; `describe` records it in the artifact.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}  # fp8: attention in bf16
LOW["fp8-torchao"] = torch.bfloat16   # fp8 GEMMs from torchao (engine.core.fp8_torchao)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
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


def _pad16(n: int) -> int:
    return -n % 16


class Fp8Linear(nn.Module):
    """y = x W^T + b as a rowwise-scaled float8 GEMM; x any float [..., K] -> y bf16 [..., N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.detach().float()                                      # [N, K]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        w = F.pad(w, (0, _pad16(w.shape[1]), 0, _pad16(w.shape[0])))     # [N16, K16], zero rows/cols
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N16, 1]
        self.register_buffer("weight", (w / scale).to(FP8))              # [N16, K16] e4m3
        self.register_buffer("w_scale", scale.t().contiguous())          # [1, N16]
        b = None if bias is None else F.pad(bias.detach().float(), (0, w.shape[0] - self.out_features))
        self.register_buffer("bias", None if b is None else b.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).float()                           # [M, K]
        x = F.pad(x, (0, _pad16(self.in_features)))                      # [M, K16]
        sx = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [M, 1] per token
        y = torch._scaled_mm((x / sx).to(FP8), self.weight.t(), scale_a=sx, scale_b=self.w_scale,
                             bias=self.bias, out_dtype=torch.bfloat16)   # [M, N16]
        return y[:, : self.out_features].reshape(*lead, self.out_features)


def fp8_reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The twin of Fp8Linear.forward in plain FP32 arithmetic on the same quantized values."""
    lead = x.shape[:-1]
    x = F.pad(x.reshape(-1, x.shape[-1]).float(), (0, _pad16(layer.in_features)))
    sx = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (x / sx).to(FP8).float() * sx
    wq = layer.weight.float() * layer.w_scale.t()
    y = xq @ wq.t() + (0 if layer.bias is None else layer.bias.float())
    return y[:, : layer.out_features].reshape(*lead, layer.out_features)


class Fp32Linear(nn.Linear):
    """The classifier head: FP32 weights, and its input upcast (whatever precision precedes it)."""

    @classmethod
    def of(cls, lin: nn.Linear) -> Fp32Linear:
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")  # no init
        new.load_state_dict({k: v.detach().float().clone() for k, v in lin.state_dict().items()}, assign=True)
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


class PendingFp8(LowPrecisionLinear):
    """A bf16 Linear that `engine.core.fp8_torchao.finish` turns into a torchao float8 one on the model's device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, bias, torch.bfloat16)


TORCHAO_FP8 = {  # fp8-torchao as a manifest records it
    "precision": "fp8-torchao", "gemm": "torchao float8 e4m3 (Float8DynamicActivationFloat8WeightConfig, PerRow: "
            "weights per row, activations per token), bf16 output; a Linear whose K or N is not a multiple of 16 "
            "stays bf16 (torchao skips it)",
            "fallback": "without torchao or below compute capability 8.9: the engine's fp8 GEMMs on an fp8 GPU, "
            "else bf16 (one stderr line; ENGINE_FP8_TORCHAO=0 forces it)",
            "attention": "bf16 (SDPA; softmax accumulates in fp32)", "rope": "fp32", "norms": "fp32",
            "residual_stream": "fp32", "patch_embed": "fp32", "head": "fp32"}


INT8 = {  # int8 as a manifest records it (engine.core.int8 builds it)
    "precision": "int8", "gemm": "int8 (PT2E static quantization, torchao X86InductorQuantizer): activations u8 per "
    "tensor with scales observed on the calibration images, weights s8 per output channel, int32 accumulation "
    "(oneDNN qlinear)", "attention": "fp32 (SDPA)", "rope": "fp32", "norms": "fp32", "residual_stream": "fp32",
    "patch_embed": "fp32", "head": "fp32"}


def describe(precision: str) -> dict:
    """The policy as recorded in an artifact's manifest."""
    fused = "q|k|v and SwiGLU fc1_g|fc1_x as one GEMM each where the model has them (exact)"
    if precision == "fp32":
        return {"precision": "fp32", "everything": "fp32", "fused_projections": fused}
    if precision == "fp8-torchao":
        return {**TORCHAO_FP8, "fused_projections": fused}
    if precision == "int8":   # quantized from the FP32 graph at build time: no eager policy of its own
        return {**INT8, "fused_projections": fused}
    if precision == "fp8":
        return {"precision": "fp8", "gemm": "float8 e4m3, rowwise scales (weights per row at build, activations "
                "per token), bf16 accumulate/output, K and N zero-padded to multiples of 16",
                "attention": "bf16 (SDPA; softmax accumulates in fp32)", "rope": "fp32", "norms": "fp32",
                "residual_stream": "fp32", "patch_embed": "fp32", "head": "fp32", "fused_projections": fused}
    return {"precision": precision, "gemm": precision, "attention": f"{precision} (SDPA; softmax accumulates in fp32)",
            "rope": "fp32", "norms": "fp32", "residual_stream": "fp32", "patch_embed": "fp32",
            "head": "fp32", "weights": f"{precision} for every Linear but the head", "fused_projections": fused}


def share_copy(net: nn.Module) -> nn.Module:
    """A copy of the module tree holding the same tensor storage (nothing is copied but the
    modules): new Parameter objects, so `.to()` / `.float()` / replacing a child on the copy
    leave the original as it was. Nothing in the policy writes into a tensor in place."""
    memo: dict[int, object] = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                               for p in net.parameters()}
    memo.update({id(b): b for b in net.buffers()})
    return copy.deepcopy(net, memo)


def apply_policy(net: nn.Module, precision: str, copy: bool = True) -> nn.Module:
    """`net` (FP32, eval) with its projections fused (engine.core.fuse, exact) and the policy for
    `precision` applied; fp32 applies only the fusion. `copy=True`: on a share_copy of `net`
    (the caller's model keeps its layers); `copy=False`: on `net` itself (a fresh load)."""
    from engine.core.fuse import fuse_projections

    net = (share_copy(net) if copy else net).float().eval()
    fuse_projections(net)
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
            elif isinstance(child, nn.Linear) and precision == "fp8-torchao":   # quantized on its device later
                setattr(parent, name, PendingFp8(child.weight, child.bias))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, Fp8Linear(child.weight, child.bias) if precision == "fp8"
                        else LowPrecisionLinear(child.weight, child.bias, dtype))
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
            folded = nn.Linear(qkv.in_features, qkv.out_features, bias=True, device="meta")  # no init
            folded.weight, folded.bias = qkv.weight, nn.Parameter(bias, requires_grad=qkv.weight.requires_grad)
            m.qkv, m.q_bias, m.k_bias, m.v_bias = folded, None, None, None


def native_precisions(device: str) -> tuple[list[str], dict[str, str]]:
    """(precisions this device runs natively, {precision: why not} for the others), read from torch:
    the CPU capability and oneDNN's bf16/fp16 support, or the GPU's compute capability."""
    out, skipped = ["fp32"], {}
    if device == "cpu":
        from engine import settings

        cap = torch.backends.cpu.get_cpu_capability()
        isa = settings.onednn_max_cpu_isa().upper()
        limited = bool(isa) and not isa.startswith(("AVX512", "AVX10", "ALL"))
        wide = cap.startswith("AVX512") or "AMX" in cap
        for p, supported in (("bf16", torch.ops.mkldnn._is_mkldnn_bf16_supported),
                             ("fp16", torch.ops.mkldnn._is_mkldnn_fp16_supported)):
            if wide and not limited and supported():
                out.append(p)
            else:
                skipped[p] = (f"no native {p} on this CPU (capability {cap}"
                              + (f", ONEDNN_MAX_CPU_ISA={isa}" if isa else "")
                              + f", oneDNN {p} {'yes' if supported() else 'no'}): emulated, measure it with "
                              "--search-precisions")
        skipped["fp8"] = "no fp8 GEMMs on the CPU"
        return out, skipped
    major, minor = torch.cuda.get_device_capability()
    cc = (major, minor)
    for p, need in (("bf16", (8, 0)), ("fp16", (7, 0)), ("fp8", (8, 9))):
        if cc >= need:
            out.append(p)
        else:
            skipped[p] = f"compute capability {major}.{minor} < {need[0]}.{need[1]}"
    return out, skipped
