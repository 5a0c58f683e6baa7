"""CLIP loading from local folders: three layouts, one set of numbers; clear errors; the
tokenizer and preprocessing against open_clip's own (the reference twins)."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cir_helpers import clip_dirs, workspace

from engine.clip.hf import hf_config_from_model_cfg, hf_to_open_clip, model_cfg_from_hf, open_clip_to_hf
from engine.clip.load import ClipLoadError, build_open_clip, find_layout, load_clip
from engine.clip.towers import ClipTowers
from evaluator.synthetic.cir_corpus import TINY_CLIP

TEXTS = ["a red car", "", "find pattern 3 but make it blue", "word " * 200]


def _pixels(n=5, size=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def reference():
    """Embeddings of the open_clip layout: the one the others must reproduce."""
    model, spec, info = load_clip(clip_dirs()["open_clip"])
    t = ClipTowers(model, spec, "cpu", "fp32")
    return t.encode_images(_pixels()), t.encode_texts(TEXTS), spec, info


@pytest.mark.parametrize("layout", ["open_clip", "openai", "hf"])
def test_layouts_give_identical_embeddings(layout, reference):
    img_ref, txt_ref, spec_ref, info_ref = reference
    model, spec, info = load_clip(clip_dirs()[layout])
    assert info["layout"] == layout and len(info["digest"]) == 64
    assert spec.image.to_dict() | {"model": ""} == spec_ref.image.to_dict() | {"model": ""}
    assert (spec.context_length, spec.embed_dim) == (77, 64)
    t = ClipTowers(model, spec, "cpu", "fp32")
    torch.testing.assert_close(t.encode_images(_pixels()), img_ref, rtol=0, atol=0)
    torch.testing.assert_close(t.encode_texts(TEXTS), txt_ref, rtol=0, atol=0)
    assert torch.allclose(img_ref.norm(dim=-1), torch.ones(5))


def test_openai_state_dict_without_name_infers_architecture(reference, capsys):
    d = workspace() / "noname"
    d.mkdir(exist_ok=True)
    shutil.copy(clip_dirs()["openai"] / "model.pt", d / "model.pt")
    model, spec, info = load_clip(d / "model.pt")         # a file path works as well as a folder
    assert "inferring an OpenAI ViT CLIP" in capsys.readouterr().err
    t = ClipTowers(model, spec, "cpu", "fp32")
    torch.testing.assert_close(t.encode_images(_pixels()), reference[0], rtol=0, atol=0)


def test_model_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("CLIP_MODEL_DIR", str(clip_dirs()["hf"]))
    assert find_layout(clip_dirs()["hf"]).kind == "hf"
    assert load_clip()[2]["layout"] == "hf"
    monkeypatch.delenv("CLIP_MODEL_DIR")
    with pytest.raises(ClipLoadError, match="CLIP_MODEL_DIR"):   # the engine has no default folder
        load_clip()
    from evaluator.cir import task

    assert task.clip_dir() == Path("/task/models/clip")          # the retrieval ABI's default mount
    assert task.clip_dir("/x") == Path("/x")


def test_hf_mapping_round_trip_multi_head():
    """q/k/v split and stack with 2 heads, both directions, and the config maps back."""
    cfg = json.loads(json.dumps(TINY_CLIP))
    cfg["vision_cfg"]["head_width"] = 32
    cfg["text_cfg"]["heads"] = 2
    torch.manual_seed(1)
    sd = build_open_clip(cfg).state_dict()
    back = hf_to_open_clip(open_clip_to_hf(sd))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    cfg2 = model_cfg_from_hf(hf_config_from_model_cfg(cfg))
    assert cfg2["vision_cfg"]["head_width"] == 32 and cfg2["text_cfg"]["heads"] == 2
    assert cfg2["vision_cfg"]["mlp_ratio"] == 4.0 and cfg2["quick_gelu"] is True


@pytest.mark.parametrize("case, files, message", [
    ("empty", [], "open_clip_config.json"),
    ("open_clip-no-weights", ["open_clip_config.json"], "open_clip_pytorch_model"),
    ("hf-no-weights", ["config.json"], "model.safetensors"),
    ("two-state-dicts", ["a.pt", "b.pt"], "several state-dict files"),
])
def test_missing_files_are_named(tmp_path, case, files, message):
    for f in files:
        (tmp_path / f).write_text("{}")
    with pytest.raises(ClipLoadError, match=message):
        load_clip(tmp_path)


def test_missing_dir_and_unknown_name(tmp_path):
    with pytest.raises(ClipLoadError, match="not found"):
        load_clip(tmp_path / "nope")
    d = tmp_path / "named"
    d.mkdir()
    shutil.copy(clip_dirs()["openai"] / "model.pt", d / "model.pt")
    (d / "model_name.txt").write_text("no-such-arch\n")
    with pytest.raises(ClipLoadError, match="neither an open_clip built-in config nor a file"):
        load_clip(d)


def test_key_mismatch_names_keys(tmp_path):
    d = tmp_path / "oc"
    shutil.copytree(clip_dirs()["open_clip"], d)
    sd = torch.load(d / "open_clip_pytorch_model.bin", weights_only=True)
    del sd["visual.proj"]
    sd["extra.weight"] = torch.zeros(1)
    torch.save(sd, d / "open_clip_pytorch_model.bin")
    with pytest.raises(Exception, match=r"missing keys \['visual.proj'\].*unexpected keys \['extra.weight'\]"):
        load_clip(d)


def test_tokenizer_matches_open_clip():
    from open_clip.tokenizer import SimpleTokenizer

    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    t = ClipTowers(model, spec, "cpu")
    texts = TEXTS + ["x" * 50_000, "café ünïcode �"]
    tokens, cut = t.tokenize(texts)
    assert torch.equal(tokens[:4], SimpleTokenizer(context_length=77)(TEXTS))
    assert cut == [False, False, False, True, True, False]
    assert tokens[3, -1].item() == SimpleTokenizer().eot_token_id  # truncated rows still end in eot


def test_preprocessing_matches_open_clip_transform():
    """The CLIP spec through the engine's PIL reference == open_clip's own eval transform."""
    from open_clip.transform import image_transform
    from PIL import Image

    from engine.decoders.pil import reference_tensor

    _, spec, _ = load_clip(clip_dirs()["open_clip"])
    tf = image_transform(64, is_train=False, mean=spec.image.mean, std=spec.image.std,
                         interpolation="bicubic", resize_mode="shortest")
    for w, h in [(150, 90), (64, 64), (77, 203)]:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        ours = reference_tensor(buf.getvalue(), spec.image)
        theirs = tf(Image.open(io.BytesIO(buf.getvalue())))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_trimmed_text_forward_matches_open_clip(monkeypatch):
    """The fast path (first L positions only) against open_clip's encode_text, and its off switch."""
    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    t = ClipTowers(model, spec, "cpu", "fp32")
    texts = TEXTS + ["<end_of_text> inside", "a", "x" * 30_000]
    tokens, _ = t.tokenize(texts)
    for rows in ([0, 1, 2, 3, 4, 5, 6], [1], [1, 5], [4, 5]):     # batches with short and full-length rows
        fast = t.encode_tokens(tokens[rows], trim=True)
        ref = t.encode_tokens(tokens[rows], trim=False)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("CLIP_TEXT_TRIM", "0")
    assert ClipTowers(model, spec, "cpu").trim_text is False
