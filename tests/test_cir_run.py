"""scripts/run.sh: ABI invariants, flushed rows under a kill, resume, bad requests, methods,
model mismatch, and the scorer on the output."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from cir_helpers import (
    REPO,
    built_index,
    check_abi,
    corpus,
    full_run,
    killed_run,
    read_rows,
    requests_of,
    run_args,
    workspace,
)

from evaluator.cir import run as cir_run
from evaluator.cir.index import load_index
from evaluator.cir.jsonl import finished_rows


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


def test_scorer_reads_the_run_output():
    r = subprocess.run([sys.executable, "-m", "evaluator.score_retrieval", "--results", str(full_run()),
                        "--labels", str(corpus() / "labels.jsonl")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["missing"] == 0 and report["raw_sources"] == ["circo", "cirr"]
    assert 0.0 <= report["raw"] <= 1.0


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
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--batch-size", "1")) == 0
    assert "dropping a torn last line" in capsys.readouterr().err
    assert out.read_bytes() == full


def test_valid_prefix_ends_at_the_first_bad_row(tmp_path):
    p = tmp_path / "o.jsonl"
    good = json.dumps({"query_id": 1, "results": [{"image_id": "a", "score": 0.5}]})
    p.write_text(good + "\n" + '{"query_id": 2, "results": [{"image_id": "a", "score": NaN}]}\n' + good + "\n")
    msgs = []
    done, end = finished_rows(p, msgs.append)
    assert done == ["1"] and end == len(good) + 1 and "o.jsonl:2" in msgs[0]


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


@pytest.mark.gpu
def test_cuda_run_keeps_the_abi(tmp_path):
    out = tmp_path / "gpu.jsonl"
    args = run_args(corpus() / "requests.jsonl", out)
    args[args.index("--device") + 1] = "cuda"
    assert cir_run.main(args) == 0
    check_abi(read_rows(out), requests_of(corpus() / "requests.jsonl"), load_index(built_index()).ids)
    assert [r["query_id"] for r in read_rows(out)] == [r["query_id"] for r in read_rows(full_run())]
