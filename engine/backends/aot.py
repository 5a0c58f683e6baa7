"""`aot`: an AOTInductor shared object compiled ahead of time, loaded in place.

Build: torch.export on the static batch shape, then AOTInductor (on the CPU with Inductor
freezing: weights folded into the graph as constants, so oneDNN prepacks them). The
package it writes is unpacked into the artifact at build time:

    aot/model.so               the compiled graph, its weights inside (mapped at load)
    aot/model_metadata.json    what AOTInductor recorded (device, platform, CPU ISA)
    aot/*.cubin ...            on CUDA, the kernels' binaries the .so loads by name

Run: the C++ container runner dlopens `aot/model.so` where it lies. Nothing is copied or
extracted (the package loader would unpack the whole package, weights included, into
TMPDIR at every start), nothing is written, nothing compiles.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import zipfile
from pathlib import Path

import torch

from engine.core.model import OnDevice, export_top1
from engine.io import tree_bytes

NAME = "aot"
DIR = "aot"
SO, METADATA = "model.so", "model_metadata.json"
FILES = (f"{DIR}/{SO}",)
COMPILED = (".so", ".cubin", ".fatbin", ".spv")
NEEDS_WEIGHTS = True
COMPILES = True
AUTO = True
QUANTIZED = ("int8",)   # precisions only this backend builds: save() takes their calibration images
PACKAGE_MODEL_DIR = ("data", "aotinductor", "model")   # where a .pt2 keeps the model's files
SOURCES = (".cpp", ".h", ".hpp", ".cu", ".c")            # the package's C++ sources: not needed to load


OPTIONS = ("default", "max-autotune")   # compile options engine.tuning.autotune may time against each other


def inductor_configs(device: str, options: str = "default") -> dict:
    """Inductor's settings for an option: on the CPU freezing (weights folded in, prepacked by
    oneDNN); max-autotune times GEMM kernels at compile time, on the CPU Inductor's C++ GEMM
    templates against ATen's (oneDNN / MKL)."""
    if options not in OPTIONS:
        raise ValueError(f"aot options must be one of {OPTIONS}, got {options!r}")
    configs: dict = {"freezing": True} if device == "cpu" else {}
    if options == "max-autotune":
        configs["max_autotune"] = True
        configs["max_autotune_gemm_backends"] = "CPP,ATEN" if device == "cpu" else "TRITON,ATEN"
    return configs


def save(net: torch.nn.Module, spec, device: str, out_dir: Path, margin: bool = False,
         options: str = "default", calibration=None) -> dict:
    """Export, compile and unpack the graph; `calibration` (uint8 [N, S, S, 3]): the images an int8
    graph's activation ranges are observed on (engine.core.int8), unused by other precisions."""
    if spec.precision == "int8":
        from engine.core.int8 import export_int8

        ep, example = export_int8(net, spec, device, margin, calibration)
    else:
        ep, example = export_top1(net, spec, device, margin)
    configs = inductor_configs(device, options)
    package = out_dir / ".model.pt2"
    workers = _compile_workers()
    cache = _inductor_cache_dir()
    need = _tmpdir_need(net)
    print(f"engine.build: AOTInductor compile with {workers} worker processes (ENGINE_THREADS); "
          f"Inductor cache {cache} needs about {need / 2**30:.1f} GiB, "
          f"{_free_bytes(cache) / 2**30:.1f} GiB free there", file=sys.stderr)
    t0 = time.time()
    # no_grad: Inductor applies freezing (and with it oneDNN's weight prepacking and the int8 GEMM
    # fusions) only to a graph compiled with autograd off; with it on, `freezing` is silently ignored
    with torch._inductor.config.patch(compile_threads=workers, **quiet_reports()), torch.no_grad():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs=configs)
    seconds = time.time() - t0
    used = tree_bytes(cache, since=t0 - 1)   # what this compile left in the cache (mtimes are coarse)
    kernels = None
    if spec.precision == "int8":   # which quantized oneDNN kernels the generated code calls (sources not kept)
        from engine.core.int8 import kernels_in_package

        kernels = kernels_in_package(package)
    files = unpack(package, out_dir / DIR)
    package.unlink()
    print(f"engine.build: AOTInductor compiled in {seconds:.0f} s; the Inductor cache grew by "
          f"{used / 2**30:.2f} GiB; unpacked {len(files)} files into {DIR}/", file=sys.stderr)
    return {"aot": {"dir": DIR, "so": f"{DIR}/{SO}", "files": files, "compile_seconds": round(seconds, 3),
                    "compile_workers": workers, "inductor_cache_bytes": used,
                    "example_shape": list(example.shape), "inductor_configs": configs, "options": options,
                    "outputs": ["top1", "margin"] if margin else ["top1"],
                    **({"quantized_kernels": kernels} if kernels is not None else {})}}


