"""Tests of kernels/topk.py: the reference against brute force, the dispatcher, and the
CUDA source (compiled by nvcc, and run as C++ on CPU threads), plus GPU tests by marker."""

import itertools
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kernels import topk as topk_mod
from kernels.topk import KERNEL_SOURCE, MAX_K, topk, topk_cupy, topk_reference

SHAPES = [(1, 1), (3, 7), (5, 100), (17, 1000)]
KS = [1, 5, 50]
DTYPES = [torch.float32, torch.float16]
EXCLUDE = [False, True]
CASES = list(itertools.product(SHAPES, KS, DTYPES, EXCLUDE))
CASE_IDS = [f"{q}x{n}-k{k}-{str(d)[6:]}-{'ex' if e else 'noex'}" for (q, n), k, d, e in CASES]


def make_scores(n_rows, n_cols, dtype, seed=0):
    """Random scores with planted ties, NaN, +-inf and -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, n_cols, generator=g)
    x[::2] = torch.round(x[::2] * 2) / 2  # even rows on a 0.5 grid: many ties
    x[1::4] = torch.randint(0, 3, x[1::4].shape, generator=g).float()  # 3 values: ties at every cut
    u = torch.rand(n_rows, n_cols, generator=g)
    x[u < 0.05] = float("nan")
    x[(u >= 0.05) & (u < 0.07)] = float("-inf")
    x[(u >= 0.07) & (u < 0.08)] = -0.0
    x[(u >= 0.08) & (u < 0.085)] = float("inf")
    if n_cols >= 3:  # a tie at the top of every row: index order decides
        x[:, [n_cols - 1, n_cols // 2, 0]] = 9.0
    return x.to(dtype)


def brute_topk(scores, k, exclude=None):
    """Independent answer: Python's sorted on (-score, index), NaN as -inf, pad (-inf, -1)."""
    rows = scores.double().numpy()
    values, indices = [], []
    for r, row in enumerate(rows):
        ex = -1 if exclude is None else int(exclude[r])
        keyed = sorted((-(-math.inf if math.isnan(v) else v), j) for j, v in enumerate(row) if j != ex)
        best = keyed[:k]
        pad = k - len(best)
        values.append([-s for s, _ in best] + [-math.inf] * pad)
        indices.append([j for _, j in best] + [-1] * pad)
    values = torch.tensor(values, dtype=torch.float32).reshape(-1, k)
    indices = torch.tensor(indices, dtype=torch.int64).reshape(-1, k)
    return values, indices


def case_seed(shape, k):
    return 1000 * shape[0] + shape[1] + k


def make_exclude(scores, seed=1):
    """Random exclusions with some -1; row 0 excludes its true best column."""
    n_rows, n_cols = scores.shape
    g = torch.Generator().manual_seed(seed)
    ex = torch.randint(-1, n_cols, (n_rows,), generator=g)
    ex[0] = brute_topk(scores[:1], 1)[1][0, 0]
    return ex


def case_inputs(shape, k, dtype, with_exclude, seed):
    scores = make_scores(*shape, dtype, seed=seed)
    exclude = make_exclude(scores, seed=seed + 1) if with_exclude else None
    return scores, exclude


def assert_same(got, want):
    gv, gi = got
    wv, wi = want
    assert gv.dtype == torch.float32 and gi.dtype == torch.int64
    assert gi.shape == wi.shape
    assert torch.equal(gi.cpu(), wi), f"indices differ:\n{gi.cpu()}\n{wi}"
    torch.testing.assert_close(gv.cpu(), wv, rtol=0, atol=0)


# ---------------------------------------------------------------- reference vs brute force


@pytest.mark.parametrize("shape, k, dtype, with_exclude", CASES, ids=CASE_IDS)
def test_reference_matches_brute_force(shape, k, dtype, with_exclude):
    scores, exclude = case_inputs(shape, k, dtype, with_exclude, seed=case_seed(shape, k))
    before = scores.clone()
    got = topk_reference(scores, k, exclude)
    assert_same(got, brute_topk(scores, k, exclude))
    assert torch.equal(scores.isnan(), before.isnan())  # input untouched (NaN stays NaN)


def test_reference_chunking_does_not_change_the_answer():
    scores, exclude = case_inputs((17, 1000), 50, torch.float32, True, seed=3)
    assert_same(topk_reference(scores, 50, exclude, rows_per_chunk=4), brute_topk(scores, 50, exclude))


