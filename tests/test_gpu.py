"""GPU paths against their CPU reference twins. Marked `gpu`: skipped cleanly without CUDA."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_abi, tiny_spec

from engine.decoders.pil import decode_pil
from evaluator.contest.agreement import agreement
from evaluator.contest.manifest import read_manifest
from evaluator.contest.reference import reference_top1

pytestmark = pytest.mark.gpu


def _blobs(cohort):
    items = json.loads((cohort / "cohort.json").read_text())["items"]
    return items, [(cohort / it["path"]).read_bytes() for it in items]


@pytest.mark.parametrize("name", ["nvjpeg", "dali-gpu"])
@pytest.mark.parametrize("crop_mode", ["squash", "center"])
def test_gpu_decoders_match_the_reference(small_cohort, name, crop_mode):
    if name == "dali-gpu":
        pytest.importorskip("nvidia.dali")
    from engine.decoders import make_decoder

    spec = tiny_spec(crop_mode)
    items, blobs = _blobs(small_cohort)
    decoder = make_decoder(name, spec, len(blobs), None, isolate=False)
    assert decoder.name == name, f"{name} fell back to {decoder.name} (see stderr)"  # test this one, not PIL
    try:
        got, failed = decoder.decode(blobs)
    finally:
        decoder.close()
    got = got.cpu().numpy()
    broken = {i for i, it in enumerate(items) if it["encoding"].startswith("broken")}
    assert set(failed) == broken
    diffs = []
    for i, blob in enumerate(blobs):
        if i not in broken:
            d = np.abs(got[i].astype(int) - decode_pil(blob, spec).astype(int))
            diffs.append(d.mean())
            assert d.mean() < 2.0, (name, items[i]["encoding"], d.mean())  # nvJPEG's IDCT/upsampling differ
    assert np.mean(diffs) < 1.0


@pytest.mark.abi
@pytest.mark.parametrize("backend,precision", [("eager", "fp32"), ("eager", "bf16"), ("eager", "fp16"),
                                               ("aot", "fp32"), ("aot", "bf16")])
def test_cuda_artifacts_agree_with_the_fp32_reference(cohort, tiny_checkpoint, tmp_path, backend, precision):
    from engine.tuning import build

    art = tmp_path / "art"
    build(tiny_spec("squash", 32, precision), tiny_checkpoint, art, backend=backend, device="cuda")
    out = tmp_path / "p.i32"
    r = run_abi(cohort / "manifest.tsv", cohort, out, art)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_manifest(cohort / "manifest.tsv")
    ref = reference_top1(tiny_spec("squash"), tiny_checkpoint, [cohort / x.path for x in rows], "cuda")
    res = agreement(np.fromfile(out, "<i4"), ref, 0.995)
    assert res.passed, f"{backend}/{precision}: {res.matches}/{res.total}"


def test_cuda_graph_replay_equals_plain_launches(tiny_checkpoint, tmp_path):
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import load_runtime
    from engine.tuning import build

    art = tmp_path / "art"
    build(tiny_spec("squash", 16), tiny_checkpoint, art, backend="eager", device="cuda")
    x = np.random.default_rng(0).integers(0, 256, (16, 112, 112, 3), dtype=np.uint8)
    graphed = load_runtime(load_artifact(art))
    assert graphed.cuda_graph
    plain = load_runtime(load_artifact(art), cuda_graphs=False)
    assert not plain.cuda_graph
    a, b = graphed.run(x), plain.run(x)
    assert np.array_equal(a, b)
    assert np.array_equal(graphed.run(x[::-1].copy()), b[::-1])  # a second replay sees new input


def test_tensorrt_artifact_builds_loads_and_agrees(tiny_checkpoint, tmp_path):
    """The trt backend end to end on the GPU: build (guarded bf16), load through the runtime, classify."""
    pytest.importorskip("torch_tensorrt", reason="torch_tensorrt is not installed: no TensorRT artifact is tested")
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import load_runtime
    from engine.core.checkpoint import load_model
    from engine.core.model import wrap
    from engine.tuning import build

    spec = tiny_spec("squash", 16, "bf16")
    art = tmp_path / "art"
    build(spec, tiny_checkpoint, art, backend="trt", device="cuda")
    rt = load_runtime(load_artifact(art))
    assert rt.name == "trt" and rt.guard is not None
    x = np.random.default_rng(0).integers(0, 256, (16, 112, 112, 3), dtype=np.uint8)
    got = rt.run(x)
    ref = wrap(load_model(tiny_spec("squash", 16), tiny_checkpoint), tiny_spec("squash", 16), "cuda")
    import torch

    with torch.inference_mode():
        want = ref(torch.from_numpy(x).cuda()).cpu().numpy()
    assert got.dtype == np.int32 and (got == want).mean() >= 0.9