# Inductor's own reports, written straight to stderr while max-autotune times its kernels (an
# `AUTOTUNE addmm(...)` block and a JSON line per GEMM): library debug output, not the build's
# story. The search's table says what was chosen; errors still go through Inductor's logging.
QUIET_REPORTS = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def quiet_reports() -> dict:
    """Inductor settings that keep its autotune reports out of the build log; none (its own
    defaults) under ENGINE_DEBUG=1 or `--debug`. A setting this torch lacks is left out."""
    from engine.cli import debugging

    if debugging():
        return {}
    return {k: v for k, v in QUIET_REPORTS.items() if hasattr(torch._inductor.config, k)}


def unpack(package: Path, dest: Path) -> list[str]:
    """The model's files of an AOTInductor package (.pt2, a zip) -> `dest`, sources left out.

    The wrapper .so becomes `model.so` and its metadata `model_metadata.json` (the package
    loader finds the metadata by the .so's name); kernel binaries keep their names, which
    the .so looks up in its cubin directory. Returns the names written, sorted.
    """
    dest.mkdir(parents=True, exist_ok=False)
    with zipfile.ZipFile(package) as z:
        members = [i for i in z.infolist() if not i.is_dir() and tuple(i.filename.split("/")[1:-1]) == PACKAGE_MODEL_DIR]
        libs = [i for i in members if i.filename.endswith(".so")]
        if len(libs) != 1:
            raise RuntimeError(f"{package}: expected one compiled .so in the package, found "
                               f"{[i.filename for i in libs]}")
        stem = Path(libs[0].filename).name[:-len(".so")]
        names = []
        for i in members:
            name = Path(i.filename).name
            if name.endswith(SOURCES):
                continue
            name = {f"{stem}.so": SO, f"{stem}_metadata.json": METADATA}.get(name, name)
            with z.open(i) as src, open(dest / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            names.append(name)
    return sorted(names)


def load(artifact, device: torch.device):
    if device.type != artifact.device:
        raise RuntimeError(f"AOT graph was compiled for {artifact.device}, not {device.type}")
    # the graph does not check its input's device: the wrapper moves the batch there
    return OnDevice(load_in_place(artifact.path(FILES[0]), device), device)


def load_in_place(so: Path, device: torch.device):
    """fn(x) -> [outputs] of the compiled .so, loaded where it lies (what the package loader does
    after extracting, without the extraction).

    On CUDA: one runner without the container's own locking and event queries, which
    CUDA-graph capture forbids (torch documents run_single_threaded for use under CUDA
    graphs); the runtime calls it from one thread. Kernel binaries are read from the .so's
    folder.
    """
    so = os.path.abspath(so)
    if device.type == "cuda":
        # (so path, runners, device, cubin dir, run_single_threaded)
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, str(device), os.path.dirname(so), True)
    else:
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
    return lambda x: runner.run([x])  # flat inputs [uint8 batch] -> [int32 top-1 (, margin)]


def _compile_workers() -> int:
    """Inductor's compile worker processes: the thread budget (a bounded build sandbox counts PIDs)."""
    from engine.threads import budget

    return budget("cpu").total


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _tmpdir_need(net: torch.nn.Module) -> int:
    """Bytes the compile writes to the Inductor cache, about: the generated .so holds the weights
    once, its constants object once more (both FP32 at most), plus ~256 MiB of code and objects."""
    weights = sum(t.numel() * t.element_size() for t in list(net.parameters()) + list(net.buffers()))
    return 2 * weights + (256 << 20)


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free
