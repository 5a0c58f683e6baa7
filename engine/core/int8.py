"""`int8` on the CPU: PT2E static quantization of the policy network, for AOTInductor.

The network goes through torch.export at its static batch, torchao's X86InductorQuantizer
annotates it, observers see the build's calibration images (natural photos, never the
evaluation data), and convert_pt2e leaves quantize/dequantize pairs around every GEMM;
AOTInductor with freezing then fuses each pair and its Linear into one oneDNN int8 GEMM
(`onednn.qlinear_pointwise`, VNNI / AMX-INT8 dot products). What runs where:

    GEMMs (every Linear but the classifier head)   int8: activations u8 per tensor (static scales
                                                   from the calibration images), weights s8 per
                                                   output channel, int32 accumulation
    attention (SDPA), softmax, RoPE, norms,         FP32, as the FP32 graph computes them
    residual stream, patch embedding, head, margin

Imported only where an int8 candidate is built: torchao is imported lazily, here alone, and a
run loads the compiled graph with torch's own oneDNN kernels (no torchao at run time).
"""
from __future__ import annotations

import dataclasses
import logging
import platform

import numpy as np

NAME = "int8"
KEEP_FP32 = ("net.head", "net.patch_embed")   # module names (inside Top1Model) left unquantized
DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")   # /proc/cpuinfo flags of INT8 dot products
INT8_FLAGS = ("avx2", *DOT_PRODUCT_FLAGS)   # oneDNN's u8s8 GEMMs: AVX2's vpmaddubsw pairs, or the dot products
INT8_ISAS = ("AVX2", "AVX512", "AMX", "AVX10", "ALL")   # oneDNN ISA limits that leave it those kernels


def describe() -> dict:
    """The policy as recorded in an artifact's manifest."""
    from engine.core.precision import describe as policy

    return policy(NAME)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where it cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def unavailable(device: str, flags: set[str] | None = None) -> str | None:
    """Why an int8 candidate cannot be built here (None: it can): the off switch, the device, the
    CPU's int8 GEMMs (AVX2's vpmaddubsw at least: VNNI and AMX-INT8 are faster, and where only AVX2
    has them the candidate is measured all the same, its row showing whether it pays), oneDNN's ISA
    limit, torchao importing. `flags`: the CPU's
    (default: read from /proc/cpuinfo)."""
    from engine import settings

    why = cannot_build(device)
    if why:
        return why
    flags = cpu_flags() if flags is None else flags
    have = sorted(set(INT8_FLAGS) & (flags or set()))
    if flags is not None and not have:
        return "no AVX2 on this CPU: oneDNN has no int8 GEMMs here (emulated; measure it with --search-precisions)"
    isa = settings.onednn_max_cpu_isa().upper()
    if isa and not any(k in isa for k in INT8_ISAS):
        return f"ONEDNN_MAX_CPU_ISA={isa} leaves oneDNN no int8 GEMMs (below AVX2): measure it with --search-precisions"
    return None


def cannot_build(device: str) -> str | None:
    """Why no int8 graph can be built here whatever is asked (None: one can): the off switch, a device
    other than an x86-64 CPU, torchao not importing. (`unavailable` adds the CPU's dot products.)"""
    from engine import settings

    if not settings.int8():
        return "off (ENGINE_INT8=0)"
    if device != "cpu":
        return "int8 is a CPU candidate (X86InductorQuantizer); the GPU's quantized GEMMs are fp8"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"X86InductorQuantizer needs an x86-64 CPU, this is {machine}"
    return import_problem()


def import_problem() -> str | None:
    """None when torchao can be imported, else why not (one line). Found, not imported: importing it
    loads Inductor, seconds a short build deadline has not planned for before any compile; an import
    that fails all the same fails the int8 compile, a row of the table with its reason."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError) as e:   # a None entry in sys.modules, a broken parent
        return f"torchao does not import ({type(e).__name__}: {e})".replace("\n", " ")[:200]
    return None if found else "torchao does not import (it is not installed)"


def _torchao():
    """(prepare_pt2e, convert_pt2e, x86_inductor_quantizer module), imported quietly: torchao's
    import logs a torch deprecation notice that is no story of the build's."""
    quiet = logging.getLogger("torch.utils._pytree")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    finally:
        quiet.setLevel(level)
    return prepare_pt2e, convert_pt2e, xiq


def calibration_batches(pixels: np.ndarray, batch: int, count: int) -> list[np.ndarray]:
    """The first `count` calibration images (at least one batch) as static batches of `batch`
    images [batch, S, S, 3]; a short last batch is filled by cycling the images."""
    n = max(batch, min(count, len(pixels)))
    n = -(-n // batch) * batch
    take = np.resize(pixels[: max(1, min(count, len(pixels)))], (n,) + pixels.shape[1:]).astype(np.uint8)
    return [take[i: i + batch] for i in range(0, n, batch)]


def export_int8(net, spec, device: str, margin: bool, calibration: np.ndarray, count: int | None = None):
    """(torch.export program of the int8 Top1Model, its example input) at the spec's static batch:
    the FP32 policy network (projections fused) quantized by X86InductorQuantizer, its activation
    observers fed `count` of the `calibration` images [N, S, S, 3] uint8 (default: the preset's)."""
    import torch

    from engine.core.model import wrap
    from engine.core.precision import _fold_qkv_bias
    from engine.presets import preset

    if calibration is None or len(calibration) == 0:
        raise ValueError("an int8 graph needs calibration images to observe its activation ranges")
    count = preset("cpu").int8_calibration_images if count is None else count
    prepare_pt2e, convert_pt2e, xiq = _torchao()
    fp32 = dataclasses.replace(spec, precision="fp32")
    model = wrap(net, fp32, device, margin=margin)   # on a share_copy of net: the caller's model is left alone
    _fold_qkv_bias(model.net)   # q/v biases into the qkv Linear (exact): a constant bias, so it quantizes too
    example = torch.zeros((spec.batch_size, spec.input_size, spec.input_size, 3), dtype=torch.uint8, device=device)
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    for name in KEEP_FP32:
        quantizer.set_module_name_qconfig(name, None)
    with torch.no_grad():
        graph = torch.export.export(model, (example,), strict=False).module()
        observed = prepare_pt2e(graph, quantizer)
        for x in calibration_batches(calibration, spec.batch_size, count):
            observed(torch.from_numpy(x).to(device))
        quantized = convert_pt2e(observed)
        return torch.export.export(quantized, (example,), strict=False), example


def kernels_in_package(package) -> list[str]:
    """The oneDNN quantized kernels an AOTInductor package's generated C++ calls (its sources, which
    the artifact leaves out): the record of what the int8 graph runs."""
    import zipfile

    names: set[str] = set()
    with zipfile.ZipFile(package) as z:
        for info in z.infolist():
            if info.filename.endswith((".cpp", ".h")):
                text = z.read(info).decode(errors="replace")
                names.update(op for op in QUANTIZED_OPS if op in text)
    return sorted(names)


QUANTIZED_OPS = ("qlinear_pointwise", "qconv_pointwise", "qconv2d_pointwise", "qlinear_prepack", "qconv_prepack")
