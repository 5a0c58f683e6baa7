"""`trt`: TensorRT engines through torch-tensorrt's dynamo frontend (the `gpu` extra).

Build: torch.export of Top1Model at the static batch shape, under the mixed-precision
policy (engine.core.precision), compiled so that TensorRT keeps the dtypes the graph states
(GEMMs and attention low, LayerNorm, softmax inputs and the head FP32: TensorRT's FP16
LayerNorm overflow cannot happen): torch-tensorrt releases that take
`use_explicit_typing=True` get it; 2.14 has no such parameter and builds every network
strongly typed. Only options the installed `torch_tensorrt.dynamo.compile` names as
parameters are passed (`accepted_options`, checked with inspect.signature: one that only
**kwargs would swallow is dropped, with a stderr line); the manifest records the options
applied and those dropped, with why. Serialized as an exported program holding the
engines. Run: torch.export.load with torch_tensorrt's runtime ops; nothing is compiled at
run time. The engines are tied to the GPU architecture and TensorRT version of the build
machine: build on the machine that runs.
"""
from __future__ import annotations

import inspect
import sys
import time

import torch

from engine.core.model import OnDevice, export_top1

NAME = "trt"
FILES = ("model.trt.ep",)
COMPILED = (".ep",)
NEEDS_WEIGHTS = True
COMPILES = True
AUTO = True
# what the build asks of dynamo.compile beyond the program and its inputs
COMPILE_OPTIONS = {"use_explicit_typing": True, "min_block_size": 1, "require_full_compilation": False}


def unavailable(device: str) -> str | None:
    """Why TensorRT engines cannot be built here (None: they can)."""
    import importlib.util

    if device != "cuda":
        return "TensorRT builds for a CUDA GPU only"
    if importlib.util.find_spec("torch_tensorrt") is None:
        return "torch_tensorrt is not installed"
    return None


def _need_gpu(device: str) -> None:
    if device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("TensorRT engines are built and run on a CUDA GPU (use --device cuda on a GPU machine)")


def accepted_options(compile_fn, wanted: dict, version: str) -> tuple[dict, dict]:
    """(the options of `wanted` that `compile_fn` names as parameters, {dropped option: why}).

    An option that only reaches **kwargs is dropped: the compile would ignore it. Each
    dropped option is one stderr line."""
    try:
        params = inspect.signature(compile_fn).parameters
    except (TypeError, ValueError) as e:   # no signature to check against: pass nothing optional
        params, unreadable = {}, f"its signature is unreadable ({e})"
    else:
        unreadable = None
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    swallowed = any(p.kind is p.VAR_KEYWORD for p in params.values())
    applied, dropped = {}, {}
    for name, value in wanted.items():
        if name in named:
            applied[name] = value
            continue
        dropped[name] = unreadable or (f"torch_tensorrt {version} dynamo.compile has no parameter {name!r}"
                                       + (" (its **kwargs would ignore it)" if swallowed else ""))
        print(f"engine.backends.trt: not passing {name}={value!r}: {dropped[name]}", file=sys.stderr)
    return applied, dropped


def save(net: torch.nn.Module, spec, device: str, out_dir, margin: bool = False) -> dict:
    _need_gpu(device)
    import torch_tensorrt

    version = str(getattr(torch_tensorrt, "__version__", "unknown"))
    compile_fn = torch_tensorrt.dynamo.compile
    options, dropped = accepted_options(compile_fn, COMPILE_OPTIONS, version)
    ep, example = export_top1(net, spec, device, margin)
    t0 = time.perf_counter()
    trt = compile_fn(ep, arg_inputs=[example], **options)
    torch_tensorrt.save(trt, str(out_dir / FILES[0]), output_format="exported_program", arg_inputs=[example])
    return {"trt": {"compile_seconds": round(time.perf_counter() - t0, 3), "example_shape": list(example.shape),
                    "torch_tensorrt": version, "options": options, "dropped_options": dropped,
                    "outputs": ["top1", "margin"] if margin else ["top1"]}}


def load(artifact, device: torch.device):
    _need_gpu(device.type)
    import torch_tensorrt  # noqa: F401 - registers the TensorRT runtime ops the program calls

    return OnDevice(torch.export.load(str(artifact.path(FILES[0]))).module(), device)
