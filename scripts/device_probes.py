"""Probes for scripts/device_check.py: what is installed, how this machine differs from the
scored setup, and GPU micro-probes at EVA-02-L/448's shapes.

    python3 scripts/device_probes.py packages [--device cuda]
    python3 scripts/device_probes.py fp8 [--rows 65600] [--device cuda]
    python3 scripts/device_probes.py graph_capture --mode global|thread_local
    python3 scripts/device_probes.py decoder_race [--batch 32] [--rounds 24] [--size 448] [--device cuda]
    python3 scripts/device_probes.py attention [--batch 64] [--tokens 1025] [--device cuda]

Each probe prints one JSON line on stdout. The check runs each in its own process with a
timeout, so a hung capture or a broken CUDA context costs that probe only. On the CPU the
parts that need no GPU run (fp8 exactness, the decoder comparison on CPU decodes); the
rest says "skipped: no CUDA". env_info and batch_sweep run in the check's own process.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import io
import json
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# optional packages some step uses: name -> module
PACKAGES = {"scikit-image": "skimage", "nvidia.dali": "nvidia.dali", "tensorrt": "tensorrt",
            "torch_tensorrt": "torch_tensorrt", "open_clip": "open_clip", "cupy": "cupy",
            "torchvision": "torchvision"}
# the scored machine (the Dockerfile's header); versions come from requirements/lock.txt
SCORED_MACHINE, SCORED_GPU_MAJOR = "aarch64", 9          # ARM64, Hopper (compute capability 9.x)
COMPARED = ("torch", "torchvision", "timm", "numpy", "pillow", "safetensors", "scikit-image",
            "nvidia-dali-cuda130", "open-clip-torch")
# EVA-02-L/448 linear layers as (name, in, out): per block qkv, attention proj, SwiGLU fc1 (two 2730
# halves fused), fc2; 2730 is not a multiple of 16, which _scaled_mm needs (the engine pads)
EVA02_L_LINEARS = (("qkv", 1024, 3072), ("proj", 1024, 1024), ("swiglu_fc1", 1024, 2 * 2730),
                   ("fc2", 2730, 1024))
NO_CUDA = "skipped: no CUDA"


# --- what is installed, and what the scored setup has that this machine does not ---

def packages(device: str) -> dict:
    """Import each optional package: version or why not; and torchvision's CUDA JPEG decode."""
    out: dict = {}
    for name, mod in PACKAGES.items():
        try:
            m = importlib.import_module(mod)
            out[name] = {"ok": True, "version": str(getattr(m, "__version__", "?"))}
        except ModuleNotFoundError:
            out[name] = {"ok": False, "error": "not installed"}
        except Exception as e:  # noqa: BLE001 - present but broken: say how
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    out["torchvision_cuda_decode"] = _cuda_decode_probe() if device == "cuda" else {"ok": False, "error": NO_CUDA}
    return out


def _cuda_decode_probe() -> dict:
    import torch
    from torchvision.io import decode_jpeg

    try:
        data = torch.frombuffer(bytearray(_jpegs(1, 64, seed=1)[0]), dtype=torch.uint8)
        gpu, cpu = decode_jpeg(data, device="cuda").cpu(), decode_jpeg(data)
        return {"ok": True, "max_abs_diff_vs_cpu": int((gpu.int() - cpu.int()).abs().max())}
    except Exception as e:  # noqa: BLE001 - the answer is whether it works
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


# what each step calls in torch by name (dotted, from `torch`): a torch that lacks one of them
# (an older one on a lent machine) gets that step skipped with the name, not a traceback
TORCH_NEEDS = {
    "aot_bf16": ("export.export", "_inductor.aoti_compile_and_package", "_C._aoti.AOTIModelContainerRunnerCpu",
                 "_C._aoti.AOTIModelContainerRunnerCuda"),
    "search": ("export.export", "_inductor.aoti_compile_and_package"),
    "fp8_gemm": ("_scaled_mm", "float8_e4m3fn"),
    "graph_capture": ("cuda.CUDAGraph", "cuda.graph"),
    "attention": ("nn.attention.sdpa_kernel", "nn.attention.SDPBackend"),
}


