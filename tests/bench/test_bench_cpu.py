"""CPU benchmarks: decoders, runtimes, the whole ABI, and the ratio to the naive reference path.

    python -m pytest tests/bench/test_bench_cpu.py --benchmark-enable --benchmark-json=bench.json

Speed figures are ratios measured in the same run (no thresholds: these are benchmarks,
not timed tests). The ratio lands in the benchmark's extra_info and on stderr.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, run_abi, tiny_spec

from engine.classify.artifact import load_artifact
from engine.classify.runtime import load_runtime
from engine.decoders import make_decoder
from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

pytestmark = pytest.mark.abi   # benchmarks: the 400-image cohort, the AOT artifact, scripts/run

ROUNDS = 3


@pytest.fixture(scope="module")
def blobs(cohort):
    """The first 64 files of the cohort and the positions of its planted broken ones among them."""
    items = json.loads((cohort / "cohort.json").read_text())["items"][:64]
    broken = {i for i, it in enumerate(items) if it["encoding"].startswith("broken:")}
    return [(cohort / it["path"]).read_bytes() for it in items], broken


@pytest.mark.parametrize("name", ["pil", "dali-cpu"])
def test_bench_decode(benchmark, blobs, name):
    data, broken = blobs
    dec = make_decoder(name, tiny_spec(), 16)

    def decode_all():
        return [dec.decode(data[i:i + 16]) for i in range(0, len(data), 16)]

    benchmark.extra_info["images"] = len(data)
    batches = benchmark(decode_all)
    # what was timed is a full decode: every readable image decoded to the spec's shape, not blank
    images = np.concatenate([b[0] for b in batches])  # [64, S, S, 3] uint8
    failed = {16 * j + i for j, b in enumerate(batches) for i in b[1]}
    assert images.shape == (len(data), TINY_INPUT, TINY_INPUT, 3) and images.dtype == np.uint8
    assert failed <= broken
    assert all(images[i].std() > 0 for i in range(len(data)) if i not in broken)


@pytest.mark.parametrize("which", ["eager", "aot"])
def test_bench_inference(benchmark, which, request):
    rt = load_runtime(load_artifact(request.getfixturevalue(f"{which}_artifact")))  # builds only the one it times
    x = np.random.default_rng(0).integers(0, 256, (rt.batch_size, TINY_INPUT, TINY_INPUT, 3), dtype=np.uint8)
    want = rt.run(x)  # warm-up outside the timed rounds
    benchmark.extra_info["batch_size"] = rt.batch_size
    got = benchmark(rt.run, x)
    # the timed call did the work: one class in [0, 999] per row, the same answers as the warm-up
    assert got.shape == (rt.batch_size,) and got.dtype == np.int32
    assert ((got >= 0) & (got <= 999)).all()
    np.testing.assert_array_equal(got, want)


def _reference_cmd(cohort, ckpt, out):
    return [sys.executable, "-m", "evaluator.reference", str(cohort / "manifest.tsv"), str(cohort), str(out),
            "--model", TINY_MODEL, "--input-size", str(TINY_INPUT), "--crop-mode", "squash", "--crop-pct", "1.0",
            "--model-kwargs", json.dumps(TINY_KWARGS), "--checkpoint", str(ckpt)]


def test_bench_abi_vs_naive_reference(benchmark, cohort, aot_artifact, tiny_checkpoint, tmp_path):
    """Whole processes, start to reaped: scripts/run (aot + dali-cpu) vs PIL + eager FP32 batch 1."""
    out = tmp_path / "p.i32"

    def abi():
        r = run_abi(cohort / "manifest.tsv", cohort, out, aot_artifact)
        assert r.returncode == 0, r.stderr

    rounds = 1 if benchmark.disabled else ROUNDS  # disabled (the default in CI): one smoke round
    naive = []
    for _ in range(rounds):
        t = time.perf_counter()
        subprocess.run(_reference_cmd(cohort, tiny_checkpoint, tmp_path / "ref.i32"), check=True,
                       capture_output=True, cwd=REPO)
        naive.append(time.perf_counter() - t)
    t = time.perf_counter()
    benchmark.pedantic(abi, rounds=rounds, iterations=1, warmup_rounds=0)
    fast = benchmark.stats.stats.median if benchmark.stats else time.perf_counter() - t
    ratio = statistics.median(naive) / fast
    benchmark.extra_info.update({"images": 400, "naive_median_s": statistics.median(naive), "abi_median_s": fast,
                                 "speedup_vs_naive": round(ratio, 3)})
    print(json.dumps({"abi_median_s": round(fast, 3), "naive_median_s": round(statistics.median(naive), 3),
                      "speedup_vs_naive": round(ratio, 3)}), file=sys.stderr)