def test_tie_break_and_nan_rules_by_hand():
    scores = torch.tensor([[1.0, float("nan"), 2.0, 1.0, 2.0, float("-inf")]])
    values, indices = topk_reference(scores, 6)
    # 2.0 at 2 and 4 (lower index first), 1.0 at 0 and 3, then -inf at 5 before NaN(=-inf) at 1
    assert indices.tolist() == [[2, 4, 0, 3, 1, 5]]  # NaN at 1 ties -inf at 5: lower index wins
    assert values.tolist() == [[2.0, 2.0, 1.0, 1.0, -math.inf, -math.inf]]
    values, indices = topk_reference(scores, 3, exclude=[2])
    assert indices.tolist() == [[4, 0, 3]]


def test_padding_rules():
    # 1x1 with its only column excluded: nothing eligible, all padding
    values, indices = topk_reference(torch.tensor([[0.5]]), 3, exclude=[0])
    assert indices.tolist() == [[-1, -1, -1]]
    assert values.tolist() == [[-math.inf] * 3]
    # k == N with an exclusion: the last slot is padding; without one, all N come back
    s = torch.tensor([[0.1, 0.3, 0.2], [0.1, 0.3, 0.2]])
    _, indices = topk_reference(s, 3, exclude=[1, -1])
    assert indices.tolist() == [[2, 0, -1], [1, 2, 0]]
    # k == 0: an empty [Q, 0]
    values, indices = topk_reference(s, 0)
    assert values.shape == (2, 0) and indices.shape == (2, 0)


def test_reference_accepts_numpy():
    scores = make_scores(5, 100, torch.float16, seed=7)
    exclude = np.array([3, -1, 0, 99, 50])
    got = topk_reference(scores.numpy(), 5, exclude)
    assert_same(got, brute_topk(scores, 5, exclude))


@pytest.mark.parametrize(
    "exclude, error",
    [([0, 1], ValueError), ([7, 0, 0], ValueError), ([-2, 0, 0], ValueError)],
)
def test_reference_rejects_bad_exclude(exclude, error):
    with pytest.raises(error):
        topk_reference(torch.zeros(3, 7), 2, exclude)


def test_reference_rejects_bad_scores():
    with pytest.raises(ValueError):
        topk_reference(torch.zeros(7), 2)
    with pytest.raises(TypeError):
        topk_reference(torch.zeros(3, 7, dtype=torch.int32), 2)
    with pytest.raises(ValueError):
        topk_reference(torch.zeros(3, 7), -1)


# ---------------------------------------------------------------- dispatcher


@pytest.fixture
def fresh_fallback_messages(monkeypatch):
    monkeypatch.setattr(topk_mod, "_said", set())
    monkeypatch.delenv("KERNELS_TOPK", raising=False)


def test_topk_on_cpu_falls_back_and_says_why_once(fresh_fallback_messages, capsys):
    scores, exclude = case_inputs((3, 7), 5, torch.float32, True, seed=5)
    assert_same(topk(scores, 5, exclude), brute_topk(scores, 5, exclude))
    topk(scores, 5, exclude)
    err = capsys.readouterr().err
    assert err.count("using the torch reference") == 1 and "not CUDA" in err


def test_topk_env_forces_reference(fresh_fallback_messages, monkeypatch, capsys):
    monkeypatch.setenv("KERNELS_TOPK", "torch")
    scores = make_scores(3, 7, torch.float16)
    assert_same(topk(scores, 5), brute_topk(scores, 5))
    assert "KERNELS_TOPK=torch" in capsys.readouterr().err
    monkeypatch.setenv("KERNELS_TOPK", "fast")
    with pytest.raises(ValueError):
        topk(scores, 5)


def test_topk_explicit_backends(fresh_fallback_messages):
    scores = make_scores(3, 7, torch.float32)
    assert_same(topk(scores, 5, backend="torch"), brute_topk(scores, 5))
    with pytest.raises(ValueError):
        topk(scores, 5, backend="triton")
    with pytest.raises(ValueError, match="CUDA"):  # the kernel never runs on CPU tensors
        topk(scores, 5, backend="cupy")


def test_topk_cupy_validates_before_importing_cupy():
    with pytest.raises(ValueError, match="CUDA"):
        topk_cupy(torch.zeros(2, 3), 1)


# ---------------------------------------------------------------- CUDA source on CPU