def torch_lacks() -> dict[str, list[str]]:
    """{step: the names of TORCH_NEEDS[step] this torch lacks}, only steps that lack some."""
    import importlib

    import torch

    def has(dotted: str) -> bool:
        obj = torch
        for i, part in enumerate(dotted.split(".")):
            if not hasattr(obj, part):
                try:        # a submodule torch does not import by itself (torch.export, torch.nn.attention)
                    obj = importlib.import_module("torch." + ".".join(dotted.split(".")[:i + 1]))
                    continue
                except ImportError:
                    return False
            obj = getattr(obj, part)
        return True

    out = {step: [f"torch.{n}" for n in names if not has(n)] for step, names in TORCH_NEEDS.items()}
    return {step: missing for step, missing in out.items() if missing}


def env_info(device: str) -> dict:
    """Machine, versions and GPU, as this process sees them, and what of TORCH_NEEDS torch lacks."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "device": device, "torch_lacks": torch_lacks()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
    return info


def scored_setup(repo: Path = REPO) -> dict:
    """The scored setup: the Dockerfile's Python, the lock's pins, an ARM64 machine with a Hopper GPU."""
    m = re.search(r"^FROM python:(\d+\.\d+)", (repo / "Dockerfile").read_text(), re.M)
    pins = {}
    for line in (repo / "requirements" / "lock.txt").read_text().splitlines():
        name, sep, ver = line.split(";")[0].strip().partition("==")
        if sep and not line.startswith("#"):
            pins[name.lower()] = ver
    return {"python": m.group(1) if m else None, "machine": SCORED_MACHINE, "gpu_major": SCORED_GPU_MAJOR,
            "pins": {k: pins[k] for k in COMPARED if k in pins}}


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def not_exercised(doc: dict, scored: dict) -> list[str]:
    """The parts of the scored setup this run did not exercise, from what it saw (doc)."""
    from engine.decoders import default_decoder
    from engine.tuning import GuardConfig

    env, steps = doc.get("steps", {}).get("env") or {}, doc.get("steps", {})
    pkgs = (steps.get("packages") or {}).get("packages") or {}
    out = ["EVA-02-L/448 trained weights (a head fit on generated renders)",
           "ImageNet images (generated JPEGs)", "CLIP retrieval (not run by this check)"]
    if doc.get("tiny"):
        out.append(f"EVA-02-L/448 (ran the tiny test model {doc.get('model')})")
    if env.get("machine") and env["machine"] != scored["machine"]:
        out.append(f"architecture {scored['machine']} (ran on {env['machine']})")
    gpu = env.get("gpu")
    if not gpu:
        out.append("Hopper GPU (ran without CUDA)")
    elif not str(gpu.get("capability", "")).startswith(f"{scored['gpu_major']}."):
        out.append(f"Hopper GPU (ran on {gpu.get('name')}, capability {gpu.get('capability')})")
    py = platform.python_version()
    if scored["python"] and not py.startswith(scored["python"] + "."):
        out.append(f"python {scored['python']} (ran {py})")
    for dist, want in scored["pins"].items():
        got = _installed(dist)
        if got is None:
            out.append(f"{dist} {want} (not installed)")
        elif got.split("+")[0] != want:
            out.append(f"{dist} {want} (ran {got})")
    abi = steps.get("abi_aot_bf16") or {}
    want = default_decoder("cuda")
    if abi.get("decoder") != want:
        dali = pkgs.get("nvidia.dali") or {}
        why = [] if dali.get("ok") else [f"DALI {dali.get('error', 'not probed')}"]
        why.append(f"the ABI decoded with {abi['decoder']}" if abi.get("decoder") else "the ABI did not run")
        out.append(f"decoder {want} ({'; '.join(why)})")
    if abi and abi.get("cuda_graph") != "captured":
        out.append(f"CUDA graph replay (status {abi.get('cuda_graph')!r})")
    layout = steps.get("cuda_home") or {}
    if layout.get("wheel_home") and layout.get("cuda_home") != layout["wheel_home"]:
        why = (layout.get("wheel_headers") or {}).get("missing") or (layout.get("wheel_headers") or {}).get("error")
        out.append(f"the image's CUDA_HOME layout {layout['wheel_home']} ({why}; built with "
                   f"{layout.get('cuda_home') or 'the environment'})")
    build = steps.get("aot_bf16") or {}
    if build.get("recheck_backend") and build["recheck_backend"] != build.get("backend"):
        out.append(f"an {build.get('backend')} re-check graph (the guard re-checked with {build['recheck_backend']})")
    search = steps.get("search") or {}
    if not search.get("chose"):
        out.append(f"the measured search ({search.get('error') or search.get('skipped') or 'not run'})"[:300])
    defaults = dataclasses.asdict(GuardConfig().for_device("cuda"))   # what engine.build uses unasked on the GPU
    src, count = build.get("calibration_source"), build.get("calibration_count")
    if src and (src, count) != (defaults.get("calibration_source"), defaults.get("calibration_count")):
        out.append(f"calibration on {defaults.get('calibration_count')} {defaults.get('calibration_source')} "
                   f"(ran {count} {src})")
    return out


# --- GPU micro-probes ---

def _rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() on the current CUDA stream, after 3 warm-ups (CUDA events)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def fp8(device: str, rows: int) -> dict:
    """The engine's FP8 linear (engine.core.precision.Fp8Linear, rowwise-scaled torch._scaled_mm) at
    EVA-02-L's shapes: error against its FP32 twin on the same quantized values, against the
    unquantized FP32 product, bf16's error against the same; whether _scaled_mm takes the
    unpadded shape; on CUDA, median ms and TFLOP/s of fp8 (layer and bare GEMM) and bf16."""
    import torch

    refused = rowwise_scaled_mm_refused(device)
    if refused:     # e.g. torch 2.11's CPU _scaled_mm takes per-tensor scales only
        return {"skipped": f"torch {torch.__version__} lacks {ROWWISE} on {device}: {refused}", "lacks": ROWWISE}
    torch.backends.cuda.matmul.allow_tf32 = False     # the FP32 references are true FP32
    g = torch.Generator(device="cpu").manual_seed(0)
    layers = {name: _fp8_layer(k, n, rows, device, g) for name, k, n in EVA02_L_LINEARS}
    worst = max(v["fp8_vs_fp32_twin"] for v in layers.values())
    # the twin differs from the GEMM by the bf16 output's rounding only (~2e-3)
    return {"rows": rows, "layers": layers, "fp8_twin_rel_error_max": worst,
            "exact": worst < 1e-2 and not any(v["nan"] for v in layers.values())}


ROWWISE = "rowwise-scaled torch._scaled_mm"      # what the engine's FP8 linear calls


def rowwise_scaled_mm_refused(device: str) -> str | None:
    """None when torch._scaled_mm takes rowwise scales ([M, 1] and [1, N], as Fp8Linear passes
    them) on `device`, else the first line of its refusal."""
    import torch

    from engine.core.precision import FP8

    x = torch.ones(16, 16, device=device).to(FP8)
    sa, sb = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    try:
        torch._scaled_mm(x, x.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return None
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return str(e).strip().splitlines()[0][:200]


def _fp8_layer(k: int, n: int, rows: int, device: str, g) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.core.precision import FP8, FP8_MAX, Fp8Linear, fp8_reference

    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device)         # [N, K]
    b = (torch.randn(n, generator=g) * 0.02).to(device)
    x = torch.randn(rows, k, generator=g).to(device)                    # [M, K], fresh per layer
    layer = Fp8Linear(w, b).to(device)
    with torch.inference_mode():
        y8, y32 = layer(x), F.linear(x, w, b)
        r: dict = {"k": k, "n": n, "fp8_vs_fp32_twin": _rel(y8, fp8_reference(layer, x)),
                   "fp8_vs_fp32": _rel(y8, y32),
                   "bf16_vs_fp32": _rel(F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()), y32),
                   "nan": bool(torch.isnan(y8).any())}
        try:   # the bare GEMM on the unpadded shape: does _scaled_mm need multiples of 16?
            one = torch.ones((), device=device)
            torch._scaled_mm(x.to(FP8), w.to(FP8).t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            r["unpadded_scaled_mm"] = "ok"
        except (RuntimeError, ValueError) as e:
            r["unpadded_scaled_mm"] = f"refused: {str(e).splitlines()[0][:160]}"
        if device != "cuda":
            r["ms"] = NO_CUDA
            return r
        xp = F.pad(x, (0, -k % 16))                                     # [M, K16], as the layer pads
        sa = (xp.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        xq, xb, wb, bb = (xp / sa).to(FP8), x.bfloat16(), w.bfloat16(), b.bfloat16()
        times = {"fp8_layer": _ms(lambda: layer(x)),
                 "fp8_gemm": _ms(lambda: torch._scaled_mm(xq, layer.weight.t(), scale_a=sa, scale_b=layer.w_scale,
                                                          out_dtype=torch.bfloat16)),
                 "bf16": _ms(lambda: F.linear(xb, wb, bb))}
    r["ms"] = {name: round(v, 4) for name, v in times.items()}
    r["tflops"] = {name: round(2 * rows * k * n / v / 1e9, 1) for name, v in times.items()}
    return r


def graph_capture(mode: str, rounds: int = 20) -> dict:
    """Capture a CUDA graph `rounds` times while another thread allocates, uploads from pageable
    memory and reads back on the device (what a decoder thread does while the model is captured)."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    w = torch.randn(1024, 1024, device="cuda") * 0.03
    x = torch.randn(512, 1024, device="cuda")

    def fn(inp):
        for _ in range(32):          # long enough a capture for the other thread to land inside it
            inp = torch.tanh(inp @ w)
        return inp

    stop, churn_errors, churn_ops = threading.Event(), [], [0]

    def churn() -> None:
        host = torch.randn(1 << 22)                                     # 16 MB pageable
        i = 0
        while not stop.is_set():
            i += 1
            try:
                t = torch.empty((1 << 16) * (1 + i % 64), device="cuda")  # sizes vary: fresh cudaMalloc calls
                t.copy_(host[: t.numel()])                              # pageable upload: synchronizing
                t.sum().item()                                          # read back: a stream sync
                churn_ops[0] += 1
            except RuntimeError as e:
                churn_errors.append(str(e).splitlines()[0][:200])
            time.sleep(0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = fn(x).clone()
    torch.cuda.synchronize()
    th = threading.Thread(target=churn, daemon=True)
    th.start()
    captured, failures, wrong = 0, [], 0
    for _ in range(rounds):
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode=mode):
                got = fn(x)
            graph.replay()
            torch.cuda.synchronize()
            captured += 1
            wrong += not torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        except RuntimeError as e:
            failures.append(str(e).splitlines()[0][:200])
    stop.set()
    th.join(timeout=10)
    return {"mode": mode, "rounds": rounds, "captured": captured, "failed": len(failures),
            "replay_wrong": wrong, "first_failure": failures[0] if failures else None,
            "other_thread_ops": churn_ops[0], "other_thread_errors": len(churn_errors),
            "first_other_thread_error": churn_errors[0] if churn_errors else None}


