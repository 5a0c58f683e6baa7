"""`fp8-torchao`: the fp8 policy with its GEMMs from torchao, PyTorch's low-precision library.

The same recipe as the engine's own `fp8` (engine.core.precision.Fp8Linear): e4m3
weights scaled per output row, activations scaled per token at run time, bf16 output,
attention bf16 and everything the policy keeps FP32 in FP32; here torchao quantizes the
weights (`quantize_` with `Float8DynamicActivationFloat8WeightConfig`, `PerRow`) and runs
the GEMM with its own kernels (torch._scaled_mm, or FBGEMM's where torchao prefers them).
Two differences the build's guard measures: torchao leaves a Linear whose K or N is not
a multiple of 16 in bf16 (the engine pads it), and accumulates with torchao's default
fast accumulation.

torchao quantizes tensors on the device they run on, so the policy (apply_policy) puts a
`PendingFp8` (a bf16 Linear) in each GEMM's place and `finish` quantizes them once the
model is on its device (engine.core.model.wrap). torchao is imported only there.
Where torchao cannot (not importable, `ENGINE_FP8_TORCHAO=0`, not CUDA, compute
capability < 8.9) the layers become the engine's own Fp8Linear on a GPU with fp8 GEMMs,
bf16 GEMMs elsewhere, said in one stderr line.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from engine.core.precision import TORCHAO_FP8, Fp8Linear, LowPrecisionLinear, PendingFp8  # noqa: F401 - the seam


def describe() -> dict:
    """The policy as recorded in an artifact's manifest."""
    return dict(TORCHAO_FP8)


NAME = "fp8-torchao"
FP8_CC = (8, 9)     # the first compute capability with float8 tensor-core GEMMs (Ada, Hopper)
_said: set[str] = set()


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA `device`, None when it has none (CPU, no driver)."""
    if device.type != "cuda":
        return None
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except (RuntimeError, AssertionError, AttributeError):
        return None


def unavailable(device: torch.device) -> str | None:
    """Why torchao's float8 GEMMs cannot run on `device` here, or None when they can."""
    from engine import settings

    if not settings.fp8_torchao():
        return "switched off (ENGINE_FP8_TORCHAO=0)"
    cc = capability(device)
    if cc is None:
        return f"no CUDA compute capability on {device.type} (float8 GEMMs need CUDA >= 8.9)"
    if cc < FP8_CC:
        return f"compute capability {cc[0]}.{cc[1]} < 8.9"
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_  # noqa: F401
    except ImportError as e:
        return f"torchao is not importable ({e})"
    return None


def _refused(device: torch.device) -> str | None:
    """Why torchao refuses to quantize one 16 x 16 layer on `device` (its own hardware checks, an
    API this torchao lacks), or None: asked before the model, so a refusal leaves no layer half done."""
    try:
        from torchao.quantization import quantize_

        probe = nn.Sequential(PendingFp8(torch.zeros(16, 16), None)).to(device)
        quantize_(probe, config(), filter_fn=lambda m, fqn: isinstance(m, PendingFp8))
    except Exception as e:  # noqa: BLE001 - whatever torchao raises, the layers fall back
        return f"torchao refused ({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"
    return None


def config():
    """torchao's rowwise float8 inference recipe; Inductor's global settings are left as they are."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


def finish(model: nn.Module, device: torch.device) -> dict:
    """Quantize every PendingFp8 of `model` (already on `device`) with torchao, or, where torchao
    cannot, turn them into the fallback (one stderr line). Returns what ran:
    {"implementation": "torchao" | "engine" | "bf16", "float8_linears": n, "bf16_linears": m[, "why"]}."""
    pending = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, PendingFp8)]
    why = unavailable(device) or _refused(device)
    if why is None:
        from torchao.quantization import quantize_

        quantize_(model, config(), filter_fn=lambda m, fqn: isinstance(m, PendingFp8))
        n8 = sum(1 for _, _, c in pending if is_float8(c.weight))
        return {"implementation": "torchao", "float8_linears": n8, "bf16_linears": len(pending) - n8}
    cc = capability(device)
    engine_fp8 = cc is not None and cc >= FP8_CC
    fallback = "the engine's own fp8 GEMMs" if engine_fp8 else "bf16 GEMMs"
    say(f"[engine] {NAME}: torchao's float8 GEMMs unavailable: {why}; {fallback} instead")
    for parent, name, child in pending:
        if engine_fp8:
            setattr(parent, name, Fp8Linear(child.weight, child.bias))   # on the device, from the bf16 weights
    return {"implementation": "engine" if engine_fp8 else "bf16", "float8_linears": len(pending) if engine_fp8 else 0,
            "bf16_linears": 0 if engine_fp8 else len(pending), "why": why}


def is_float8(t: torch.Tensor) -> bool:
    """Whether `t` is a torchao float8 tensor (its data e4m3/e5m2, whatever dtype it reports)."""
    data = getattr(t, "qdata", None)
    return isinstance(data, torch.Tensor) and data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def say(line: str) -> None:
    """`line` on stderr, once per process (each graph a build loads would repeat it)."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


def compare_layers(device: str = "cuda", rows: int = 1025 * 8,
                   shapes=((1024, 3072), (1024, 1024), (1024, 2730), (2730, 1024)), seed: int = 0) -> dict:
    """The two fp8 implementations side by side at EVA-02-L's Linear shapes (K, N), for a device
    check: relative error of each against the FP32 GEMM, and median ms of each (and bf16) on CUDA.
    {"unavailable": why} when torchao cannot run here."""
    dev = torch.device(device)
    why = unavailable(dev)
    if why is not None:
        return {"unavailable": why}
    from torchao.quantization import quantize_

    g = torch.Generator().manual_seed(seed)
    out: dict = {"rows": rows, "layers": {}}
    for k, n in shapes:
        w, b = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g) * 0.1
        x = torch.randn(rows, k, generator=g).to(dev)
        ref = torch.nn.functional.linear(x, w.to(dev), b.to(dev))
        ours = Fp8Linear(w, b).to(dev)
        holder = nn.Sequential(PendingFp8(w, b)).to(dev)
        quantize_(holder, config(), filter_fn=lambda m, fqn: isinstance(m, PendingFp8))
        theirs, bf16 = holder[0], LowPrecisionLinear(w, b, torch.bfloat16).to(dev)
        with torch.inference_mode():
            row = {"engine_rel_error": _rel(ours(x), ref), "torchao_rel_error": _rel(theirs(x), ref),
                   "torchao_float8": is_float8(theirs.weight)}
        if dev.type == "cuda":
            row.update(engine_ms=_ms(ours, x), torchao_ms=_ms(theirs, x), bf16_ms=_ms(bf16, x))
        out["layers"][f"{k}x{n}"] = row
    return out


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def _ms(fn, x: torch.Tensor, calls: int = 10, warmup: int = 2) -> float:
    """Median ms of fn(x) on CUDA, each call synchronised, after `warmup` calls."""
    import statistics
    import time

    times = []
    with torch.inference_mode():
        for i in range(warmup + calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)
