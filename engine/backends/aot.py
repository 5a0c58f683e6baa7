"""`aot`: an AOTInductor package (.pt2) compiled ahead of time for the target device.

Build: torch.export on the static batch shape, then AOTInductor. Run: the C++ package
loader only; nothing compiles at run time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from engine.model import wrap

NAME = "aot"
FILES = ("model.pt2",)
COMPILED = (".pt2",)
NEEDS_WEIGHTS = True


def save(net: torch.nn.Module, spec, device: str, out_dir: Path) -> dict:
    model = wrap(net, spec, device)
    example = torch.zeros((spec.batch_size, spec.input_size, spec.input_size, 3), dtype=torch.uint8,
                          device=device)  # [B, S, S, 3] uint8: the static shape the run pads to
    with torch.inference_mode():
        ep = torch.export.export(model, (example,), strict=False)
    t0 = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out_dir / FILES[0]))
    return {"aot": {"package": Path(path).name, "compile_seconds": round(time.perf_counter() - t0, 3),
                    "example_shape": list(example.shape)}}


def load(artifact, device: torch.device):
    if device.type != artifact.device:
        raise RuntimeError(f"AOT package was compiled for {artifact.device}, not {device.type}")
    return _load_package(artifact.path(FILES[0]))


def _load_package(package) -> object:
    """Load an AOTInductor package with the C++ loader alone (importing torch._inductor costs ~1 s).

    The fast path calls the loader that `torch._inductor.aoti_load_package` wraps; if this
    torch lacks it, fall back to the public function and say why.
    """
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    except AttributeError as e:
        print(f"[engine] direct AOTI loader unavailable ({e}); using torch._inductor.aoti_load_package",
              file=sys.stderr)
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(package))
    return lambda x: loader.boxed_run([x])  # flat inputs [uint8 batch] -> [int32 top-1]