def test_kernel_source_compiles_with_nvcc(tmp_path):
    """nvcc --ptx for sm_90 (both dtype wrappers), then ptxas, which checks the inline PTX."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    src, ptx = tmp_path / "topk.cu", tmp_path / "topk.ptx"
    src.write_text(KERNEL_SOURCE)
    cmd = [nvcc, "--ptx", "-arch=sm_90", "-Werror", "all-warnings", "-o", str(ptx), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    assert ".entry topk_f32" in text and ".entry topk_f16" in text
    ptxas = shutil.which("ptxas")
    if ptxas is not None:
        proc = subprocess.run(
            [ptxas, "-arch=sm_90", str(ptx), "-o", str(tmp_path / "topk.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr


# The kernel's own source, run as C++ with one std::thread per CUDA thread: std::barrier
# stands in for __syncthreads and for each warp's shuffles, `static` for __shared__.
# It checks the kernel's logic (lists, merge, padding, tie order) on CPU; it says nothing
# of the GPU memory model or speed.
EMULATION_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define TOPK_HOST_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __shared__ static

struct Dim3 { unsigned x = 0, y = 1, z = 1; };
static Dim3 blockIdx, blockDim;
static thread_local Dim3 threadIdx;
static std::unique_ptr<std::barrier<>> block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static unsigned long long shfl_slots[32][32];  // [warp][lane]

static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }

template <typename V>
static V __shfl_down_sync(unsigned, V v, int off) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    std::memcpy(&shfl_slots[warp][lane], &v, sizeof(V));
    warp_barriers[warp]->arrive_and_wait();
    V out = v;
    if (lane + off < 32) std::memcpy(&out, &shfl_slots[warp][lane + off], sizeof(V));
    warp_barriers[warp]->arrive_and_wait();
    return out;
}

static float host_half_to_float(unsigned short h) {
    const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    float f;
    if (exp == 0) f = std::ldexp((float)mant, -24);
    else if (exp == 31) f = mant ? NAN : INFINITY;
    else f = std::ldexp((float)(mant | 0x400), exp - 25);
    return sign ? -f : f;
}
"""

