"""CPU benchmark: re-inspection's decode side, per candidate image, for crops 1, 3 and 5.

What docs/retrieval_quality.md's cost estimate needs: the seconds to read, decode, resize, crop
and mirror every view of one candidate (the image tower replaced by a stub), through the decoder
a CPU build uses (dali-cpu, in this process), on generated 640 x 480 JPEGs (COCO's typical
size; noise-textured so they decode no faster than photographs). The estimate at the task's
scale is then 2,200 requests x 100 candidates x (seconds per image) / cores.
Run: ENGINE_THREADS=16 python -m pytest tests/bench/test_bench_reinspect.py --benchmark-enable \
     --benchmark-json=OUT.json   (extra_info: images per round, decodes per image)
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from engine.core.spec import Spec
from engine.retrieval.reinspect import ReinspectBudget, Reinspector, ViewDecoding, view_groups

pytest.importorskip("pytest_benchmark")
pytest.importorskip("nvidia.dali")

IMAGES = 64


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:640]
    out = []
    for i in range(IMAGES):
        base = np.stack([x * (i + 1) % 256, y * 3 % 256, (x + y) % 256], -1).astype(np.float32)
        img = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)   # [480, 640, 3]
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


@pytest.mark.parametrize("crops", [1, 3, 5])
def test_bench_reinspect_decode(benchmark, blobs, crops):
    spec = Spec(model="clip-vit-l-14", input_size=224, crop_pct=1.0)   # open_clip's ViT-L/14 geometry
    r = Reinspector(lambda row: blobs[row], lambda px: torch.zeros(len(px), 8), spec, crops,
                    ReinspectBudget(IMAGES), ViewDecoding("dali-cpu", batch_size=64, isolate=False))
    rows = list(range(IMAGES))
    r.view_sums(rows[:8])                       # warm-up: the decoders' pipelines are built here

    def run():
        r.cache.clear()                         # every round decodes every image again
        return r.view_sums(rows)

    sums = benchmark(run)
    assert all(sums[i] is not None for i in rows) and not r.failed
    benchmark.extra_info.update(images=IMAGES, decodes_per_image=len(view_groups(r.views)), crops=crops)
