"""Compiled CLIP towers (engine.clip.compiled, engine.clip.tune): measured and verified at index
build, recorded in meta.json, loaded (never compiled) by the query run; a disagreeing candidate
is refused. The AOT build compiles the tiny CLIP's two towers once (~40 s on two cores)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from cir_helpers import REPO, build_args, clip_dirs, corpus, requests_of, workspace

from engine import settings
from engine.classify.artifact import sample_sha256
from engine.clip import compiled as C
from engine.clip import tune
from engine.clip.load import load_clip
from engine.clip.towers import ClipTowers
from engine.io import sha256_file
from engine.retrieval.index import load_index
from engine.retrieval.jsonl import read_records

pytestmark = pytest.mark.abi   # index builds that compile and measure the CLIP towers (~40 s)

# the tests' preset: one static batch, FP32 only, a 64-image sample (the CPU preset measures more)
SMALL = tune.Preset(backends=("aot",), batches=(16,), precisions=("fp32",), sample=64, queries=16, rounds=1)


def _build(index_dir, monkeypatch, preset=SMALL, mode="auto"):
    from evaluator.cir import build as cir_build

    monkeypatch.setenv("CLIP_TOWERS", mode)
    monkeypatch.setitem(tune.PRESETS, "cpu", preset)
    settings.reload()
    try:
        rc = cir_build.main(build_args(index_dir, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu"))
    finally:
        settings.reload()
    assert rc == 0
    return load_index(index_dir)


@functools.cache
def _aot_index():
    """The index built with CLIP_TOWERS=auto and the aot-only preset: both towers compiled."""
    mp = pytest.MonkeyPatch()
    try:
        return _build(workspace() / "index-towers-aot", mp)
    finally:
        mp.undo()


def _tiny():
    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    return model, spec


def _sample_images(n=48):
    """The corpus's first gallery images, resized to the tower's side: uint8 [n, S, S, 3]."""
    from PIL import Image

    _, spec = _tiny()
    side = spec.image.input_size
    files = sorted((corpus() / "images").rglob("*.jpg"))[:n]
    return torch.as_tensor(np.stack([np.asarray(Image.open(p).convert("RGB").resize((side, side))) for p in files]))


def _noflag(monkeypatch):
    """Every compiler entry point raises: what runs after this compiles nothing."""
    def refuse(*a, **k):
        raise AssertionError("the compiler was called")
    monkeypatch.setattr(torch.export, "export", refuse)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    monkeypatch.setattr(torch._inductor, "aot_compile", refuse)
    monkeypatch.setattr(torch, "compile", refuse)


def test_build_records_the_measured_table_and_choice():
    idx = _aot_index()
    rec = idx.meta["towers"]
    assert rec["mode"] == "auto" and rec["device"] == "cpu" and rec["reference"] == {"backend": "eager",
                                                                                     "precision": "fp32"}
    assert idx.meta["build_key"]["towers"] == "auto"
    for tower in ("image", "text"):
        (row,) = rec[tower]["table"]
        assert row["candidate"] == f"{tower}-aot-fp32-b16" and row["status"] == "ok"
        assert row["per_s"] > 0 and row["cos_min"] >= tune.COS_MIN and row["top50_equal"] is True
        ch = rec[tower]["choice"]
        assert ch == {**ch, "backend": "aot", "precision": "fp32", "batch": 16, "fallback": False}
        folder = idx.dir / rec["dir"] / tower
        assert set(ch["files"]) == {p.name for p in folder.iterdir()} and "model.so" in ch["files"]
        assert all(sha256_file(folder / n) == d["sha256"] and sample_sha256(folder / n) == d["sample_sha256"]
                   and (folder / n).stat().st_size == d["bytes"] for n, d in ch["files"].items())
    first = [r.image_id for r in read_records(corpus() / "records.jsonl", print)[:64]]
    readable = [i for i in first if not str(i).startswith("broken")]      # the sample: its readable images
    assert rec["verify"]["sample_images"] == len(readable) < 64 and rec["verify"]["top"] == 50
    assert [p.name for p in idx.dir.glob("towers-*")] == [rec["dir"]]   # nothing else left behind


def test_compiled_towers_agree_with_eager_fp32(monkeypatch):
    idx = _aot_index()
    model, spec = _tiny()
    base = ClipTowers(model, spec, "cpu", "fp32")
    _noflag(monkeypatch)
    towers = tune.load_recorded(base, idx.dir, idx.meta["towers"], print)
    assert isinstance(towers, C.CompiledTowers) and towers.image_fn is not None and towers.text_fn is not None
    imgs = _sample_images()
    got, want = towers.encode_images(imgs), base.encode_images(imgs)          # 48 rows: 3 static batches
    assert got.shape == want.shape and float((got * want).sum(1).min()) >= 0.999
    q = slice(0, 8)
    assert torch.equal((got[q] @ got.T).topk(20).indices, (want[q] @ want.T).topk(20).indices)
    texts = list(tune.PROMPTS)
    gt, wt = towers.encode_texts(texts), base.encode_texts(texts)
    assert float((gt * wt).sum(1).min()) >= 0.999
    assert torch.equal((gt @ want.T).topk(20).indices, (wt @ want.T).topk(20).indices)


def test_long_prompt_runs_the_eager_text_tower(capsys):
    idx = _aot_index()
    model, spec = _tiny()
    base = ClipTowers(model, spec, "cpu", "fp32")
    towers = tune.load_recorded(base, idx.dir, idx.meta["towers"], print)
    long = " ".join(["red stripes"] * 30)                     # ~60 tokens: past the graph's 32
    got, want = towers.encode_texts([long, "a dog"]), base.encode_texts([long, "a dog"])
    assert torch.allclose(got, want, atol=1e-5)
    assert "longer than the compiled text tower's 32 tokens" in capsys.readouterr().err


def test_query_run_loads_the_recorded_towers_without_compiling(monkeypatch, capsys):
    import engine.retrieval

    idx = _aot_index()
    reqs = requests_of(corpus() / "requests.jsonl")[:12]
    _noflag(monkeypatch)
    searcher = engine.retrieval.open_index(idx.dir, clip_dirs()["open_clip"], device="cpu")
    assert isinstance(searcher.towers, C.CompiledTowers)
    calls = {"image": 0, "text": 0}
    for tower in calls:
        fn = getattr(searcher.towers, f"{tower}_fn")
        monkeypatch.setattr(fn, "fn", _counting(fn.fn, calls, tower))
    rows = searcher.search_many(reqs, k=10, method="slerp")
    assert calls["text"] > 0                                   # the recorded text graph answered
    monkeypatch.setenv("CLIP_TOWERS", "eager")                  # the off switch: eager towers
    settings.reload()
    try:
        plain = engine.retrieval.open_index(idx.dir, clip_dirs()["open_clip"], device="cpu")
    finally:
        settings.reload()
    assert type(plain.towers) is ClipTowers
    ref = plain.search_many(reqs, k=10, method="slerp")
    assert [[r["image_id"] for r in row[:3]] for row in rows] == [[r["image_id"] for r in row[:3]] for row in ref]


def _counting(fn, calls, key):
    def wrapped(x):
        calls[key] += 1
        return fn(x)
    return wrapped


class _Planted(tune.Candidate):
    """A candidate whose rows are the eager ones pushed off by a fixed random direction."""

    def build(self, model, spec, device, work):
        fn, files = tune.Candidate(self.tower, "eager", self.precision, self.batch).build(model, spec, device, work)
        g = torch.Generator().manual_seed(0)

        def perturbed(x):
            y = fn.fn(x)
            return torch.nn.functional.normalize(y + 0.2 * torch.randn(y.shape, generator=g), dim=-1)
        return C.Static(perturbed, self.batch), files


class _Broken(tune.Candidate):
    def build(self, model, spec, device, work):
        raise RuntimeError("this candidate cannot build here")


def test_planted_disagreeing_tower_is_refused_and_the_build_falls_back(tmp_path, monkeypatch, capsys):
    def cands(tower, device, preset):
        real = tune.Candidate(tower, "eager", "fp32", 16)
        return [_Planted(tower, "eager", "fp32", 16), _Broken(tower, "aot", "fp32", 32)] if tower == "image" \
            else [real]
    monkeypatch.setattr(tune, "candidates", cands)
    preset = tune.Preset(backends=("eager",), batches=(16,), precisions=("fp32",), sample=48, queries=16, rounds=1)
    idx = _build(tmp_path / "index", monkeypatch, preset)
    rec = idx.meta["towers"]
    row, broken = rec["image"]["table"]
    assert row["status"].startswith("refused") and row["cos_min"] < tune.COS_MIN
    assert broken["status"] == "failed: RuntimeError: this candidate cannot build here"
    assert rec["image"]["choice"] == {"backend": "eager", "precision": "fp32", "batch": 16, "fallback": True}
    assert rec["text"]["choice"]["fallback"] is False and rec["text"]["table"][0]["status"] == "ok"
    err = capsys.readouterr().err
    assert sum("no candidate agrees with the FP32 eager reference" in ln for ln in err.splitlines()) == 1
    assert not list(idx.dir.glob("towers-*"))                   # no compiled file chosen
    # the off switch: eager towers, no record of a choice; the fallback's rows are theirs
    plain = _build(tmp_path / "plain", monkeypatch, mode="eager")
    assert plain.meta["towers"] == {"mode": "eager"} and "towers" not in plain.meta["build_key"]
    assert plain.ids == idx.ids and np.abs(plain.emb.astype(np.float32) - idx.emb.astype(np.float32)).max() < 2e-3
    model, spec = _tiny()
    base = ClipTowers(model, spec, "cpu", "fp32")
    assert tune.load_recorded(base, plain.dir, plain.meta["towers"], print) is base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_towers_are_measured_graphed_and_agree(tmp_path):
    """On CUDA: every candidate (eager/aot x native precisions) runs from a CUDA graph, is
    measured and verified; the chosen towers agree with eager FP32."""
    model, spec = _tiny()
    base = ClipTowers(model, spec, "cuda", "fp32")
    imgs = _sample_images(64)
    preset = tune.Preset(batches=(16,), sample=64, queries=16, rounds=2)
    towers, rec = tune.tune(base, imgs, tmp_path / "towers-x", print, preset)
    assert rec["device"] == "cuda" and len(rec["image"]["table"]) >= 4
    assert all("per_s" in row for row in rec["image"]["table"] + rec["text"]["table"])
    got, want = towers.encode_images(imgs), base.encode_images(imgs)
    assert float((got * want).sum(1).min()) >= 0.999
    loaded = tune.load_recorded(base, tmp_path, rec, print)
    assert torch.equal(loaded.encode_images(imgs).topk(5).indices, got.topk(5).indices)


def test_a_resumed_build_keeps_its_recorded_towers(tmp_path, monkeypatch, capsys):
    from evaluator.cir import build as cir_build

    preset = tune.Preset(backends=("eager",), batches=(16,), precisions=("fp32",), sample=32, queries=8, rounds=1)
    monkeypatch.setenv("CLIP_TOWERS", "auto")
    monkeypatch.setitem(tune.PRESETS, "cpu", preset)
    settings.reload()
    args = build_args(tmp_path / "index", "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu")
    try:
        assert cir_build.main(args, stop_after_chunks=2) != 0             # stopped, resumable
        first = tune.read_resume(tmp_path / "index" / ".build")
        assert first["image"]["choice"]["backend"] == "eager"

        def refuse(*a, **k):
            raise AssertionError("measured again")
        monkeypatch.setattr(tune, "tune", refuse)
        assert cir_build.main(args) == 0
    finally:
        settings.reload()
    assert load_index(tmp_path / "index").meta["towers"] == first
    assert "towers: the resumed build's choice" in capsys.readouterr().err


def test_a_resume_whose_recorded_towers_cannot_load_rebuilds_their_chunks(tmp_path, monkeypatch, capsys):
    """Resumed where the recorded towers cannot run (here: chosen on another device kind), the
    build measures again and rebuilds the chunks the old towers embedded: one choice per index."""
    import json

    from evaluator.cir import build as cir_build

    preset = tune.Preset(backends=("eager",), batches=(16,), precisions=("fp32",), sample=32, queries=8, rounds=1)
    monkeypatch.setenv("CLIP_TOWERS", "auto")
    monkeypatch.setitem(tune.PRESETS, "cpu", preset)
    settings.reload()
    args = build_args(tmp_path / "index", "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu")
    record = tmp_path / "index" / ".build" / tune.RECORD
    try:
        assert cir_build.main(args, stop_after_chunks=2) != 0             # stopped with 2 chunks built
        record.write_text(json.dumps({**json.loads(record.read_text()), "device": "cuda"}))
        capsys.readouterr()
        assert cir_build.main(args) == 0
    finally:
        settings.reload()
    err = capsys.readouterr().err
    assert "chosen on cuda, this run is on cpu" in err
    assert "rebuilding 2 of" in err and "towers are measured again" in err and "resuming:" not in err
    assert err.count("towers: measuring the candidates") == 1
    meta = load_index(tmp_path / "index").meta
    assert meta["towers"]["device"] == "cpu" and meta["timing"]["resumed_chunks"] == 0


@pytest.mark.parametrize("mode", ["quick", "size", "sha256"])
def test_recorded_tower_files_are_fully_hashed_in_every_mode(tmp_path, monkeypatch, mode):
    """A tower file carries weights: whatever ENGINE_ARTIFACT_VERIFY says, a size change, a flip in
    a sampled block and a flip between the sampled blocks all fail the load's check; an index
    recorded before the sampled digests gets the same full check."""
    folder = tmp_path / "image"
    folder.mkdir()
    data = bytes(np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8))   # 3 MiB: gaps between samples
    (folder / "model.so").write_bytes(data)
    (folder / "small.bin").write_bytes(b"x" * 1000)
    files = tune.file_record(folder)
    monkeypatch.setenv("ENGINE_ARTIFACT_VERIFY", mode)
    settings.reload()
    try:
        tune.check_recorded_files(folder, files)                          # intact: passes

        def flipped(at: int) -> bool:
            b = bytearray(data)
            b[at] ^= 0xFF
            (folder / "model.so").write_bytes(bytes(b))
            try:
                tune.check_recorded_files(folder, files)
                return False
            except ValueError as e:
                assert "model.so" in str(e)
                return True
            finally:
                (folder / "model.so").write_bytes(data)

        assert flipped(0)                                                 # in the first sampled block
        assert flipped(100_000)                                           # between the first two samples
        (folder / "small.bin").write_bytes(b"x" * 999)
        with pytest.raises(ValueError, match="small.bin has 999 bytes"):
            tune.check_recorded_files(folder, files)
        (folder / "small.bin").write_bytes(b"y" * 1000)
        old = {n: d["sha256"] for n, d in files.items()}                  # the earlier record: name -> sha256
        with pytest.raises(ValueError, match="small.bin: sha256 differs"):
            tune.check_recorded_files(folder, old)
    finally:
        settings.reload()


def test_a_damaged_tower_file_falls_back_to_eager_towers_in_one_line(tmp_path, monkeypatch, capsys):
    import shutil

    import engine.retrieval

    idx = _aot_index()
    copy = tmp_path / "index"
    shutil.copytree(idx.dir, copy)
    so = copy / idx.meta["towers"]["dir"] / "text" / "model.so"
    with open(so, "r+b") as f:                                           # same size, first block changed
        first = f.read(16)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in first))
    _noflag(monkeypatch)
    capsys.readouterr()
    searcher = engine.retrieval.open_index(copy, clip_dirs()["open_clip"], device="cpu")
    assert type(searcher.towers) is ClipTowers
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "tower is unusable" in ln]
    assert len(lines) == 1 and "text tower" in lines[0] and "model.so" in lines[0] and "eager towers" in lines[0], err


def _sampled_starts(size: int) -> list[int]:
    """Where engine.classify.artifact.sample_sha256 reads its blocks in a file of `size` bytes."""
    from engine.classify.artifact import SAMPLE_BLOCKS, SAMPLE_BYTES

    span = max(size - SAMPLE_BYTES, 0)
    return [span * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)]


def _damage_a_used_embedding_row(so, model, towers, texts) -> int:
    """Negate, in the compiled text tower's .so, the token-embedding row (fp32 [width], 256 bytes
    for the tiny CLIP) of the commonest token of `texts` that lies between the sampled blocks.
    Returns its offset."""
    from collections import Counter

    from engine.classify.artifact import SAMPLE_BYTES

    data = bytearray(so.read_bytes())
    starts = _sampled_starts(len(data))
    tokens = towers.tokenize(texts)[0]
    tok_ids = towers.tokenizer.sot_token_id, towers.tokenizer.eot_token_id, 0
    emb = model.token_embedding.weight.detach().float()
    for tok, _ in Counter(int(t) for t in tokens.flatten() if int(t) not in tok_ids).most_common():
        row = emb[tok].numpy().tobytes()
        at = data.find(row)
        if at >= 0 and not any(s - len(row) < at < s + SAMPLE_BYTES for s in starts):
            data[at:at + len(row)] = (-emb[tok]).numpy().tobytes()
            so.write_bytes(bytes(data))
            return at
    raise AssertionError("no used embedding row of the text tower lies between the sampled blocks")


def test_a_tower_row_damaged_between_the_sampled_blocks_runs_the_eager_towers(tmp_path):
    """One 256-byte token-embedding row of the compiled text tower replaced where no sampled block
    reads, under the default ENGINE_ARTIFACT_VERIFY: the query run says so in one line naming the
    file and answers exactly as with eager towers (CLIP_TOWERS=eager), not from the damaged tower."""
    import json
    import shutil

    from cir_helpers import read_rows, script

    idx = _aot_index()
    copy = tmp_path / "index"
    shutil.copytree(idx.dir, copy)
    so = copy / idx.meta["towers"]["dir"] / "text" / "model.so"
    recorded = idx.meta["towers"]["text"]["choice"]["files"]["model.so"]
    model, spec = _tiny()
    queries = corpus() / "requests.jsonl"
    texts = [r["modification"] for r in requests_of(queries)]
    _damage_a_used_embedding_row(so, model, ClipTowers(model, spec, "cpu", "fp32"), texts)
    assert sample_sha256(so) == recorded["sample_sha256"] and sha256_file(so) != recorded["sha256"]
    runs = {}
    for name, extra in (("damaged", {}), ("eager", {"CLIP_TOWERS": "eager"})):
        out = tmp_path / f"{name}.jsonl"
        r = script("run.sh", "--index-dir", str(copy), "--queries", str(queries), "--output", str(out),
                   env={"ENGINE_ARTIFACT_VERIFY": "", "PYTHONPATH": str(REPO), **extra})   # "": the default
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (read_rows(out), r.stderr)
    lines = [ln for ln in runs["damaged"][1].splitlines() if "tower is unusable" in ln]
    assert len(lines) == 1 and "text tower" in lines[0] and str(so) in lines[0] and "eager towers" in lines[0], \
        runs["damaged"][1][-3000:]
    assert "SHA-256" in lines[0]
    assert json.dumps(runs["damaged"][0]) == json.dumps(runs["eager"][0])