EMULATION_MAIN = r"""
// usage: emu IN OUT; IN = int32 [rows, cols, k, is_half, block], scores, int64 exclude[rows]
int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* in = std::fopen(argv[1], "rb");
    int hdr[5];
    if (!in || std::fread(hdr, 4, 5, in) != 5) return 3;
    const int rows = hdr[0], cols = hdr[1], k = hdr[2], is_half = hdr[3], block = hdr[4];
    const size_t n = (size_t)rows * cols, elem = is_half ? 2 : 4;
    std::vector<unsigned char> scores(n * elem + 1);
    std::vector<long long> exclude(rows);
    if (std::fread(scores.data(), elem, n, in) != n) return 4;
    if (std::fread(exclude.data(), 8, rows, in) != (size_t)rows) return 5;
    std::fclose(in);
    std::vector<float> values((size_t)rows * k, 12345.0f);  // sentinels: every slot must be written
    std::vector<long long> indices((size_t)rows * k, -7);
    blockDim.x = block;
    for (int r = 0; r < rows; ++r) {  // blocks run one at a time: `static` shared state is per block
        blockIdx.x = r;
        block_barrier = std::make_unique<std::barrier<>>(block);
        warp_barriers.clear();
        for (int w = 0; w < block / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> threads;
        for (int t = 0; t < block; ++t) {
            threads.emplace_back([&, t] {
                threadIdx.x = t;
                if (is_half)
                    topk_f16((const unsigned short*)scores.data(), exclude.data(), cols, k, values.data(), indices.data());
                else
                    topk_f32((const float*)scores.data(), exclude.data(), cols, k, values.data(), indices.data());
            });
        }
        for (auto& th : threads) th.join();
    }
    FILE* out = std::fopen(argv[2], "wb");
    std::fwrite(values.data(), 4, values.size(), out);
    std::fwrite(indices.data(), 8, indices.size(), out);
    std::fclose(out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated_kernel(tmp_path_factory):
    """Build the host emulation of KERNEL_SOURCE once; skip without a C++20 compiler."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not on PATH")
    folder = tmp_path_factory.mktemp("topk_emu")
    src, exe = folder / "emu.cpp", folder / "emu"
    src.write_text(EMULATION_PRELUDE + KERNEL_SOURCE + EMULATION_MAIN)
    proc = subprocess.run(
        [gxx, "-std=c++20", "-O1", "-pthread", "-Wall", "-Werror", "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "barrier" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("no C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr

    def run(scores, k, exclude=None, block=64):
        n_rows, n_cols = scores.shape
        is_half = scores.dtype == torch.float16
        ex = np.full(n_rows, -1, np.int64) if exclude is None else np.asarray(exclude, np.int64)
        inp, out = folder / "in.bin", folder / "out.bin"
        with open(inp, "wb") as f:
            np.array([n_rows, n_cols, k, int(is_half), block], np.int32).tofile(f)
            scores.contiguous().numpy().tofile(f)
            ex.tofile(f)
        proc = subprocess.run([str(exe), str(inp), str(out)], capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        raw = out.read_bytes()
        values = np.frombuffer(raw[: 4 * n_rows * k], np.float32).reshape(n_rows, k)
        indices = np.frombuffer(raw[4 * n_rows * k :], np.int64).reshape(n_rows, k)
        return torch.from_numpy(values.copy()), torch.from_numpy(indices.copy())

    return run


@pytest.mark.parametrize("shape, k, dtype, with_exclude", CASES, ids=CASE_IDS)
def test_emulated_kernel_matches_reference(emulated_kernel, shape, k, dtype, with_exclude):
    scores, exclude = case_inputs(shape, k, dtype, with_exclude, seed=case_seed(shape, k))
    assert_same(emulated_kernel(scores, k, exclude), topk_reference(scores, k, exclude))


@pytest.mark.parametrize("block", [32, 256])
def test_emulated_kernel_block_sizes(emulated_kernel, block):
    # 256 is the launched block size; 32 is one warp (a single-warp merge)
    scores, exclude = case_inputs((4, 3000), MAX_K, torch.float16, True, seed=11)
    assert_same(emulated_kernel(scores, MAX_K, exclude, block=block), topk_reference(scores, MAX_K, exclude))


@pytest.mark.parametrize("block", [32, 256])
def test_emulated_kernel_ties_at_full_thread_lists(emulated_kernel, block):
    # Thread t scans columns t, t+block, ...; its list fills once it has seen k of them, and
    # a later tie with its k-th must lose to the lower index already held. Row 2 puts the
    # whole answer in thread 0 (every column j % block == 0 ties at 2.0), so the tails of
    # the per-thread lists matter, not only their heads.
    n = 64 * 256 + 7
    scores = torch.ones(3, n)
    scores[1, n // 2 :] = 2.0
    scores[2, ::block] = 2.0
    exclude = [10, -1, block]
    for k in (5, MAX_K):
        want = topk_reference(scores, k, exclude)
        assert want[1][1].tolist() == list(range(n // 2, n // 2 + k))
        assert want[1][2].tolist() == [block * i for i in range(k + 1) if i != 1][:k]
        assert_same(emulated_kernel(scores, k, exclude, block=block), want)


# ---------------------------------------------------------------- GPU


def need_gpu():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, k, dtype, with_exclude", CASES, ids=CASE_IDS)
def test_cupy_matches_reference(shape, k, dtype, with_exclude):
    need_gpu()
    scores, exclude = case_inputs(shape, k, dtype, with_exclude, seed=case_seed(shape, k))
    want = topk_reference(scores, k, exclude)
    ex = None if exclude is None else exclude.cuda()
    assert_same(topk_cupy(scores.cuda(), k, ex), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_large_matches_reference_on_gpu(dtype):
    need_gpu()
    scores, exclude = case_inputs((300, 125_000), MAX_K, dtype, True, seed=21)
    scores, exclude = scores.cuda(), exclude.cuda()
    got = topk_cupy(scores, MAX_K, exclude)
    assert_same(got, tuple(t.cpu() for t in topk_reference(scores, MAX_K, exclude)))


@pytest.mark.gpu
def test_cupy_accepts_cupy_arrays_and_auto_picks_kernel(fresh_fallback_messages, capsys):
    need_gpu()
    import cupy

    scores = make_scores(5, 100, torch.float16).cuda()
    want = topk_reference(scores.cpu(), 5)
    assert_same(topk_cupy(cupy.from_dlpack(scores), 5), want)
    assert_same(topk(scores, 5), want)
    assert capsys.readouterr().err == ""  # no fallback on the fast path
