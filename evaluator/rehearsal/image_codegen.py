"""Inductor's CUDA code generation and an sm_90 cubin, on a machine without a GPU (the image
rehearsal's `--codegen` step).

    python -m evaluator.rehearsal.image_codegen [--out DIR]      # prints one JSON line

A tiny graph (matmul + bias, GELU, softmax) is traced on fake CUDA tensors (FakeTensorMode),
lowered by Inductor for "cuda" with Hopper's device properties supplied (torch.cuda's queries
answer for one H200, sm_90), and its Triton kernels are compiled for GPUTarget("cuda", 90, 32)
by Triton's own toolchain (its LLVM, then the ptxas it ships) into cubins. Nothing is launched:
Triton's driver is replaced by one that only names the target, so libcuda is never loaded.
What stays unchecked: loading and running the cubins, the AOTInductor .so link against
libcuda, and any kernel choice Inductor makes by benchmarking on the device.

It patches torch.cuda in its own process: run it as a subprocess (run_in does).
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

    driver.set_active(TargetOnly())


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


def generate() -> str:
    """The Python wrapper Inductor generates for the tiny graph on "cuda" (Triton kernels inside)."""
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    gm, inputs, mode = tiny_graph()
    with mode:
        graph = GraphLowering(gm, example_inputs=inputs)
        with V.set_graph_handler(graph), V.set_debug_handler(DebugContext()):
            graph.run(*inputs)
            code = graph.codegen()
    code = code[0] if isinstance(code, tuple) else code
    return getattr(code, "value", code)


def compile_kernels(wrapper: str) -> list[str]:
    """Compile each Triton kernel of the wrapper for every config Inductor proposes; their names."""
    from torch._inductor.codecache import PyCodeCache

    kernels = re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", wrapper, re.S)
    for name, source in kernels:
        tuner = getattr(PyCodeCache.load(source), name)
        tuner.precompile(warm_cache_only=True)   # compile only: no launcher, no device
    return [name for name, _ in kernels]


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluator.rehearsal.image_codegen", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="the Inductor and Triton caches go here (default: a temporary folder)")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="image-codegen-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(out / "triton")
    try:
        pretend_sm90()
        kernels = compile_kernels(generate())
        targets = cubin_targets(out / "triton")
    except Exception as e:  # one line for the rehearsal: where the toolchain stopped
        print(json.dumps({"ok": False, "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}))
        return 1
    ok = bool(kernels) and bool(targets) and all(t.startswith("sm_90") for t in targets.values())
    detail = (f"{len(kernels)} Triton kernel(s) generated for cuda with H200 properties, "
              f"{len(targets)} cubin(s) {sorted(set(targets.values()))} by Triton's ptxas, under {out}")
    print(json.dumps({"ok": ok, "detail": detail, "kernels": kernels, "cubins": targets}))
    return 0 if ok else 1


def run_in(python: Path, env: dict[str, str]):
    """The codegen step in `python` (its own process: it patches torch.cuda), as an image Step."""
    from evaluator.rehearsal.image import Step

    run_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    r = subprocess.run([str(python), "-m", "evaluator.rehearsal.image_codegen"], capture_output=True,
                       text=True, env=run_env, cwd=REPO, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return Step("codegen", False, (r.stderr.strip().splitlines() or ["no output"])[-1])
    result = json.loads(lines[-1])
    return Step("codegen", result["ok"] and r.returncode == 0, result["detail"])


if __name__ == "__main__":
    sys.exit(main())
