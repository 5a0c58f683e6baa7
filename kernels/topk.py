"""Row-wise top-k of a [queries x gallery] score matrix, fused with one excluded column per row.

The excluded column is each query's reference image (-1 = none). Entry points:

- `topk_reference`: the plain torch twin (CPU or CUDA tensors, numpy accepted).
- `topk_cupy`: a CuPy kernel, one thread block per row (CUDA only, k <= 64,
  float16/float32). CuPy is optional and imported only here.
- `topk`: the guard. Picks the kernel for CUDA tensors when CuPy imports and the kernel
  passed its first-call check (`self_check`: its answer on a slice of the call and on a
  tie-heavy matrix equals the reference's exactly); otherwise the reference, saying why on
  stderr once per reason. A failed check (or an exception in it) is one stderr line and
  the reference for the rest of the process. The caller picks the backend (`backend=`:
  auto, cupy = the kernel unchecked, torch) and may name the switch that picked it
  (`backend_from=`, said once on stderr when it picked the reference); this package reads
  no setting itself.
- `store_compiled(folder, write=)` / `stored` arguments: the index build compiles the kernel
  once (NVRTC) into FOLDER/topk.json + FOLDER/topk-sm<arch>.cubin (`write(path, bytes)`: the
  caller's atomic file writer, engine.io.write_atomic from the index build); a query run given
  that folder loads the binary (no NVRTC). A missing or unusable one is compiled at run
  time, and said once on stderr.
- `python -m kernels.topk`: checks the reference against torch.topk (and the kernel against
  both when CUDA + CuPy are present) on a few shapes, then times each implementation.

kernels/ is a leaf: it imports nothing from engine/ or evaluator/.

Host syncs: a kernel call reads the device at most once (the range check of an exclusion
given as a device tensor; host exclusions are checked on the host). `to_host` brings
values and indices back with one sync.

Order and padding rules (identical in all backends, so indices compare exactly):
- higher score first; equal scores -> lower gallery index first;
- NaN ranks as -inf (after every finite score, tied with real -inf by index);
  -0.0 is read as +0.0;
- the excluded column is never returned;
- the result is always [Q, k]: values float32, indices int64. A row with fewer than k
  eligible columns (k > gallery size, or k == gallery size with an exclusion) is padded
  at the end with index -1 and value -inf. Callers drop index -1 (and, for the CIR ABI,
  which requires finite scores, any -inf value).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

MAX_K = 64  # per-thread list length in the kernel; larger k uses the reference
BLOCK = 256  # threads per block (a multiple of 32: warp shuffles use full masks)
CUPY_DTYPES = (torch.float16, torch.float32)
_NO_INDEX = 2**31 - 1  # kernel sentinel index; columns must stay below it

# One block per row. Shapes: scores [Q, N] row-major; exclude [Q] int64; outputs [Q, k].
# Phase 1: thread t scans columns t, t+BLOCK, t+2*BLOCK, ... (coalesced loads) and keeps
#   a sorted list of its best k (values + indices, best first; local memory, <= 64 each).
#   Its columns arrive in increasing order, so a new value ties-loses to every equal
#   value already held: strict '>' comparisons implement "lower index first".
# Phase 2: k rounds of a block-wide argmax over the heads of the BLOCK lists (warp
#   shuffles, then one warp over the per-warp winners in shared memory). The winner is
#   written out and its owner (the only thread holding that column) advances its head.
#   k rounds x 2 __syncthreads is cheap next to the scan of N columns.
# Why not a bitonic sort of all N in shared memory: N = 125k does not fit; why not
#   torch.topk + a mask: that needs a masked copy of the matrix and has no defined
#   tie order.
KERNEL_SOURCE = r"""
#define MAX_K 64
#define NO_INDEX 0x7fffffff

__device__ __forceinline__ float load_score(const float* p) { return *p; }

// float16 is read as raw bits and widened with one PTX instruction: no cuda_fp16.h,
// so the source compiles the same under NVRTC (CuPy) and nvcc (the CPU-side test).
// TOPK_HOST_EMULATION: the tests run this source as C++ on CPU threads; that build
// supplies its own half -> float conversion in place of the PTX.
__device__ __forceinline__ float load_score(const unsigned short* p) {
#ifdef TOPK_HOST_EMULATION
    return host_half_to_float(*p);
#else
    float f;
    unsigned short h = *p;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// Total order of (value, index): higher value first, then lower index.
__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, v, off);
        int oi = __shfl_down_sync(0xffffffffu, i, off);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

