"""Inductor's CUDA code generation, sm_90 cubins and the AOTInductor C++ model compiled, on a
machine without a GPU (the image rehearsal's `--codegen` step).

    python -m evaluator.rehearsal.image_codegen --cuda-home DIR [--out DIR]     # one JSON line

A tiny graph (matmul + bias, GELU, softmax) is traced on fake CUDA tensors (FakeTensorMode) and
lowered by Inductor for "cuda" with Hopper's properties supplied (torch.cuda answers for one
H200, sm_90). Its Triton kernels are compiled for GPUTarget("cuda", 90, 32) by Triton's own
toolchain (LLVM, then the ptxas Triton ships) into cubins. Then AOTInductor's C++ model of the
same graph is generated (the first config's cubin recorded where autotuning would record the
fastest) and compiled to an object file with g++ against CUDA_HOME's headers, as its build does.
Nothing is loaded or launched: Triton's driver is replaced by one that names the target and
returns null handles, so libcuda is never opened.

Where it stops: linking model.so (AOTInductor links libcuda, the driver's library, which no
wheel ships), loading the cubins, running anything, and every choice Inductor makes by timing
kernels on the device (autotuning, max-autotune's GEMM templates). It patches torch.cuda in its
own process: run it as a subprocess (run_in does).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

from engine.io import folder_refusal, mark_owned, marked

REPO = Path(__file__).resolve().parents[2]
# torch.cuda.get_device_properties of one H200 (the fields Inductor's heuristics read)
H200 = dict(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=143 << 30,
            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
            warp_size=32, L2_cache_size=60 << 20, shared_memory_per_block=48 << 10,
            shared_memory_per_block_optin=227 << 10, shared_memory_per_multiprocessor=228 << 10,
            gcnArchName="NVIDIA H200", uuid="00000000-0000-0000-0000-000000000000", is_integrated=False,
            is_multi_gpu_board=False, clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=6144)


def pretend_sm90() -> None:
    """torch.cuda answers for one H200; Triton's active driver names sm_90 and loads nothing."""
    import torch
    from torch._dynamo.device_interface import CudaInterface
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    props = types.SimpleNamespace(**H200)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_capability = lambda device=None: (props.major, props.minor)
    torch.cuda.get_device_name = lambda device=None: props.name

    class TargetOnly(CudaDriver):
        """Inductor checks isinstance(CudaDriver); its __init__ (which loads libcuda) is skipped."""
        def __init__(self):
            pass

        def get_current_target(self):
            return GPUTarget("cuda", props.major * 10 + props.minor, props.warp_size)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_current_device(self):
            return 0

    fake = TargetOnly()
    # "loading" a cubin returns null handles (module, function, registers, spills, max threads):
    # Inductor then builds its launchers, which are never called
    fake.utils = types.SimpleNamespace(
        load_binary=lambda name, kernel, shared, device: (0, 0, 0, 0, props.max_threads_per_block),
        get_device_properties=lambda device: {"max_shared_mem": props.shared_memory_per_block_optin,
                                              "multiprocessor_count": props.multi_processor_count,
                                              "max_num_regs": props.regs_per_multiprocessor,
                                              "warpSize": props.warp_size})
    fake.launcher_cls = lambda src, metadata: None
    driver.set_active(fake)
    # Dynamo's device interface bound torch.cuda's functions when it was imported
    for name in ("current_device", "device_count", "get_device_properties"):
        setattr(CudaInterface, name, staticmethod(getattr(torch.cuda, name)))
    CudaInterface.exchange_device = staticmethod(lambda device: 0)
    CudaInterface.maybe_exchange_device = staticmethod(lambda device: 0)


def tiny_graph():
    """(fx graph, fake CUDA inputs) of x @ w + b -> GELU -> softmax, decomposed as Inductor wants."""
    import torch
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b):
        return (torch.nn.functional.gelu(x @ w + b).softmax(-1),)

    mode = FakeTensorMode()
    with mode:
        inputs = [torch.empty(8, 64, device="cuda"), torch.empty(64, 128, device="cuda"),
                  torch.empty(128, device="cuda")]    # [B, K], [K, N], [N]
        return make_fx(f, decomposition_table=select_decomp_table())(*inputs), inputs, mode


def generate(aot: bool = False) -> str:
    """The wrapper Inductor generates for the tiny graph on "cuda": Python with the Triton kernels
    inside, or (aot) AOTInductor's C++ model, which needs the kernels compiled first."""
    import torch._inductor.config as config
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    gm, inputs, mode = tiny_graph()
    # as AOTInductor compiles: C++ wrapper, no graph partition, the kernels' cubins kept
    patch = {"cpp_wrapper": aot, "graph_partition": not aot, "triton.autotune_at_compile_time": aot,
             "triton.store_cubin": True, "use_static_cuda_launcher": False}
    # the compile-time autotune block would run the kernels: compile_kernels recorded them already
    no_autotune = mock.patch.object(PythonWrapperCodegen, "generate_and_run_autotune_block", lambda self: None)
    with mode, config.patch(patch), V.set_aot_compilation(aot), no_autotune:
        graph = GraphLowering(gm, example_inputs=inputs, cpp_wrapper=aot, aot_mode=aot)
        with V.set_graph_handler(graph), V.set_debug_handler(DebugContext()):
            graph.run(*inputs)
            code = graph.codegen()
    code = code[0] if isinstance(code, tuple) else code
    return getattr(code, "value", code)