def _jpegs(count: int, size: int, seed: int) -> list[bytes]:
    """Smooth random RGB images as 4:4:4 JPEGs (the GPU decoders take those)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        low = rng.integers(0, 256, (size // 16 + 1, size // 16 + 1, 3), dtype=np.uint8)
        img = Image.fromarray(low).resize((size, size), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90, subsampling=0)
        out.append(buf.getvalue())
    return out


def decoder_race(device: str, batch: int, rounds: int, size: int) -> dict:
    """Decode batch after batch while a consumer on another stream still reads the previous
    output (a queued sleep, then a checksum); compare each checksum with a synchronous decode's.
    `record_stream` keeps the output alive for the consumer (the protocol); without it the
    allocator recycles the buffer under the queued read (the race the protocol prevents:
    mismatches there show the stress reaches it). Decoders: torchvision's decode_jpeg and the
    engine's nvjpeg decoder when it can start."""
    import torch

    cuda = device == "cuda"
    blobs = [_jpegs(batch, size, seed=s) for s in range(3)]             # three distinct batches
    decoders = {"torchvision": lambda bs: torch.stack(_tv_decode(bs, device))}
    out: dict = {"batch": batch, "rounds": rounds, "size": size, "decoders": {}}
    if cuda:
        try:
            from engine.core.spec import Spec
            from engine.decoders.nvjpeg import NvjpegDecoder

            dec = NvjpegDecoder(Spec(model="probe", input_size=size, crop_mode="squash", batch_size=batch), batch)
            decoders["engine.nvjpeg"] = lambda bs: _first(dec.decode(bs))
        except Exception as e:  # noqa: BLE001 - recorded; the torchvision path still runs
            out["engine_nvjpeg_error"] = f"{type(e).__name__}: {e}"[:300]
    flat = None
    for name, decode in decoders.items():
        def checksum(t):                                                # [n, ...] uint8 -> [n] int64
            nonlocal flat
            f = t.reshape(t.shape[0], -1)
            if flat is None or flat.shape[0] != f.shape[1]:
                flat = torch.arange(f.shape[1], device=t.device, dtype=torch.int64) % 251 + 1
            return (f.to(torch.int64) * flat).sum(1)

        ref = []
        for bs in blobs:                                                # synchronous reference
            o = decode(bs)
            if cuda:
                torch.cuda.synchronize()
            ref.append(checksum(o).cpu())
        res: dict = {}
        consumer = torch.cuda.Stream() if cuda else None
        for variant in ("record_stream", "no_record_stream"):
            sums = []
            for r in range(rounds):
                o = decode(blobs[r % 3])
                if cuda:
                    consumer.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(consumer):
                        torch.cuda._sleep(20_000_000)                   # ~10 ms: the next decode starts first
                        s = checksum(o)
                    if variant == "record_stream":
                        o.record_stream(consumer)
                else:
                    s = checksum(o)
                del o                                                   # the host lets go, as a pipeline does
                sums.append((r % 3, s))
            if cuda:
                torch.cuda.synchronize()
            res[variant] = {"mismatches": sum(not torch.equal(s.cpu(), ref[b]) for b, s in sums)}
        res["protocol_holds"] = res["record_stream"]["mismatches"] == 0
        res["race_provoked"] = res["no_record_stream"]["mismatches"] > 0 if cuda else NO_CUDA
        out["decoders"][name] = res
    if not cuda:
        out["streams"] = NO_CUDA
    return out