template <typename T>
__device__ void topk_row(const T* __restrict__ scores, const long long* __restrict__ exclude,
                         int n_cols, int k, float* __restrict__ out_values,
                         long long* __restrict__ out_indices) {
    const float neg_inf = __int_as_float(0xff800000);
    const long long row = blockIdx.x;
    const T* row_scores = scores + row * (long long)n_cols;
    const long long excluded = exclude[row];  // -1 never equals a column
    float* row_values = out_values + row * (long long)k;
    long long* row_indices = out_indices + row * (long long)k;

    // ---- phase 1: this thread's sorted top-k, best first
    float vals[MAX_K];
    int idxs[MAX_K];
    int count = 0;
    float threshold = neg_inf;  // vals[k-1] once the list is full
    for (int j = threadIdx.x; j < n_cols; j += blockDim.x) {
        if (j == excluded) continue;
        float v = load_score(row_scores + j);
        if (v != v) v = neg_inf;   // NaN ranks as -inf
        if (v == 0.0f) v = 0.0f;   // -0 -> +0, as the reference does
        int p;
        if (count == k) {
            if (!(v > threshold)) continue;  // a tie loses: j is the larger index
            p = k - 1;                       // the current k-th drops out
        } else {
            p = count++;
        }
        while (p > 0 && v > vals[p - 1]) {  // shift worse entries down one
            vals[p] = vals[p - 1];
            idxs[p] = idxs[p - 1];
            --p;
        }
        vals[p] = v;
        idxs[p] = j;
        if (count == k) threshold = vals[k - 1];
    }

    // ---- phase 2: k rounds of block-wide argmax over the list heads
    __shared__ float warp_vals[32];
    __shared__ int warp_idxs[32];
    __shared__ int winner;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    int head = 0;
    for (int r = 0; r < k; ++r) {
        float v = neg_inf;
        int i = NO_INDEX;  // an empty list offers a sentinel worse than any column
        if (head < count) { v = vals[head]; i = idxs[head]; }
        warp_argmax(v, i);
        if (lane == 0) { warp_vals[warp] = v; warp_idxs[warp] = i; }
        __syncthreads();
        if (warp == 0) {
            v = lane < n_warps ? warp_vals[lane] : neg_inf;
            i = lane < n_warps ? warp_idxs[lane] : NO_INDEX;
            warp_argmax(v, i);
            if (lane == 0) winner = i;
        }
        __syncthreads();  // also orders this round's reads before next round's writes
        const int w = winner;
        if (w == NO_INDEX) {  // every list is exhausted: pad the rest (uniform branch)
            for (int p = r + threadIdx.x; p < k; p += blockDim.x) {
                row_values[p] = neg_inf;
                row_indices[p] = -1;
            }
            break;
        }
        if (head < count && idxs[head] == w) {  // columns are unique: one owner
            row_values[r] = vals[head];
            row_indices[r] = w;
            ++head;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
topk_f32(const float* scores, const long long* exclude, int n_cols, int k,
         float* out_values, long long* out_indices) {
    topk_row<float>(scores, exclude, n_cols, k, out_values, out_indices);
}

extern "C" __global__ void __launch_bounds__(256)
topk_f16(const unsigned short* scores, const long long* exclude, int n_cols, int k,
         float* out_values, long long* out_indices) {
    topk_row<unsigned short>(scores, exclude, n_cols, k, out_values, out_indices);
}
"""


SOURCE_SHA256 = hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest()
FUNCTIONS = ("topk_f32", "topk_f16")
# CuPy's RawModule adds -ftz=true to every compile: the stored module is built with the
# same options, so it is the binary a run-time compile would make
NVRTC_OPTIONS = ("-ftz=true",)
RECORD = "topk.json"  # the stored module's record, beside its binary
CHECK_ROWS = 8  # rows of the call the first-call check compares


def _as_torch(scores) -> torch.Tensor:
    """torch tensors pass through; numpy via from_numpy; CuPy (or any DLPack) via DLPack."""
    if isinstance(scores, torch.Tensor):
        return scores
    if isinstance(scores, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(scores))
    if hasattr(scores, "__dlpack__"):
        return torch.from_dlpack(scores)
    raise TypeError(f"scores must be a torch tensor, numpy or CuPy array, got {type(scores).__name__}")


def _check_scores(t: torch.Tensor, k: int) -> None:
    if t.ndim != 2:
        raise ValueError(f"scores must be 2-D [queries, gallery], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"scores must be floating point, got {t.dtype}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def _exclude_tensor(exclude, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """Exclusion as int64 [Q] on `device`; None -> all -1. Values must be in [-1, N).

    Host data (numpy, lists, a tensor on another device than `device`) is checked on the
    host, then copied; a tensor already on `device` is checked with one read of its
    (min, max): the only host sync of a kernel call."""
    if exclude is None:
        return torch.full((n_rows,), -1, dtype=torch.int64, device=device)
    on_device = isinstance(exclude, torch.Tensor) and exclude.device == torch.device(device)
    if on_device:
        ex = exclude.to(dtype=torch.int64)
    else:
        host = exclude.numpy(force=True) if isinstance(exclude, torch.Tensor) else exclude
        ex = np.asarray(host, dtype=np.int64)
    if tuple(ex.shape) != (n_rows,):
        raise ValueError(f"exclude must have shape ({n_rows},), got {tuple(ex.shape)}")
    if n_rows:
        lo, hi = torch.stack(torch.aminmax(ex)).tolist() if on_device else (int(ex.min()), int(ex.max()))
        if lo < -1 or hi >= n_cols:
            raise ValueError(f"exclude values must lie in [-1, {n_cols})")
    return ex.contiguous() if on_device else torch.as_tensor(ex, device=device)


def topk_reference(scores, k: int, exclude=None, rows_per_chunk: int | None = None):
    """Top-k per row in plain torch: (values float32 [Q, k], indices int64 [Q, k]).

    Order: score descending, ties by lower index; NaN as -inf; `exclude[q]` (-1 = none)
    never returned; rows with fewer than k eligible columns end in (-inf, -1) padding.
    Runs on the tensor's device; numpy input gives CPU tensors.
    """
    t = _as_torch(scores)
    _check_scores(t, k)
    return _reference(t, k, _exclude_tensor(exclude, *t.shape, t.device), rows_per_chunk)


def _reference(t: torch.Tensor, k: int, ex: torch.Tensor, rows_per_chunk: int | None = None):
    """topk_reference on checked input: `ex` int64 [Q] on t's device, values in [-1, N)."""
    n_rows, n_cols = t.shape
    values = torch.full((n_rows, k), float("-inf"), dtype=torch.float32, device=t.device)
    indices = torch.full((n_rows, k), -1, dtype=torch.int64, device=t.device)
    take = min(k, n_cols)
    if take == 0 or n_rows == 0:
        return values, indices
    # chunk rows so the full sort stays ~16M elements at a time
    step = rows_per_chunk or max(1, (1 << 24) // max(n_cols, 1))
    for start in range(0, n_rows, step):
        x = t[start : start + step]
        x = x if x.dtype == torch.float64 else x.float()  # float16 -> float32 is exact
        x = torch.where(torch.isnan(x), float("-inf"), x)  # new tensor: input untouched
        x = torch.where(x == 0, 0.0, x)  # -0 -> +0 (radix sorts on CUDA order them apart)
        # stable descending sort: equal scores keep ascending index order
        sv, si = torch.sort(x, dim=1, descending=True, stable=True)
        # the first take+1 sorted columns hold the answer: at most one is excluded
        m = min(take + 1, n_cols)
        sv, si = sv[:, :m], si[:, :m]
        dropped = si == ex[start : start + step, None]  # [rows, m], at most one True per row
        # move the excluded column to the end, keeping the order of the others
        order = torch.argsort(dropped.to(torch.uint8), dim=1, stable=True)
        sv, si, dropped = sv.gather(1, order), si.gather(1, order), dropped.gather(1, order)
        sv, si, dropped = sv[:, :take], si[:, :take], dropped[:, :take]
        # only when k >= N and the row has an exclusion does a dropped column remain: pad
        values[start : start + step, :take] = torch.where(dropped, float("-inf"), sv.float())
        indices[start : start + step, :take] = torch.where(dropped, -1, si)
    return values, indices


# ---------------------------------------------------------------- the compiled module


_said: set[str] = set()  # stderr lines already printed (once each per process)


def _say(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(f"kernels.topk: {line}", file=sys.stderr)


def _binary_format(binary) -> tuple[bytes, str]:
    """NVRTC's output as (bytes, "cubin" | "ptx"): CuPy returns (code, mapping) or the code alone."""
    if isinstance(binary, tuple):
        binary = binary[0]
    if isinstance(binary, str):
        binary = binary.encode()
    return bytes(binary), "cubin" if bytes(binary[:4]) == b"\x7fELF" else "ptx"


def cuda_unavailable() -> str | None:
    """Why no kernel can be compiled here (no CUDA device, no CuPy), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cupy  # noqa: F401 - optional, imported only when the kernel is wanted
    except ImportError as e:
        return f"cupy is not importable ({e})"
    return None


def store_compiled(folder: Path, write: Callable[[Path, bytes], None], device_index: int = 0) -> dict:
    """Compile the kernel with NVRTC for this GPU into `folder` (created): RECORD + the binary.

    `write(path, data)`: how each file is written (the caller's atomic writer: kernels/ writes no
    file of its own). Returns the record (what was stored), or {"stored": False, "reason": ...}
    when CUDA or CuPy is absent or the compile fails (the run then compiles at its first
    kernel call)."""
    write_atomic = write
    why = cuda_unavailable()
    if why is not None:
        return {"stored": False, "reason": why}
    import cupy
    from cupy.cuda import compiler

    try:
        with cupy.cuda.Device(device_index) as dev:
            arch = str(dev.compute_capability)
            binary, fmt = _binary_format(compiler.compile_using_nvrtc(KERNEL_SOURCE, NVRTC_OPTIONS))
    except Exception as e:  # a failed build-time compile leaves the run to compile (and say so)
        return {"stored": False, "reason": f"NVRTC compile failed ({type(e).__name__}: {str(e).strip()[:200]})"}
    folder.mkdir(parents=True, exist_ok=True)
    name = f"topk-sm{arch}.{fmt}"
    write_atomic(folder / name, binary)
    record = {"stored": True, "file": name, "format": fmt, "arch": arch, "functions": list(FUNCTIONS),
              "source_sha256": SOURCE_SHA256, "sha256": hashlib.sha256(binary).hexdigest(),
              "options": list(NVRTC_OPTIONS), "cupy": getattr(cupy, "__version__", None)}
    write_atomic(folder / RECORD, (json.dumps(record, indent=1) + "\n").encode())
    return record


def stored_module(folder: Path | None, arch: str) -> tuple[Path | None, str | None]:
    """(the stored binary, None) when `folder` holds one compiled from this source for this
    GPU architecture, else (None, why not)."""
    if folder is None:
        return None, "no stored module was given"
    path = Path(folder) / RECORD
    if not path.is_file():
        return None, f"{path} is missing"
    try:
        record = json.loads(path.read_text())
        name = record["file"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} is unreadable ({type(e).__name__})"
    if not isinstance(name, str) or Path(name).name != name:
        return None, f"{path} names no plain file"
    if record.get("source_sha256") != SOURCE_SHA256:
        return None, f"{path} was compiled from another kernel source"
    if str(record.get("arch")) != arch:
        return None, f"{path} was compiled for sm_{record.get('arch')}, this GPU is sm_{arch}"
    binary = Path(folder) / name
    if not binary.is_file():
        return None, f"{binary} is missing"
    if hashlib.sha256(binary.read_bytes()).hexdigest() != record.get("sha256"):   # a cubin: kilobytes
        return None, f"{binary} does not match its recorded SHA-256"
    return binary, None


_modules: dict = {}  # (stored folder, device index) -> {function name: CuPy function}


def _functions(stored: Path | None, device_index: int) -> dict:
    """The kernel's functions on this device: from the stored binary when usable, else
    compiled now by NVRTC (said once on stderr)."""
    key = (str(stored) if stored is not None else None, device_index)
    if key in _modules:
        return _modules[key]
    import cupy  # optional dependency, imported only when the kernel is chosen

    with cupy.cuda.Device(device_index) as dev:
        binary, why = stored_module(stored, str(dev.compute_capability))
        if binary is not None:
            try:
                module = cupy.RawModule(path=str(binary))
                funcs = {name: module.get_function(name) for name in FUNCTIONS}
            except Exception as e:  # a binary this driver cannot load: compile instead, and say why
                why = f"loading {binary} failed ({type(e).__name__}: {str(e).strip()[:200]})"
        if why is not None:
            if stored is not None:  # a caller that stores nothing expects the compile
                _say(f"compiling the kernel with NVRTC: {why}")
            module = cupy.RawModule(code=KERNEL_SOURCE)  # CuPy adds NVRTC_OPTIONS itself
            funcs = {name: module.get_function(name) for name in FUNCTIONS}
    _modules[key] = funcs
    return funcs


# ---------------------------------------------------------------- the kernel call


def _refusal(t: torch.Tensor, k: int) -> str | None:
    """Why the kernel cannot take these scores (device, dtype, k, size), or None."""
    if not t.is_cuda:
        return f"scores are on {t.device.type}, not CUDA"
    if t.dtype not in CUPY_DTYPES:
        return f"dtype {t.dtype} is not supported by the kernel (float16/float32)"
    if not 1 <= k <= MAX_K:
        return f"k={k} is outside the kernel's 1..{MAX_K}"
    if t.shape[1] >= _NO_INDEX:
        return f"gallery of {t.shape[1]} columns exceeds int32 indexing"
    return None


def _launch(t: torch.Tensor, ex: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor,
            stored: Path | None) -> None:
    """Run the kernel on torch's current stream: t [Q, N] contiguous -> values, indices [Q, k]."""
    import cupy

    fn = _functions(stored, t.device.index)["topk_f16" if t.dtype == torch.float16 else "topk_f32"]
    stream = torch.cuda.current_stream(t.device)
    with cupy.cuda.Device(t.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        args = (
            cupy.from_dlpack(t),  # zero-copy views of the torch buffers
            cupy.from_dlpack(ex),
            np.int32(t.shape[1]),
            np.int32(k),
            cupy.from_dlpack(values),
            cupy.from_dlpack(indices),
        )
        fn((t.shape[0],), (BLOCK,), args)  # grid: one block per row


def _kernel(t: torch.Tensor, k: int, ex: torch.Tensor, stored: Path | None = None):
    """The kernel on checked input (see _reference); no host sync."""
    t = t.contiguous()
    values = torch.empty((t.shape[0], k), dtype=torch.float32, device=t.device)
    indices = torch.empty((t.shape[0], k), dtype=torch.int64, device=t.device)
    if t.shape[0]:
        _launch(t, ex, k, values, indices, stored)
    return values, indices


def topk_cupy(scores, k: int, exclude=None, stored: Path | None = None):
    """Top-k per row with the CuPy kernel; same contract as `topk_reference`.

    `scores`: a CUDA torch tensor or CuPy array, float16 or float32, [Q, N]; 1 <= k <= 64.
    Returns torch tensors on the same device (values float32, indices int64). The launch
    goes on torch's current stream, so it orders with surrounding torch work. `stored`: a
    folder written by `store_compiled` (else the kernel is compiled by NVRTC).
    """
    t = _as_torch(scores)
    _check_scores(t, k)
    why = _refusal(t, k)
    if why is not None:
        raise (TypeError if t.is_cuda and t.dtype not in CUPY_DTYPES else ValueError)(f"topk_cupy: {why}")
    return _kernel(t, k, _exclude_tensor(exclude, *t.shape, t.device), stored)


def _tie_case(dtype: torch.dtype, device, n_rows: int = 4, n_cols: int = 3 * BLOCK + 17):
    """A tie-heavy [4, 785] matrix and its exclusions: a 0.5 grid, NaN, -inf, -0.0, a tie at
    the top of every row, row 0's best column excluded."""
    g = torch.Generator().manual_seed(0)
    x = torch.round(torch.randn(n_rows, n_cols, generator=g) * 2) / 2
    u = torch.rand(n_rows, n_cols, generator=g)
    x[u < 0.05], x[(u >= 0.05) & (u < 0.07)], x[(u >= 0.07) & (u < 0.1)] = float("nan"), float("-inf"), -0.0
    x[:, [n_cols - 1, n_cols // 2, 0]] = 9.0
    ex = torch.tensor([0] + [-1] * (n_rows - 1), dtype=torch.int64)
    return x.to(device=device, dtype=dtype), ex.to(device)


def self_check(t: torch.Tensor, k: int, ex: torch.Tensor, stored: Path | None = None) -> str | None:
    """Why the kernel's answer differs from the reference's, or None when it is exact: on
    this call's first CHECK_ROWS rows (its dtype, k and exclusions) and on `_tie_case`.
    An exception in the kernel is a reason too. Syncs the host (once per process)."""
    cases = [("this call's first rows", t[:CHECK_ROWS], ex[:CHECK_ROWS]),
             ("a tie-heavy matrix", *_tie_case(t.dtype, t.device))]
    try:
        for what, s, e in cases:
            gv, gi = _kernel(s, k, e, stored)
            wv, wi = _reference(s, k, e)
            bad = int(((gi != wi) | (gv != wv)).any(1).sum())
            if bad:
                return f"{t.dtype}, k={k}: indices or values differ in {bad} of {s.shape[0]} rows of {what}"
    except Exception as e:  # any failure of the kernel (compile, load, launch) leaves the reference in charge
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"{t.dtype}, k={k}: the kernel raised {type(e).__name__}: {first}"
    return None


_trusted: set = set()  # (device, dtype) whose first kernel call matched the reference
_distrust: list[str] = []  # why the kernel failed its check: then the reference for the rest of the process


def _kernel_trusted(t: torch.Tensor, k: int, ex: torch.Tensor, stored: Path | None) -> bool:
    if _distrust:
        return False
    if (t.device, t.dtype) in _trusted:
        return True
    why = self_check(t, k, ex, stored)
    if why is not None:
        _distrust.append(why)
        _say(f"using the torch reference for the rest of the run: the CuPy kernel failed its first-call check ({why})")
        return False
    _trusted.add((t.device, t.dtype))
    return True


def _cupy_unavailable(t: torch.Tensor, k: int) -> str | None:
    """Why the kernel cannot take this call, or None when it can."""
    why = _refusal(t, k)
    if why is not None:
        return why
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"cupy is not importable ({e})"
    return None


def _fall_back(reason: str) -> None:
    _say(f"using the torch reference: {reason}")


def topk(scores, k: int, exclude=None, backend: str = "auto", stored: Path | None = None,
         backend_from: str | None = None):
    """Top-k per row, dispatching to the CuPy kernel or the torch reference.

    backend: "cupy" (the kernel, unchecked), "torch", or "auto": the kernel when it can run
    and passed its first-call check, else the reference with a one-time line on stderr.
    The caller chooses it (the engine passes its `KERNELS_TOPK` setting). `backend_from`: the
    switch that chose it (e.g. "KERNELS_TOPK"): a reference chosen so is said once on stderr
    ("... KERNELS_TOPK=torch"). `stored`: the folder of a module compiled at build time
    (`store_compiled`); None compiles with NVRTC.
    """
    if backend not in ("auto", "cupy", "torch"):
        raise ValueError(f"backend must be auto, cupy or torch, got {backend!r}")
    if backend == "torch" and backend_from:
        _fall_back(f"{backend_from}=torch")
    if backend == "torch":
        return topk_reference(scores, k, exclude)
    if backend == "cupy":
        return topk_cupy(scores, k, exclude, stored)
    t = _as_torch(scores)
    _check_scores(t, k)
    reason = _cupy_unavailable(t, k)
    ex = _exclude_tensor(exclude, *t.shape, t.device)  # the call's one host sync, at most
    if reason is not None:
        _fall_back(reason)
        return _reference(t, k, ex)
    if not _kernel_trusted(t, k, ex, stored):
        return _reference(t, k, ex)
    return _kernel(t, k, ex, stored)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of `tensors` with one host sync: non-blocking copies (into pinned memory)
    on the current stream, then one wait for that stream. Host tensors pass through."""
    if not any(t.is_cuda for t in tensors):
        return [t.cpu() for t in tensors]
    out = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)).synchronize()
    return out


# ---------------------------------------------------------------- python -m kernels.topk
# A self-checking main, as llm.c's dev/cuda files: the reference against torch.topk on a few
# shapes (and the kernel against both where CUDA + CuPy are present), then a timing table.

# (rows, cols, k, dtype, ties, exclusions): k = 1, k = n (without and with an exclusion, which
# pads each row with one (-inf, -1)), both kernel dtypes, ties on a 0.5 grid, k = MAX_K
CHECK_SHAPES = (
    (3, 7, 1, torch.float32, True, True),
    (3, 7, 7, torch.float32, True, False),
    (4, 50, 50, torch.float16, False, True),
    (17, 1000, 5, torch.float16, True, True),
    (17, 1000, 50, torch.float32, False, True),
    (64, 4099, MAX_K, torch.float16, True, True),
)
DEFAULT_SIZE = {"cuda": (2200, 125_000), "cpu": (128, 20_000)}  # timing [rows, cols] per device
DTYPES = {"float16": torch.float16, "float32": torch.float32}


def _check_input(rows: int, cols: int, dtype: torch.dtype, ties: bool, exclusions: bool, seed: int):
    """Finite scores [rows, cols] (torch.topk ranks NaN first, the reference last: no NaN here)
    and exclusions [rows] in [-1, cols) or None. `ties`: scores on a 0.5 grid (many equal)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if ties:
        x = torch.round(x * 2) / 2
    ex = torch.randint(-1, cols, (rows,), generator=g) if exclusions else None
    return x.to(dtype), ex


def _masked(x: torch.Tensor, ex: torch.Tensor | None) -> torch.Tensor:
    """float32 copy of `x` with each row's excluded column at -inf: what torch.topk is given."""
    m = x.float().clone()
    if ex is not None:
        rows = torch.nonzero(ex >= 0).flatten()
        m[rows, ex[rows]] = float("-inf")
    return m


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over equal-shaped float tensors; equal entries (-inf too) differ by 0."""
    if a.numel() == 0:
        return 0.0
    d = torch.where(a == b, 0.0, (a - b).abs())
    return float(torch.nan_to_num(d, nan=float("inf")).max())


def compare(masked: torch.Tensor, ex: torch.Tensor | None, got, want, exact: bool) -> dict:
    """How `got` (values, indices) answers against `want`, on the host: max |value difference|,
    the share of equal indices, and `ok`. exact: indices and values equal. Otherwise (want =
    torch.topk, whose tie order is undefined) ok means: equal values, each index naming a
    column of that value in `masked` (-1: -inf), distinct, never excluded, ties in index order."""
    gv, gi = (t.cpu() for t in got)
    wv, wi = (t.cpu() for t in want)
    if gv.shape != wv.shape or gi.shape != wi.shape:
        return {"max_abs_diff": float("inf"), "index_agreement": 0.0, "ok": False}
    agree = float((gi == wi).float().mean()) if gi.numel() else 1.0
    out = {"max_abs_diff": _max_abs_diff(gv, wv), "index_agreement": round(agree, 4)}
    if exact:
        out["ok"] = bool(torch.equal(gi, wi) and torch.equal(gv, wv))
        return out
    n_cols = masked.shape[1]
    in_range = bool(((gi >= -1) & (gi < n_cols)).all())
    at = masked.gather(1, gi.clamp(0, n_cols - 1)) if gi.numel() else gv
    named = in_range and torch.equal(torch.where(gi >= 0, at, float("-inf")), wv)
    s = gi.sort(1).values
    distinct = not bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any())
    never_excluded = ex is None or not bool(((gi == ex.cpu()[:, None]) & (gi >= 0)).any())
    tied = (gv[:, 1:] == gv[:, :-1]) & (gi[:, 1:] >= 0)
    in_order = not bool((tied & (gi[:, 1:] <= gi[:, :-1])).any())
    out["ok"] = bool(out["max_abs_diff"] == 0 and named and distinct and never_excluded and in_order)
    return out


def check_shape(rows: int, cols: int, k: int, dtype: torch.dtype, ties: bool, exclusions: bool, device: str,
                kernel: bool, seed: int = 0) -> dict:
    """One check line's numbers: the reference against torch.topk on `device`, and with `kernel`
    (CUDA + CuPy) the kernel against the reference (exactly) and against torch.topk."""
    x, ex = _check_input(rows, cols, dtype, ties, exclusions, seed)
    x = x.to(device)
    ex = None if ex is None else ex.to(device)
    masked = _masked(x, ex)
    want = torch.topk(masked.to(dtype), k, dim=1)                     # the oracle, in the input's dtype
    want = (want.values.float(), want.indices)
    ref = topk_reference(x, k, ex)
    case = {"shape": [rows, cols], "k": k, "dtype": str(dtype).removeprefix("torch."), "ties": ties,
            "exclusions": exclusions, "device": device,
            "reference~torch.topk": compare(masked.cpu(), ex, ref, want, exact=False)}
    why = _refusal(x, k) if kernel else None
    if why is not None:
        case["cupy_skipped"] = why
    elif kernel:
        try:
            got = topk_cupy(x, k, ex)
        except Exception as e:  # a kernel that cannot compile, load or launch fails its check
            first = (str(e).strip().splitlines() or [""])[0][:200]
            case["cupy"] = {"ok": False, "error": f"{type(e).__name__}: {first}"}
        else:
            case["cupy==reference"] = compare(masked.cpu(), ex, got, ref, exact=True)
            case["cupy~torch.topk"] = compare(masked.cpu(), ex, got, want, exact=False)
    case["ok"] = all(v["ok"] for v in case.values() if isinstance(v, dict))
    return case


def check_line(case: dict) -> str:
    """One line per checked shape: shape, k, dtype, the input's kind, each comparison, PASS or FAIL."""
    rows, cols = case["shape"]
    kind = "+".join(w for w, on in (("ties", case["ties"]), ("exclusions", case["exclusions"])) if on) or "plain"
    cmp = [f"{name} raised {c['error']}" if "error" in c else
           f"{name} max|dv|={c['max_abs_diff']:g} idx={100 * c['index_agreement']:.1f}%"
           for name, c in case.items() if isinstance(c, dict)]
    if "cupy_skipped" in case:
        cmp.append(f"cupy not checked ({case['cupy_skipped']})")
    return (f"check {case['device']} {f'{rows}x{cols}':>9} {'k=' + str(case['k']):>5} {case['dtype']:<7} {kind:<16}"
            + "  ".join(cmp) + ("  PASS" if case["ok"] else "  FAIL"))


def run_checks(device: str, kernel: bool, shapes=CHECK_SHAPES, out=sys.stdout) -> list[dict]:
    """Check every shape, printing its line to `out`; returns the cases (each with "ok")."""
    cases = []
    for seed, shape in enumerate(shapes):
        case = check_shape(*shape, device=device, kernel=kernel, seed=seed)
        print(check_line(case), file=out, flush=True)
        cases.append(case)
    return cases


def _bench(fn, reps: int, device: str) -> float:
    """Median seconds of `fn()` over `reps` calls after one warm-up call (a first kernel call
    compiles it), synchronised around each on CUDA."""
    import statistics
    import time

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_implementations(rows: int, cols: int, k: int, dtype: torch.dtype, reps: int, device: str,
                         kernel_why: str | None) -> list[dict]:
    """Median time of each implementation on random [rows, cols] scores with random exclusions:
    torch.topk (no exclusions: the library's own op, for scale), the reference, the kernel."""
    x, ex = _check_input(rows, cols, dtype, False, True, seed=100)
    x, ex = x.to(device), ex.to(device)
    impls = [("torch.topk", lambda: torch.topk(x, min(k, cols), dim=1)), ("reference", lambda: topk_reference(x, k, ex))]
    why = kernel_why or _refusal(x, k)
    impls.append(("cupy", None if why else lambda: topk_cupy(x, k, ex)))
    out = []
    for name, fn in impls:
        row = {"implementation": name, "device": device}
        if fn is None:
            row["skipped"] = why
        else:
            try:
                row["median_s"] = round(_bench(fn, reps, device), 6)
            except Exception as e:  # a kernel that fails here failed its check too: say why, time the rest
                row["skipped"] = f"raised {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        out.append(row)
    return out


def timing_table(rows: int, cols: int, k: int, dtype: torch.dtype, reps: int, timings: list[dict]) -> str:
    head = f"time {rows}x{cols} {str(dtype).removeprefix('torch.')} k={k}, with exclusions, median of {reps}:"
    lines = [head, f"  {'implementation':<14} {'device':<6} {'median ms':>10}"]
    for t in timings:
        ms = f"{1e3 * t['median_s']:10.3f}" if "median_s" in t else f"{'-':>10}  ({t['skipped']})"
        lines.append(f"  {t['implementation']:<14} {t['device']:<6} {ms}")
    return "\n".join(lines)


def _count(high: int):
    """An argparse `type`: a whole number in 1..high, else argparse's refusal naming the range
    (kernels/ imports nothing of engine/, so not engine.cli.whole_number)."""
    import argparse

    def count(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            v = 0
        if not 1 <= v <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number in 1..{high}, got {text!r}")
        return v
    return count


def main(argv: list[str] | None = None) -> int:
    """Check the top-k implementations against each other, then time them (llm.c dev/cuda style).

    Check: on a few fixed shapes (k = 1, k = n, ties, exclusions, float16 and float32) the torch
    reference against torch.topk on the device (`~`: equal values, every index a column of that
    value, distinct, never excluded, ties in index order; torch.topk's own tie order is
    undefined) and, where CUDA and CuPy are present, the CuPy kernel against the reference
    (`==`: identical indices and values) and against torch.topk. One line per shape ends in
    PASS or FAIL. Then each available implementation is timed. Exit status: 0 when every check
    passes, 1 when one fails, 2 for bad options."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m kernels.topk", description=main.__doc__.split("\n")[0],
                                epilog="\n\n".join(main.__doc__.split("\n\n")[1:]).replace("    ", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to check and time: auto = cuda when torch sees a GPU, else cpu (default: auto)")
    p.add_argument("--rows", type=_count(10**7), default=None,
                   help="timing: score rows (queries) (default: %d on cuda, %d on cpu)"
                        % (DEFAULT_SIZE["cuda"][0], DEFAULT_SIZE["cpu"][0]))
    p.add_argument("--cols", type=_count(10**9), default=None,
                   help="timing: score columns (gallery size) (default: %d on cuda, %d on cpu)"
                        % (DEFAULT_SIZE["cuda"][1], DEFAULT_SIZE["cpu"][1]))
    p.add_argument("--k", type=_count(10**6), default=50, help="timing: results per row (default: 50)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float16", help="timing: score dtype (default: float16)")
    p.add_argument("--reps", type=_count(10_000), default=5, help="timing: calls per implementation, median taken (default: 5)")
    p.add_argument("--json", action="store_true",
                   help="also print every result as one JSON line at the end (default: off)")
    a = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    rows, cols = a.rows or DEFAULT_SIZE[device][0], a.cols or DEFAULT_SIZE[device][1]
    kernel_why = cuda_unavailable() if device == "cuda" else "the kernel runs on CUDA only"
    name = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} torch threads"
    print(f"device: {device} ({name}); kernel: {'cupy' if kernel_why is None else 'not checked: ' + kernel_why}")
    cases = run_checks(device, kernel_why is None)
    ok = all(c["ok"] for c in cases)
    timings = time_implementations(rows, cols, a.k, DTYPES[a.dtype], a.reps, device, kernel_why)
    print(timing_table(rows, cols, a.k, DTYPES[a.dtype], a.reps, timings))
    failed = sum(not c["ok"] for c in cases)
    print(f"{len(cases) - failed} of {len(cases)} checks passed" + ("" if ok else f"; {failed} FAILED"))
    if a.json:
        print(json.dumps({"device": device, "device_name": name, "kernel": kernel_why or "cupy", "ok": ok,
                          "checks": cases, "timing": {"shape": [rows, cols], "k": a.k, "dtype": a.dtype,
                                                      "reps": a.reps, "implementations": timings}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