def compile_kernels(wrapper: str) -> list[str]:
    """Compile each Triton kernel of the Python wrapper (every config Inductor proposes) and record
    the first config's cubin as the one AOTInductor embeds (where autotuning would pick by timing)."""
    import torch._inductor.config as config
    from torch._inductor.codecache import PyCodeCache

    kernels = re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", wrapper, re.S)
    with config.patch({"triton.store_cubin": True, "use_static_cuda_launcher": False}):
        for name, source in kernels:
            tuner = getattr(PyCodeCache.load(source), name)
            tuner.precompile()
            tuner.save_gpu_kernel(0, tuner.launchers[0])   # stream 0: only recorded
    return [name for name, _ in kernels]


def compile_wrapper(cpp: str, cuda_home: str, out: Path) -> Path:
    """Compile AOTInductor's C++ model to an object file, as its build does (g++, C++20, -DUSE_CUDA,
    torch's and CUDA_HOME's headers). Linking is left out: it wants libcuda, the driver's."""
    import torch.utils.cpp_extension as ext

    src, obj = out / "model.cpp", out / "model.o"
    src.write_text(cpp)
    flags = [f"-I{d}" for d in ext.include_paths()] + [f"-I{Path(cuda_home) / 'include'}"]
    r = subprocess.run(["g++", "-std=c++20", "-c", "-fPIC", "-O1", "-DUSE_CUDA", *flags, str(src), "-o", str(obj)],
                       capture_output=True, text=True)
    if r.returncode != 0:   # the first error line: for a missing header, the compiler's line naming it
        err = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr[-300:])
        raise RuntimeError(f"g++ {src.name}: {err}")
    return obj


def cubin_targets(cache: Path) -> dict[str, str]:
    """{cubin path: .target line} of every cubin under the Triton cache, read by Triton's cuobjdump."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = {}
    for cubin in sorted(cache.rglob("*.cubin")):
        r = subprocess.run([str(cuobjdump), "-elf", str(cubin)], capture_output=True, text=True)
        m = re.search(r"\.target\s+(\S+)", r.stdout)
        out[str(cubin)] = m[1] if m else f"unknown ({(r.stderr.strip() or 'no .target')[:80]})"
    return out


def rehearse(out: Path, cuda_home: str) -> dict:
    """Generate, compile the kernels to cubins, generate the AOTInductor model and compile it."""
    pretend_sm90()
    kernels = compile_kernels(generate())
    targets = cubin_targets(out / "triton")
    cpp = generate(aot=True)
    obj = compile_wrapper(cpp, cuda_home, out)
    loaded = re.findall(r'loadKernel\("([^"]+\.cubin)"', cpp)     # the cubins the model loads at run time
    ok = (bool(kernels) and bool(targets) and all(t.startswith("sm_90") for t in targets.values())
          and len(loaded) == len(kernels) and all(Path(c).is_file() for c in loaded))
    detail = (f"{len(kernels)} Triton kernel(s) generated for cuda with H200 properties, {len(targets)} cubin(s) "
              f"{sorted(set(targets.values()))} by Triton's ptxas, the AOTInductor C++ model compiled against "
              f"CUDA_HOME ({obj.stat().st_size // 1024} KiB object, not linked), under {out}")
    return {"ok": ok, "detail": detail, "kernels": kernels, "cubins": targets, "object": str(obj)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluator.rehearsal.image_codegen", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="caches, sources and the object go here (default: a temporary folder)")
    p.add_argument("--cuda-home", required=True, help="the CUDA_HOME to compile against (the image's: "
                   "site-packages/nvidia/cu13)")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="image-codegen-"))
    why = folder_refusal(out, "--out", lambda d: marked(d, "image-codegen"))
    if why:
        p.error(why)
    out.mkdir(parents=True, exist_ok=True)
    mark_owned(out, "image-codegen")
    # before Inductor and Triton read them: every cache under --out
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(out / "inductor"), TRITON_CACHE_DIR=str(out / "triton"))
    try:
        result = rehearse(out, a.cuda_home)
    except Exception as e:  # one line for the rehearsal: where the toolchain stopped
        result = {"ok": False, "detail": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def run_in(python: Path, env: dict[str, str]) -> tuple[bool, str]:
    """(ok, one line) of this rehearsal in `python`, in its own process (it patches torch.cuda);
    its files go to a temporary folder, removed after."""
    with tempfile.TemporaryDirectory(prefix="image-codegen-") as out:
        r = subprocess.run([str(python), "-m", "evaluator.rehearsal.image_codegen", "--out", out,
                            "--cuda-home", env.get("CUDA_HOME", "")],
                           capture_output=True, text=True, env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                           cwd=REPO, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return False, (r.stderr.strip().splitlines() or ["no output"])[-1]
    result = json.loads(lines[-1])
    return result["ok"] and r.returncode == 0, result["detail"].replace(f", under {out}", "")


if __name__ == "__main__":
    sys.exit(main())
