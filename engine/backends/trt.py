"""`trt`: TensorRT engines through torch-tensorrt's dynamo frontend (the `gpu` extra).

Build: torch.export of Top1Model at the static batch shape, under the mixed-precision
policy (engine.precision), compiled with explicit typing, so TensorRT keeps the dtypes
the graph states (GEMMs and attention low, LayerNorm, softmax inputs and the head FP32:
TensorRT's FP16 LayerNorm overflow cannot happen); serialized as an exported program
holding the engines. Run: torch.export.load with torch_tensorrt's runtime ops; nothing
is compiled at run time. The engines are tied to the GPU architecture and TensorRT
version of the build machine: build on the machine that runs.
"""
from __future__ import annotations

import time

import torch

from engine.model import OnDevice, export_top1

NAME = "trt"
FILES = ("model.trt.ep",)
COMPILED = (".ep",)
NEEDS_WEIGHTS = True


def _need_gpu(device: str) -> None:
    if device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("TensorRT engines are built and run on a CUDA GPU (use --device cuda on a GPU machine)")


def save(net: torch.nn.Module, spec, device: str, out_dir, margin: bool = False) -> dict:
    _need_gpu(device)
    import torch_tensorrt

    ep, example = export_top1(net, spec, device, margin)
    t0 = time.perf_counter()
    trt = torch_tensorrt.dynamo.compile(ep, arg_inputs=[example], use_explicit_typing=True,
                                        min_block_size=1, require_full_compilation=False)
    torch_tensorrt.save(trt, str(out_dir / FILES[0]), output_format="exported_program", arg_inputs=[example])
    return {"trt": {"compile_seconds": round(time.perf_counter() - t0, 3), "example_shape": list(example.shape),
                         "explicit_typing": True, "outputs": ["top1", "margin"] if margin else ["top1"]}}


def load(artifact, device: torch.device):
    _need_gpu(device.type)
    import torch_tensorrt  # noqa: F401 - registers the TensorRT runtime ops the program calls

    return OnDevice(torch.export.load(str(artifact.path(FILES[0]))).module(), device)
