"""Pic2Word mapping on the tiny CLIP: token injection against open_clip, training (loss falls,
inversion beats a random token, seeded, resumable), the build option and the run end to end."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from cir_helpers import build_args, built_index, check_abi, clip_dirs, corpus, read_rows, requests_of, script
from cir_quality_helpers import P2W_ARGS, p2w_index

from engine.clip.inject import encode_with_slot, placeholder_id, slots_of
from engine.retrieval.index import load_index
from engine.retrieval.pic2word import (
    TRAIN_PROMPT,
    Pic2WordConfig,
    Stopped,
    encode_prompts,
    load_mapping,
    train,
)
from evaluator.cir import build as cir_build
from evaluator.cir import run as cir_run

CFG = Pic2WordConfig(hidden=128, steps=120, batch_size=64, lr=1e-3, ckpt_every=20)
KEY = {"gallery": "test"}


@pytest.fixture(scope="module")
def towers():
    from engine.clip.load import load_clip
    from engine.clip.towers import ClipTowers

    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    return ClipTowers(model, spec, "cpu", "fp32")


@pytest.fixture(scope="module")
def gallery():
    return np.asarray(load_index(built_index()).emb)              # [320, 64] float16 unit rows


@pytest.fixture(scope="module")
def trained(towers, gallery, tmp_path_factory):
    return train(towers, gallery, CFG, tmp_path_factory.mktemp("p2w"), KEY, log=lambda m: None)


def test_injection_matches_open_clip_encode_text(towers):
    model = towers.model
    tokens = towers.tokenize(["a photo of * that is red", "a photo of *", "x y z a photo of * and more"])[0]
    star = placeholder_id(towers.tokenizer)
    slot = slots_of(tokens, star)
    assert slot.tolist() == [4, 4, 7]                              # sot a photo of * ...
    own = model.token_embedding.weight[star].expand(3, -1)
    with torch.no_grad():
        want = model.encode_text(tokens)
        for trim in (True, False):                                 # fast path and its twin
            torch.testing.assert_close(encode_with_slot(model, tokens, slot, own, trim=trim), want)
        other = torch.randn(3, own.shape[1], generator=torch.Generator().manual_seed(0))
        a, b = (encode_with_slot(model, tokens, slot, other, trim=t) for t in (True, False))
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, want)                         # the slot's embedding matters
    x = other.clone().requires_grad_(True)
    encode_with_slot(model, tokens, slot, x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0           # differentiable in the pseudo-word


def test_training_loss_falls_and_the_inverted_token_reconstructs_its_image(towers, gallery, trained):
    assert trained.steps == 120 and trained.resumed_from == 0 and not trained.stopped
    assert trained.final_loss < trained.first_loss - 0.3, (trained.first_loss, trained.final_loss)
    assert trained.curve[-1][1] < trained.curve[0][1]
    img = torch.from_numpy(gallery.astype(np.float32))
    mapping = load_mapping(trained.state, {"mapping": {"embed_dim": 64, "token_width": 64, "hidden": 128,
                                                       "layers": 2, "dropout": 0.1}})
    learned = (encode_prompts(towers, mapping, img, [TRAIN_PROMPT] * len(img)) * img).sum(-1).mean()
    # random tokens: real vocabulary words in place of *, and Gaussian pseudo-words of the same scale
    vocab = torch.randint(300, 40000, (len(img),), generator=torch.Generator().manual_seed(1))
    tokens = towers.tokenize([TRAIN_PROMPT] * len(img))[0]
    slot = slots_of(tokens, placeholder_id(towers.tokenizer))
    emb_w = towers.model.token_embedding.weight
    gauss = torch.randn(len(img), emb_w.shape[1], generator=torch.Generator().manual_seed(2)) * emb_w.std()
    with torch.no_grad():
        for rnd in (emb_w[vocab], gauss):
            txt = torch.nn.functional.normalize(encode_with_slot(towers.model, tokens, slot, rnd), dim=-1)
            baseline = (txt * img).sum(-1).mean()
            assert learned > baseline + 0.1, (float(learned), float(baseline))


def test_first_and_last_loss_are_means_over_a_window_of_the_whole_run(towers, gallery, tmp_path):
    from engine.retrieval.pic2word import loss_window

    assert [loss_window(n) for n in (1, 9, 20, 120, 1000)] == [1, 1, 2, 12, 20]
    short = train(towers, gallery, Pic2WordConfig(hidden=128, steps=20, batch_size=64, lr=1e-3, ckpt_every=100),
                  tmp_path, KEY, log=lambda m: None)
    assert short.loss_window == 2 and len(short.curve) == 20          # 20 steps: the curve holds each step
    assert short.first_loss == pytest.approx(np.mean([c[1] for c in short.curve[:2]]), abs=1e-4)
    assert short.final_loss == pytest.approx(np.mean([c[1] for c in short.curve[-2:]]), abs=1e-4)
    assert abs(short.first_loss - short.final_loss) > 1e-3          # a short run's ends differ


def test_training_is_seeded_and_resumes_from_its_last_checkpoint(towers, gallery, trained, tmp_path):
    again = train(towers, gallery, CFG, tmp_path / "a", KEY, log=lambda m: None)
    assert all(torch.equal(again.state[k], trained.state[k]) for k in trained.state)   # same seed, same weights
    other = train(towers, gallery, Pic2WordConfig(**{**CFG.__dict__, "seed": 1, "steps": 5}), tmp_path / "o",
                  KEY, log=lambda m: None)
    assert not torch.equal(other.state["out.weight"], again.state["out.weight"])
    logs = []
    with pytest.raises(Stopped):                                   # killed after 50 steps: checkpoint at 40
        train(towers, gallery, CFG, tmp_path / "k", KEY, stop_after=50, log=logs.append)
    resumed = train(towers, gallery, CFG, tmp_path / "k", KEY, log=logs.append)
    assert resumed.resumed_from == 40 and "resuming from the checkpoint at step 40 of 120" in logs[-1]
    assert all(torch.equal(resumed.state[k], trained.state[k]) for k in trained.state)
    assert resumed.final_loss == pytest.approx(trained.final_loss)
    assert resumed.first_loss == pytest.approx(trained.first_loss)   # the whole run's, resumed steps included
    with pytest.raises(Stopped):                                   # another key: starts over, said
        train(towers, gallery, CFG, tmp_path / "k", {"gallery": "other"}, stop_after=1, log=logs.append)
    assert "training starts over" in logs[-1]


def test_build_option_is_resumable_and_recorded(tmp_path, monkeypatch, capsys):
    d = tmp_path / "index"
    args = build_args(d, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu", *P2W_ARGS)
    assert cir_build.main(args, p2w_stop_after=50) == cir_build.STOPPED
    assert (d / ".build" / "pic2word" / "pic2word-state.pt").is_file() and not (d / "meta.json").exists()
    capsys.readouterr()
    assert cir_build.main(args) == 0
    err = capsys.readouterr().err
    assert "resuming: 6 of 6 chunks already built" in err and "resuming from the checkpoint at step 40" in err
    m = re.search(r"loss (\d+\.\d{3}) -> (\d+\.\d{3}) \(means of the first and last 12 of the run's 120 steps\)", err)
    assert m and float(m.group(1)) > float(m.group(2)), err[-2000:]
    meta = load_index(d).meta
    p = meta["pic2word"]
    assert p["steps"] == 120 and p["resumed_from_step"] == 40 and p["seed"] == 0 and p["config"]["lr"] == 1e-3
    assert p["final_loss"] < p["first_loss"] and p["data"] == "gallery image embeddings only"
    assert p["loss_window"] == 12 and round(p["first_loss"], 3) == float(m.group(1))
    assert meta["text_bank"]["count"] == 320 and meta["dba"] == {"n": 3, "alpha": 3.0}
    assert len(meta["gallery_mean"]) == 64 and meta["corpus"] == str(corpus().resolve())
    ref = load_index(p2w_index())                                  # the uninterrupted build (scripts/build.sh)
    from safetensors.numpy import load_file

    a, b = load_file(str(load_index(d).extra("pic2word"))), load_file(str(ref.extra("pic2word")))
    assert all(np.array_equal(a[k], b[k]) for k in a)              # killed + resumed == uninterrupted
    assert not (d / ".build").exists()


@pytest.mark.abi
def test_run_script_uses_the_mapping_end_to_end(tmp_path):
    idx = load_index(p2w_index())
    assert idx.meta["method"]["name"] == "pic2word"
    out, rep = tmp_path / "p2w.jsonl", tmp_path / "report.json"
    r = script("run.sh", "--index-dir", str(p2w_index()), "--queries", str(corpus() / "requests.jsonl"),
               "--output", str(out), "--report", str(rep))        # the method recorded at build time
    assert r.returncode == 0, r.stderr[-3000:]
    reqs = requests_of(corpus() / "requests.jsonl")
    check_abi(read_rows(out), reqs, idx.ids)
    report = json.loads(rep.read_text())
    assert report["method_label"] == "pic2word" and report["pic2word"]["steps"] == 120
    plain = tmp_path / "text.jsonl"
    r = script("run.sh", "--index-dir", str(p2w_index()), "--queries", str(corpus() / "requests.jsonl"),
               "--output", str(plain), "--method", "text-only")
    assert r.returncode == 0 and read_rows(plain) != read_rows(out)   # the pseudo-word changes the answers


def test_pic2word_needs_a_mapping(tmp_path, capsys):
    args = ["--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"), "--output",
            str(tmp_path / "o.jsonl"), "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu",
            "--method", "pic2word"]
    assert cir_run.main(args) == 2
    assert "has no mapping" in capsys.readouterr().err
    assert cir_build.main(build_args(tmp_path / "i", "--method", "pic2word")) == 2
    assert "--mapping pic2word" in capsys.readouterr().err


def test_learning_rate_warms_up_then_decays_and_is_a_function_of_the_step():
    from engine.retrieval.pic2word import lr_at

    total, base = 100, 1e-3
    warm = Pic2WordConfig(steps=total).warmup_steps(total)
    assert warm == 10 and Pic2WordConfig(warmup=0).warmup_steps(total) == 0
    lrs = [lr_at(s, total, warm, base) for s in range(total)]
    assert lrs[0] == pytest.approx(base / warm) and lrs[warm - 1] == pytest.approx(base)   # linear warm-up
    assert all(a < b for a, b in zip(lrs[:warm - 1], lrs[1:warm]))
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:])) and lrs[-1] < 0.01 * base   # cosine decay
    assert lr_at(0, total, 0, base) == pytest.approx(base)         # no warm-up: the peak from the first step


def test_the_gallery_text_bank_is_the_default_hubness_bank_with_its_self_matches_masked(tmp_path, capsys):
    idx = load_index(p2w_index())
    assert idx.meta["text_bank"]["rows"] == list(range(len(idx.ids)))   # 320 rows, each text's own image
    out, rep = tmp_path / "o.jsonl", tmp_path / "r.json"
    args = ["--index-dir", str(p2w_index()), "--queries", str(corpus() / "requests.jsonl"), "--output", str(out),
            "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu", "--report", str(rep)]
    capsys.readouterr()
    assert cir_run.main([*args, "--method", "slerp+qbnorm"]) == 0
    assert json.loads(rep.read_text())["bank"] == "320 gallery-derived texts"
    assert "not masked" not in capsys.readouterr().err
    check_abi(read_rows(out), requests_of(corpus() / "requests.jsonl"), idx.ids)
    # an index without a text bank: the default bank never falls back to the call's own requests
    plain = ["--index-dir", str(built_index()), *args[2:]]
    assert cir_run.main([*plain, "--method", "slerp+qbnorm", "--fresh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("scripts/run.sh: error: ") and "--mapping pic2word" in err and "bank=requests" in err


def test_a_searcher_answers_from_the_extras_it_verified_at_open_even_once_their_files_are_gone(tmp_path):
    """The mapping, text bank and DBA rows are read and verified once, when the index opens: a
    commit that switches the index afterwards (deleting those files) changes nothing for it."""
    import shutil

    import engine.retrieval

    copy = tmp_path / "index"
    shutil.copytree(p2w_index(), copy)
    reqs = requests_of(corpus() / "requests.jsonl")[:10]
    method = "pic2word+qbnorm+dba"
    want = engine.retrieval.open_index(p2w_index(), clip_dirs()["open_clip"], device="cpu").search_many(
        reqs, k=10, method=method)
    searcher = engine.retrieval.open_index(copy, clip_dirs()["open_clip"], device="cpu")
    gone = [copy / searcher.index.meta["files"][name] for name in ("pic2word", "text_bank", "dba")]
    for p in gone:
        p.unlink()
    got = searcher.search_many(reqs, k=10, method=method)
    assert [[r["image_id"] for r in row] for row in got] == [[r["image_id"] for r in row] for row in want]
    assert not any(p.exists() for p in gone)
