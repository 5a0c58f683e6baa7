"""The mixed-precision policy, the margin guard and the choice of tau."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_spec
from torch import nn

from engine.classify.guard import Guard
from engine.core.checkpoint import load_model
from engine.core.model import Top1Model, wrap
from engine.core.precision import Fp32Linear, Fp32Norm, LowPrecisionLinear, _fold_qkv_bias, apply_policy
from engine.core.spec import Spec
from engine.presets import preset
from engine.tuning.calibrate import TauRule, choose_tau, folder_pixels, generated_pixels


def test_policy_puts_gemms_low_and_keeps_norms_head_and_patch_embed_fp32(tiny_checkpoint):
    net = load_model(tiny_spec(), tiny_checkpoint)
    low = apply_policy(net, "bf16")
    linears = [m for m in low.modules() if isinstance(m, LowPrecisionLinear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert type(low.head) is Fp32Linear and low.head.weight.dtype == torch.float32
    assert low.patch_embed.proj.weight.dtype == torch.float32
    norms = [m for m in low.modules() if isinstance(m, Fp32Norm)]
    assert norms and all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    assert not any(isinstance(m, nn.LayerNorm) and not isinstance(p, Fp32Norm)
                   for p in low.modules() for m in p.children() if not isinstance(p, Fp32Norm))
    assert next(net.parameters()).dtype == torch.float32      # the policy works on a copy


def test_exported_graph_runs_norms_and_head_in_fp32_and_matmuls_in_bf16(tiny_checkpoint):
    spec = tiny_spec(batch_size=2, precision="bf16")
    model = wrap(load_model(spec, tiny_checkpoint), spec, "cpu")
    x = torch.zeros((2, spec.input_size, spec.input_size, 3), dtype=torch.uint8)
    with torch.inference_mode():
        ep = torch.export.export(model, (x,), strict=False)
    dtypes: dict[str, set] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if "layer_norm" in name or "linear" in name or "addmm" in name or "mm.default" in name:
            arg = node.args[0]
            dtypes.setdefault(name.split(".")[1] if "." in name else name, set()).add(arg.meta["val"].dtype)
    norm_ops = [k for k in dtypes if "layer_norm" in k]
    assert norm_ops and all(dtypes[k] == {torch.float32} for k in norm_ops), dtypes
    mm_dtypes = set().union(*(v for k, v in dtypes.items() if "layer_norm" not in k))
    assert torch.bfloat16 in mm_dtypes and torch.float32 in mm_dtypes   # the blocks' GEMMs and the head
    out_node = [n for n in ep.graph.nodes if n.op == "output"][0]
    assert out_node.args[0][0].meta["val"].dtype == torch.int32


def test_folding_the_qkv_biases_is_exact(tiny_checkpoint):
    net = load_model(tiny_spec(), tiny_checkpoint)
    folded = apply_policy(net, "fp32")
    _fold_qkv_bias(folded)
    assert folded.blocks[0].attn.q_bias is None and folded.blocks[0].attn.qkv.bias is not None
    x = torch.randn(2, 3, 112, 112)
    with torch.inference_mode():
        torch.testing.assert_close(folded(x), net(x), rtol=0, atol=2e-5)


class _NearTie(nn.Module):
    """Two features from nearly equal GEMM rows (low precision under the policy) read out by an
    FP32 identity head: their FP32 gap is far below the bf16 spacing of each, so rounding
    decides the order of classes 0 and 1 (class 2 is never top)."""

    def __init__(self, size: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(3 * size * size, generator=g) * 0.05
        self.body = nn.Linear(3 * size * size, 3, bias=False)
        self.body.weight.data = torch.stack([w, w + 1e-4 * torch.randn(w.shape, generator=g), -w])
        self.head = nn.Linear(3, 3)
        self.head.weight.data = torch.eye(3)
        self.head.bias.data.zero_()

    def get_classifier(self):
        return self.head

    def forward(self, x):
        return self.head(self.body(x.flatten(1)))


def test_guard_restores_fp32_answers_on_planted_near_ties():
    size = 8
    spec = Spec(model="near-tie", input_size=size, batch_size=32, precision="bf16", num_classes=3)
    net = _NearTie(size).eval()
    low = Top1Model(apply_policy(net, "bf16"), spec, margin=True)
    ref = Top1Model(apply_policy(net, "fp32"), spec, margin=True)
    x = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (32, size, size, 3), dtype=np.uint8))
    with torch.inference_mode():
        want = ref(x)[0]
        raw, margin = low(x)
        flips = int((raw != want).sum())
        assert flips >= 3, "the planted near-ties must flip in raw bf16"
        calib = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (64, size, size, 3), dtype=np.uint8))
        c_low, c_margin = low(calib)
        r_top1, r_margin = ref(calib)
        chosen = choose_tau(c_low.numpy(), c_margin.numpy(), r_top1.numpy(), r_margin.numpy(),
                            TauRule(budget=10, safety=preset("cpu").guard_safety))
        # every calibration disagreement is re-checked (one left would be 1,560 per 10,000)
        assert chosen["disagreements"] >= 1 and chosen["tau"] > chosen["largest_disagreeing_margin"]
        assert chosen["estimated_per_10k"] <= 10
        guard = Guard(lambda b: ref(b)[0], chosen["tau"], batch=4)
        fixed = guard.apply(x, raw, margin)
        guard.finish()
    assert torch.equal(fixed, want)
    s = guard.stats
    assert s.images == 32 and s.rechecked >= flips and s.changed == flips and s.calls == -(-s.rechecked // 4)
    padded = guard.apply(x, raw, margin, valid=0)                           # padding rows are never re-checked
    guard.finish()
    assert torch.equal(padded, raw) and guard.stats.images == 32 and guard.stats.calls == s.calls


def _choose(low, margins, ref, ref_margins=None, **kw):
    kw = {"budget": preset("cpu").guard_budget, "safety": preset("cpu").guard_safety, **kw}   # the build's defaults
    ref_margins = np.asarray(margins if ref_margins is None else ref_margins, np.float32)
    return choose_tau(np.asarray(low), np.asarray(margins, np.float32), np.asarray(ref), ref_margins, TauRule(**kw))


def test_choose_tau_keeps_the_estimate_under_the_budget():
    rng = np.random.default_rng(0)
    n = 1000
    margins = rng.exponential(2.0, n).astype(np.float32)                  # a photo-like spread of margins
    err = np.abs(rng.normal(0, 0.02, n)).astype(np.float32)                 # small rounding errors
    low = np.arange(n)
    c = _choose(low, margins, low, margins + err, budget=10, safety=2)
    assert c["disagreements"] == 0 and 0 < c["tau"] < 0.5 and c["estimated_per_10k"] <= 10
    below = [p for p in c["curve"] if p["threshold"] < c["tau"] - 1e-5]
    assert below and all(p["estimated_per_10k"] > 10 for p in below)         # tau is the smallest that holds
    assert c["rechecked_fraction"] == pytest.approx(float((margins < c["tau"]).mean()))
    assert set(c["margin_error"]["quantiles"]) == {"0.5", "0.9", "0.99", "1.0"}
    # a looser budget needs a smaller tau, a larger safety factor a larger one, larger errors a larger one
    assert _choose(low, margins, low, margins + err, budget=100)["tau"] < c["tau"]
    assert _choose(low, margins, low, margins + err, budget=10, safety=8)["tau"] > c["tau"]
    assert _choose(low, margins, low, margins + 5 * err, budget=10)["tau"] > c["tau"]
    # an observed disagreement above tau counts in full: tau goes past its margin
    ref = low.copy()
    ref[np.argsort(margins)[n // 4]] = -1
    d = _choose(low, margins, ref, margins + err, budget=10)
    assert d["tau"] > d["largest_disagreeing_margin"] > c["tau"]
    with pytest.raises(ValueError):
        _choose(low, margins, low, safety=0.5)
    with pytest.raises(ValueError):
        _choose(low, margins, low, budget=0)


def test_calibration_images_generated_and_from_a_folder(tmp_path):
    from PIL import Image

    from evaluator.contest.eval_data_signs import calibration_refusals

    spec = tiny_spec()
    px, rec = generated_pixels(spec, 20)
    assert px.shape == (20, 112, 112, 3) and px.dtype == np.uint8 and "procedural" in rec["origin"]
    assert generated_pixels(spec, 20)[1]["pixels_sha256"] == rec["pixels_sha256"]       # deterministic
    good = tmp_path / "photos"
    good.mkdir()
    for i in range(18):
        Image.fromarray(px[i]).save(good / f"img{i:03d}.jpg")
    (good / "notes.txt").write_text("not an image\n")
    got, rec2 = folder_pixels(good, spec, 256)
    assert got.shape == (18, 112, 112, 3) and len(rec2["files_sha256"]) == 64
    bad = tmp_path / "val"
    bad.mkdir()
    for i in range(18):
        Image.fromarray(px[i]).save(bad / f"ILSVRC2012_val_{i + 1:08d}.JPEG")
    assert len(folder_pixels(bad, spec, 256)[0]) == 18         # the engine alone knows no evaluation data
    with pytest.raises(ValueError, match="ImageNet validation"):   # the contest's check, as its build passes it
        folder_pixels(bad, spec, 256, refuse=calibration_refusals)
    (good / "answers.txt").write_text("".join(f"ILSVRC2012_val_{i:08d}\t{i % 1000}\n" for i in range(1, 1100)))
    with pytest.raises(ValueError, match="answer table"):
        folder_pixels(good, spec, 256, refuse=calibration_refusals)


def test_projection_fusion_is_exact_on_an_eva02_large_layout():
    import timm

    from engine.core.fuse import FusedSwiGLU, fuse_projections

    torch.manual_seed(0)
    net = timm.create_model("eva02_large_patch14_448", pretrained=False, depth=2, embed_dim=64, num_heads=4,
                            img_size=56).eval()      # separate q/k/v (k without bias), SwiGLU with inner norm
    for p in net.parameters():                       # timm zero-inits some biases: make every term count
        p.data.add_(0.02 * torch.randn_like(p))
    fused = apply_policy(net, "fp32")
    assert fused.blocks[0].attn.qkv is not None and fused.blocks[0].attn.q_proj is None
    assert isinstance(fused.blocks[0].mlp, FusedSwiGLU)
    x = torch.randn(2, 3, 56, 56)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), net(x), rtol=1e-5, atol=1e-5)
    import copy

    assert fuse_projections(copy.deepcopy(net)) == {"qkv": 2, "swiglu": 2}
    low = apply_policy(net, "bf16")                 # the fused GEMMs take the low precision like any Linear
    assert isinstance(low.blocks[0].attn.qkv, LowPrecisionLinear)
    assert isinstance(low.blocks[0].mlp.fc1, LowPrecisionLinear)


@pytest.mark.abi   # a build with a measured batch-size search
def test_batch_size_auto_measures_and_records(tiny_checkpoint, tmp_path, monkeypatch):
    from engine.tuning import main

    # the reference decoder pinned: no decoder is measured against it (tests/test_build_decoder.py
    # measures that), the batch sizes are
    monkeypatch.setenv("ENGINE_DECODER", "pil")
    out = tmp_path / "art"
    rc = main(["--model", tiny_spec().model, "--checkpoint", str(tiny_checkpoint), "--out", str(out),
               "--input-size", "112", "--crop-mode", "squash", "--crop-pct", "1.0", "--model-kwargs", '{"depth": 4}',
               "--backend", "eager", "--batch-size", "auto", "--precision", "fp32"])
    assert rc == 0
    import json

    meta = json.loads((out / "manifest.json").read_text())
    search = meta["build"]["search"]
    rows = {r["batch_size"]: r for r in search["candidates"]}
    assert set(rows) == {8, 16, 32} and all(r["precision"] == "fp32" and r["backend"] == "eager" for r in rows.values())
    assert search["chosen"] == f"eager/fp32/b{meta['batch_size']}" and rows[meta["batch_size"]]["status"] == "chosen"
    # the fastest on the graph, unless a simpler one ties: a smaller batch whose median is within TIE
    # plus the spread of the two rows' timings (engine.tuning.retime.margin)
    from engine.tuning.retime import spread

    chosen = rows[meta["batch_size"]]
    best = max((r for r in rows.values() if r.get("images_per_s")), key=lambda r: r["images_per_s"])
    margin = search["tie"] + max(spread(best.get("timings", [])), spread(chosen.get("timings", [])))
    assert best["images_per_s"] <= chosen["images_per_s"] * (1 + margin)
    assert all(r["status"] in ("chosen", "holds", "slower", "not compiled") for r in rows.values())
    assert search["verify"][-1]["ok"] and search["verify"][-1]["agreement"] >= 0.99
    with pytest.raises(SystemExit):     # auto measures the model: no checkpoint is a usage error
        main(["--model", "x", "--out", str(tmp_path / "b"), "--batch-size", "auto"])


@pytest.mark.abi
def test_reference_path_never_blocks_on_a_fifo(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO

    from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL, make_tiny_checkpoint

    ck = tmp_path / "ck.safetensors"
    make_tiny_checkpoint(ck, classes=5, renders=2, steps=20)
    os.mkfifo(tmp_path / "fifo.jpg")
    (tmp_path / "m.tsv").write_text("a\tfifo.jpg\n")
    r = subprocess.run([sys.executable, "-m", "evaluator.reference", str(tmp_path / "m.tsv"), str(tmp_path),
                        str(tmp_path / "ref.i32"), "--model", TINY_MODEL, "--input-size", str(TINY_INPUT),
                        "--crop-mode", "squash", "--crop-pct", "1.0", "--model-kwargs", json.dumps(TINY_KWARGS),
                        "--checkpoint", str(ck)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert np.fromfile(tmp_path / "ref.i32", "<i4").tolist() == [-1]


def test_tau_from_natural_photos_for_a_budget_is_below_the_worst_case_rule_on_renders(tiny_checkpoint):
    """The default calibration (photo crops, a disagreement budget) against renders with the
    worst-case rule (tau = 2 x the largest margin error seen): a smaller tau, fewer re-checks."""
    from engine.tuning.calibrate import classify, margin_errors, photo_pixels

    spec = tiny_spec(batch_size=16, precision="bf16")
    net = load_model(spec, tiny_checkpoint)
    low = wrap(net, spec, "cpu", margin=True)
    ref = wrap(net, tiny_spec(batch_size=16), "cpu", margin=True)

    def measure(pixels):
        a, ma = classify(low, pixels, 16, margin=True)
        b, mb = classify(ref, pixels, 16, margin=True)
        return a, ma, b, mb

    photos, rec = photo_pixels(spec, 32)
    assert "scikit-image" in rec["origin"] and len(rec["photos"]) >= 8
    assert photo_pixels(spec, 32)[1]["pixels_sha256"] == rec["pixels_sha256"]      # deterministic
    renders, _ = generated_pixels(spec, 32)
    natural = choose_tau(*measure(photos), TauRule(budget=10, safety=2))
    worst_case = 2 * float(margin_errors(*measure(renders)).max())
    assert worst_case > 0 and natural["tau"] < worst_case
    assert natural["estimated_per_10k"] <= 10 and natural["images"] == 32
