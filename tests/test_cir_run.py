"""scripts/run.sh: ABI invariants, flushed rows under a kill, resume, bad requests, methods,
model mismatch, and the scorer on the output."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cir_helpers import (
    REPO,
    built_index,
    check_abi,
    clip_dirs,
    corpus,
    full_run,
    killed_run,
    read_rows,
    requests_of,
    run_args,
    workspace,
)

from engine.retrieval.index import load_index
from engine.retrieval.jsonl import read_requests
from evaluator.cir import run as cir_run
from evaluator.cir.jsonl import resume_rows


@pytest.fixture(scope="module")
def ref_batch1():
    """An uninterrupted in-process run with one request per batch (the resume tests' reference)."""
    out = workspace() / "run-batch1.jsonl"
    if not out.exists():
        assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--batch-size", "1")) == 0
    return out


def test_run_script_end_to_end():
    rows = read_rows(full_run())
    reqs = requests_of(corpus() / "requests.jsonl")
    check_abi(rows, reqs, load_index(built_index()).ids)
    assert [r["query_id"] for r in rows] == [r["query_id"] for r in reqs]       # request order, types kept
    assert all(len(r["results"]) == 50 for r in rows)
    summary = json.loads((workspace() / "run.stderr").read_text().strip().splitlines()[-1].split("] ", 1)[1])
    assert summary["answered"] == 40 and summary["method"]["name"] == "slerp" and summary["queries_per_s"] > 0


@pytest.mark.abi
def test_scorer_reads_the_run_output():
    r = subprocess.run([sys.executable, "-m", "evaluator.score_retrieval", "--results", str(full_run()),
                        "--labels", str(corpus() / "labels.jsonl")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["missing"] == 0 and report["raw_sources"] == ["circo", "cirr"]
    assert 0.0 <= report["raw"] <= 1.0


@pytest.mark.abi
def test_killed_run_keeps_its_rows_and_resumes(ref_batch1, capsys):
    out = workspace() / "run-killed.jsonl"
    r = killed_run("--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
                   "--output", str(out), "--batch-size", "1", after=5)
    assert r.returncode == -9, r.stderr[-2000:]
    rows = read_rows(out)                                   # complete JSON rows, nothing torn
    assert len(rows) == 5
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--batch-size", "1")) == 0
    assert "5 rows kept" in capsys.readouterr().err
    assert out.read_bytes() == ref_batch1.read_bytes()


def test_torn_last_line_is_dropped_and_redone(ref_batch1, tmp_path, capsys):
    full = ref_batch1.read_bytes()
    lines = full.split(b"\n")
    out = tmp_path / "torn.jsonl"
    out.write_bytes(b"\n".join(lines[:7]) + b"\n" + lines[7][: len(lines[7]) // 2])
    _same_record(ref_batch1, out)
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--batch-size", "1")) == 0
    assert "dropping a torn last line" in capsys.readouterr().err
    assert out.read_bytes() == full


def _same_record(written, out) -> None:
    """`out` is resumed as if the call that wrote `written` had written it (same method and index)."""
    import shutil

    shutil.copy(f"{written}.run.json", f"{out}.run.json")


def _rows_by_query(path) -> dict[str, dict]:
    return {str(r["query_id"]): r for r in read_rows(path)}


def test_resume_revalidates_every_kept_row(ref_batch1, tmp_path, capsys):
    """An earlier output's rows stay only if they keep the output rules and answer a query of this
    file; every other row is dropped (said, naming its line) and answered again."""
    ref = read_rows(ref_batch1)
    ids = load_index(built_index()).ids
    reqs = {str(r["query_id"]): r for r in requests_of(corpus() / "requests.jsonl")}
    good = [json.dumps(r) for r in ref[:3]]

    def too_many(r):
        have = {str(x["image_id"]) for x in r["results"]} | {str(reqs[str(r["query_id"])].get("reference_image_id"))}
        extra = next(i for i in ids if str(i) not in have)
        r["results"].append({"image_id": extra, "score": r["results"][-1]["score"] - 1.0})

    def broken(i, how):
        row = json.loads(json.dumps(ref[i]))
        how(row)
        return json.dumps(row)

    lines = [
        good[0],                                                                        # 1 kept
        broken(3, lambda r: r["results"].__setitem__(1, dict(r["results"][0]))),      # 2 duplicate id
        broken(4, lambda r: r["results"].reverse()),                                    # 3 rising scores
        broken(5, lambda r: r["results"][0].__setitem__(
            "image_id", reqs[str(r["query_id"])]["reference_image_id"])),              # 4 the reference
        broken(6, lambda r: r["results"][0].__setitem__("image_id", "no-such-image")),  # 5 not in the gallery
        json.dumps({"query_id": "stranger", "results": []}),                            # 6 not in the file
        good[1],                                                                        # 7 kept
        good[0],                                                                        # 8 second row for a query
        broken(7, lambda r: r.__setitem__("query_id", str(r["query_id"]) + "x")),       # 9 unknown query
        broken(8, too_many),                                                            # 10 51 results
        good[2],                                                                        # 11 kept
    ]
    out = tmp_path / "resumed.jsonl"
    out.write_text("\n".join(lines) + "\n")
    _same_record(ref_batch1, out)
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--batch-size", "1")) == 0
    err = capsys.readouterr().err
    for line, what in [(2, "appears twice"), (3, "scores rise"), (4, "the reference image"),
                       (5, "not a gallery image id"), (6, "not in the requests"), (8, "a second row"),
                       (9, "not in the requests"), (10, "at most 50")]:
        assert any(f"resumed.jsonl:{line}: dropping an earlier row" in e and what in e for e in err.splitlines()), \
            (line, what, err[-3000:])
    assert "3 rows kept" in err
    rows = read_rows(out)
    check_abi(rows, requests_of(corpus() / "requests.jsonl"), ids)
    assert [r["query_id"] for r in rows[:3]] == [r["query_id"] for r in ref[:3]]   # kept rows first, in order
    assert _rows_by_query(out) == _rows_by_query(ref_batch1)                       # and the same answers


def test_resume_keeps_a_valid_prefix_by_truncating(ref_batch1, tmp_path):
    ids = load_index(built_index()).ids
    reqs = read_requests(corpus() / "requests.jsonl", lambda m: None)
    data = ref_batch1.read_bytes()
    p = tmp_path / "o.jsonl"
    p.write_bytes(data[: data.index(b"\n", len(data) // 2) + 1] + b'{"query_id": ')
    msgs = []
    kept = resume_rows(p, reqs, {str(i): i for i in ids}, 50, msgs.append)
    assert kept.prefix and b"".join(kept.rows) == data[: len(b"".join(kept.rows))]
    assert "dropping a torn last line" in msgs[-1] and len(kept.done) == len(kept.rows) > 0
    p.write_bytes(b"\n\n" + data)                          # blank lines first: rows kept, not a prefix
    kept = resume_rows(p, reqs, {str(i): i for i in ids}, 50, msgs.append)
    assert not kept.prefix and len(kept.rows) == 40


def test_a_deeply_nested_request_is_one_bad_line_not_a_failed_call(tmp_path, capsys):
    ids = load_index(built_index()).ids
    req = tmp_path / "deep.jsonl"
    deep = "[" * 1000 + "]" * 1000
    req.write_text("\ufeff" + json.dumps({"query_id": "first", "reference_image_id": ids[1], "modification": "red"})
                   + "\n" + '{"query_id": "deep", "ignored": ' + deep + ', "modification": "x"}\n'
                   + json.dumps({"query_id": "last", "reference_image_id": ids[2], "modification": "blue"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cir_run.main(run_args(req, out)) == 0
    err = capsys.readouterr().err
    assert any("deep.jsonl:2: malformed JSON (nested deeper than 64 levels)" in e for e in err.splitlines()), err
    assert [r["query_id"] for r in read_rows(out)] == ["first", "last"]      # the BOM did not hide the first


def test_one_long_word_is_tokenised_in_bounded_time():
    from engine.clip.load import load_clip
    from engine.clip.towers import MAX_WORD_CHARS, ClipTowers

    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    towers = ClipTowers(model, spec, "cpu", "fp32")
    rng = np.random.default_rng(0)
    word = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 20_000))
    t0 = __import__("time").perf_counter()
    tokens, cut = towers.tokenize([word, "make it red", "x " * 5000])
    assert __import__("time").perf_counter() - t0 < 2.0
    assert cut == [True, False, True] and tokens.shape == (3, spec.context_length)
    tok = towers.tokenizer
    ref = tok.encode(word[:MAX_WORD_CHARS])                 # a word at the cap: exactly the reference tokens
    assert tokens[0, 1:len(ref) + 1].tolist()[: spec.context_length - 2] == ref[: spec.context_length - 2]
    assert tokens[1, 1:tokens[1].argmax()].tolist() == tok.encode("make it red")


def test_bad_requests_each_get_a_line_and_never_stop_the_call(tmp_path, capsys):
    ids = load_index(built_index()).ids
    ok_ref = ids[10]
    req = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"query_id": "good", "reference_image_id": ok_ref, "modification": "make it red"}),   # 1
        json.dumps({"query_id": "noref", "reference_image_id": "no-such-image", "modification": "blue"}),  # 2
        json.dumps({"query_id": "empty", "reference_image_id": ok_ref, "modification": ""}),               # 3
        json.dumps({"query_id": "huge", "reference_image_id": ok_ref, "modification": "very " * 20000}),   # 4
        None,                                                                                               # 5
        '{"query_id": "torn", "reference_image_id": ',                                                      # 6
        json.dumps({"query_id": "good", "reference_image_id": ok_ref, "modification": "again"}),          # 7
        json.dumps({"query_id": "unreadable", "reference_image_id": "broken-0", "modification": "x"}),     # 8
        "[1, 2]",                                                                                           # 9
        json.dumps({"reference_image_id": ok_ref, "modification": "no id"}),                              # 10
        json.dumps({"query_id": 7, "reference_image_id": ok_ref, "modification": "red",
                    "shared_concept": "a pattern"}),                                                        # 11
    ]
    raw = [line.encode() if line is not None else
           b'{"query_id": "utf8", "reference_image_id": "' + str(ok_ref).encode() + b'", "modification": "caf\xff"}'
           for line in lines]
    req.write_bytes(b"\n".join(raw) + b"\n")
    out = tmp_path / "out.jsonl"
    assert cir_run.main(run_args(req, out)) == 0
    err = capsys.readouterr().err
    for line, what in [(2, "is not in the index"), (3, "empty modification"), (4, "truncated"),
                       (5, "not valid UTF-8"), (6, "malformed JSON"), (7, "duplicate query_id"),
                       (8, "was unreadable at build time"), (9, "expected a JSON object"), (10, "no usable query_id")]:
        assert any(f"bad.jsonl:{line}: " in e and what in e for e in err.splitlines()), (line, what, err)
    rows = read_rows(out)
    assert [r["query_id"] for r in rows] == ["good", "noref", "empty", "huge", "utf8", "unreadable", 7]
    valid = [{"query_id": q, "reference_image_id": ref} for q, ref in
             [("good", ok_ref), ("noref", "no-such-image"), ("empty", ok_ref), ("huge", ok_ref), ("utf8", ok_ref),
              ("unreadable", "broken-0"), (7, ok_ref)]]
    check_abi(rows, valid, ids)
    # the reference-less request was answered from its text alone: the same list text-only gives
    text_only = tmp_path / "text.jsonl"
    req2 = tmp_path / "one.jsonl"
    req2.write_text(json.dumps({"query_id": "noref", "reference_image_id": "no-such-image",
                                "modification": "blue"}) + "\n")
    assert cir_run.main(run_args(req2, text_only, "--method", "text-only")) == 0
    alone = read_rows(text_only)[0]["results"]          # batch of 1 vs 7: float noise only
    assert [r["image_id"] for r in alone] == [r["image_id"] for r in rows[1]["results"]]
    assert np.allclose([r["score"] for r in alone], [r["score"] for r in rows[1]["results"]], atol=1e-5)


def test_methods_and_reference_exclusion(tmp_path, monkeypatch):
    idx = load_index(built_index())
    emb = np.asarray(idx.emb, np.float32)
    reqs = requests_of(corpus() / "requests.jsonl")
    outs = {}
    for name in ("sum", "text-only"):
        monkeypatch.setenv("CIR_METHOD", name)
        out = tmp_path / f"{name}.jsonl"
        assert cir_run.main(run_args(corpus() / "requests.jsonl", out)) == 0
        outs[name] = read_rows(out)
        check_abi(outs[name], reqs, idx.ids)
    monkeypatch.delenv("CIR_METHOD")
    assert outs["sum"] != outs["text-only"] != read_rows(full_run())
    # text weight 0: the query IS the reference; the nearest other image must come first
    out = tmp_path / "image.jsonl"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--text-weight", "0")) == 0
    rows = {str(r["query_id"]): r for r in read_rows(out)}
    pos = {str(i): n for n, i in enumerate(idx.ids)}
    for req in reqs[:10]:
        ref = pos[str(req["reference_image_id"])]
        sims = emb @ emb[ref]
        sims[ref] = -np.inf
        top = rows[str(req["query_id"])]["results"][0]
        assert str(top["image_id"]) == str(idx.ids[int(np.argmax(sims))])
        assert abs(top["score"] - sims.max()) < 1e-2


def test_model_mismatch_is_refused(tmp_path, capsys):
    from evaluator.synthetic.cir_corpus import write_tiny_clip

    other = write_tiny_clip(tmp_path / "other", seed=1)["open_clip"]
    args = run_args(corpus() / "requests.jsonl", tmp_path / "o.jsonl")
    args[args.index("--model-dir") + 1] = str(other)
    assert cir_run.main(args) == 2
    assert "is not the one that built the index" in capsys.readouterr().err
    assert cir_run.main([*args, "--allow-model-mismatch"]) == 0


def test_run_errors_are_clear(tmp_path, capsys):
    assert cir_run.main(["--index-dir", str(tmp_path), "--queries", str(corpus() / "requests.jsonl"),
                         "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "meta.json is missing" in capsys.readouterr().err
    assert cir_run.main(run_args(tmp_path / "none.jsonl", tmp_path / "o.jsonl")) == 2
    assert "none.jsonl" in capsys.readouterr().err


def _one_error_line(err: str, needle: str) -> None:
    lines = [e for e in err.splitlines() if "error:" in e]
    assert len(lines) == 1 and needle in lines[0], err[-3000:]
    assert "Traceback" not in err


def test_malformed_index_and_model_files_are_one_line_and_exit_2(tmp_path, capsys):
    index = tmp_path / "index"
    shutil.copytree(built_index(), index)
    args = run_args(corpus() / "requests.jsonl", tmp_path / "o.jsonl")
    args[args.index("--index-dir") + 1] = str(index)
    meta = (index / "meta.json").read_text()
    for text, needle in [("[]", "a JSON list, not an index record"), ("{", "unreadable"),
                         (meta.replace('"ids-', '"../ids-', 1), "plain file names"),
                         (json.dumps({**json.loads(meta), "count": "many"}), "malformed")]:
        (index / "meta.json").write_text(text)
        assert cir_run.main(args) == 2
        _one_error_line(capsys.readouterr().err, needle)
    (index / "meta.json").write_text(meta)
    emb = next(index.glob("embeddings-*.npy"))
    emb.write_bytes(emb.read_bytes()[:100])                              # truncated embeddings
    assert cir_run.main(args) == 2
    _one_error_line(capsys.readouterr().err, "unreadable")
    clip = tmp_path / "clip"
    shutil.copytree(clip_dirs()["open_clip"], clip)
    weights = next(p for p in clip.iterdir() if p.name.startswith("open_clip_") and "config" not in p.name)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])   # truncated CLIP weights
    args = run_args(corpus() / "requests.jsonl", tmp_path / "o.jsonl")
    args[args.index("--model-dir") + 1] = str(clip)
    assert cir_run.main(args) == 2
    _one_error_line(capsys.readouterr().err, "cannot")
    shutil.rmtree(clip)
    shutil.copytree(clip_dirs()["open_clip"], clip)
    (clip / "open_clip_config.json").write_text("[1, 2]")
    assert cir_run.main(args) == 2
    _one_error_line(capsys.readouterr().err, "not a config object")


def test_output_folder_problems_and_tmpdir_are_one_line(tmp_path, capsys, monkeypatch):
    assert cir_run.main(run_args(corpus() / "requests.jsonl", tmp_path)) == 2        # the output is a directory
    _one_error_line(capsys.readouterr().err, "is a directory")
    assert cir_run.main(run_args(corpus() / "requests.jsonl", tmp_path / "no" / "o.jsonl")) == 2
    _one_error_line(capsys.readouterr().err, "does not exist")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("TMPDIR", str(not_a_dir))
    assert cir_run.main(run_args(corpus() / "requests.jsonl", tmp_path / "o.jsonl")) == 2
    _one_error_line(capsys.readouterr().err, "TMPDIR")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.abi
def test_a_fifo_as_the_queries_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "q.jsonl"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "evaluator.cir.run", *run_args(fifo, tmp_path / "o.jsonl")],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "a FIFO, not a regular file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.abi
def test_a_broken_stderr_does_not_fail_the_call(tmp_path):
    out = tmp_path / "o.jsonl"
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "evaluator.cir.run", *run_args(corpus() / "requests.jsonl", out)],
                           stdout=subprocess.DEVNULL, stderr=full, cwd=REPO, timeout=300)
    assert r.returncode == 0
    assert _rows_by_query(out) == _rows_by_query(full_run())


@pytest.mark.gpu
def test_cuda_run_keeps_the_abi(tmp_path):
    out = tmp_path / "gpu.jsonl"
    args = run_args(corpus() / "requests.jsonl", out)
    args[args.index("--device") + 1] = "cuda"
    assert cir_run.main(args) == 0
    check_abi(read_rows(out), requests_of(corpus() / "requests.jsonl"), load_index(built_index()).ids)
    assert [r["query_id"] for r in read_rows(out)] == [r["query_id"] for r in read_rows(full_run())]
