"""`aot`: an AOTInductor package (.pt2) compiled ahead of time for the target device.

Build: torch.export on the static batch shape, then AOTInductor; on the CPU with
Inductor freezing (weights folded into the graph as constants, so oneDNN prepacks
them). Run: the C++ package loader only; nothing compiles at run time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from engine.model import export_top1

NAME = "aot"
FILES = ("model.pt2",)
COMPILED = (".pt2",)
NEEDS_WEIGHTS = True


def save(net: torch.nn.Module, spec, device: str, out_dir: Path, margin: bool = False) -> dict:
    ep, example = export_top1(net, spec, device, margin)
    t0 = time.perf_counter()
    configs = {"freezing": True} if device == "cpu" else {}
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out_dir / FILES[0]),
                                                    inductor_configs=configs)
    return {"aot": {"package": Path(path).name, "compile_seconds": round(time.perf_counter() - t0, 3),
                    "example_shape": list(example.shape), "inductor_configs": configs,
                    "outputs": ["top1", "margin"] if margin else ["top1"]}}


def load(artifact, device: torch.device):
    if device.type != artifact.device:
        raise RuntimeError(f"AOT package was compiled for {artifact.device}, not {device.type}")
    return _load_package(artifact.path(FILES[0]), single_threaded=device.type == "cuda")


def _load_package(package, single_threaded: bool = False) -> object:
    """Load an AOTInductor package with the C++ loader alone (importing torch._inductor costs ~1 s).

    `single_threaded`: one runner without the container's own locking and event queries,
    which CUDA-graph capture forbids (torch documents run_single_threaded for use under
    CUDA graphs); the runtime calls it from one thread. The fast path calls the loader
    that `torch._inductor.aoti_load_package` wraps; if this torch lacks it, fall back to
    the public function and say why.
    """
    try:
        # (package, model name, run_single_threaded, num_runners, device_index)
        loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", single_threaded, 1, -1)
    except AttributeError as e:
        print(f"[engine] direct AOTI loader unavailable ({e}); using torch._inductor.aoti_load_package",
              file=sys.stderr)
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(package), run_single_threaded=single_threaded)
    return lambda x: loader.boxed_run([x])  # flat inputs [uint8 batch] -> [int32 top-1]