def _tv_decode(bs: list[bytes], device: str):
    import torch
    from torchvision.io import decode_jpeg

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bs]
    return decode_jpeg(data, device=device)


def _first(res):
    """A decoder's batch tensor, whatever else decode() returns beside it."""
    return res[0] if isinstance(res, tuple) else res


def attention(device: str, batch: int, tokens: int, heads: int = 16, dim: int = 64) -> dict:
    """SDPA time per backend at [batch, heads, tokens, dim] bf16 (math only on the CPU)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, heads, tokens, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"] if device == "cuda" else ["MATH"]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float()) if device == "cpu" else None
    out: dict = {}
    for n in names:
        try:
            with sdpa_kernel([getattr(SDPBackend, n)]):
                if device == "cuda":
                    out[n.lower()] = round(_ms(lambda: F.scaled_dot_product_attention(q, k, v), reps=10), 3)
                else:
                    t = time.perf_counter()
                    y = F.scaled_dot_product_attention(q, k, v)
                    out[n.lower()] = round((time.perf_counter() - t) * 1000, 3)
                    out["math_vs_fp32"] = _rel(y, ref)
        except (RuntimeError, AttributeError) as e:
            out[n.lower()] = f"unavailable: {str(e)[:120]}"
    timed = {k: v for k, v in out.items() if isinstance(v, float) and k != "math_vs_fp32"}
    return {"shape": [batch, heads, tokens, dim], "ms": out, "fastest": min(timed, key=timed.get) if timed else None}


def batch_sweep(model: str, kwargs: dict, size: int, ckpt: Path, device: str, batches: list[int]) -> dict:
    """Policy-bf16 eager inference alone per batch size (engine.build's measurement)."""
    from engine.core.spec import resolve_spec
    from engine.tuning import measure_batch_size

    spec = resolve_spec(model, input_size=size, crop_mode="squash", crop_pct=1.0, precision="bf16",
                        model_kwargs=kwargs)
    best, sweep = measure_batch_size(spec, ckpt, device, batches)
    return {"images_per_s": sweep["images_per_s"], "best": str(best)}


def main(argv: list[str] | None = None) -> int:
    from engine.cli import ArgumentParser, whole_number

    p = ArgumentParser(prog="scripts/device_probes.py", description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("packages", "fp8", "graph_capture", "decoder_race", "attention"),
                   help="which probe to run")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the device probed (default: %(default)s)")
    p.add_argument("--rows", type=whole_number(1, 10**7), default=1025 * 64,
                   help="fp8: GEMM rows (tokens x batch) (default: %(default)s)")
    p.add_argument("--mode", default="global", choices=("global", "thread_local"),
                   help="graph_capture: the capture mode (default: %(default)s)")
    p.add_argument("--batch", type=whole_number(1, 4096), default=32,
                   help="images per batch of the probe (default: %(default)s)")
    p.add_argument("--rounds", type=whole_number(1, 10_000), default=24,
                   help="decoder_race: rounds raced (default: %(default)s)")
    p.add_argument("--size", type=whole_number(1, 8192), default=448,
                   help="the input side in pixels (default: %(default)s)")
    p.add_argument("--tokens", type=whole_number(1, 65_536), default=1025,
                   help="attention: tokens per image (default: %(default)s)")
    a = p.parse_args(argv)
    if a.probe == "packages":
        res = packages(a.device)
    elif a.probe == "fp8":
        res = fp8(a.device, a.rows)
    elif a.probe == "graph_capture":
        res = graph_capture(a.mode)
    elif a.probe == "decoder_race":
        res = decoder_race(a.device, a.batch, a.rounds, a.size)
    else:
        res = attention(a.device, a.batch, a.tokens)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
