"""Gallery-aware options through scripts/run.sh's code: every option keeps the ABI and says what
it used; bank statistics do not depend on batching, resuming or the streamed/reference path; a
method set at build time is recorded in meta.json (without re-embedding) and used by the run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cir_helpers import (
    build_args,
    built_index,
    check_abi,
    clip_dirs,
    corpus,
    full_run,
    killed_run,
    read_rows,
    requests_of,
    run_args,
)

from engine.retrieval.index import load_index
from evaluator.cir import build as cir_build
from evaluator.cir import run as cir_run

# hubness scorers with the call's own requests as the bank (named: the reference index has no text bank)
OPTIONS = ["slerp+gap", "slerp+isoftmax:bank=requests", "slerp+qbnorm:bank=requests",
           "slerp+dual-softmax:bank=requests", "slerp+csls:bank=requests", "slerp+aqe",
           "slerp+dba", "sum+gap-centre:text=both+csls:k=5:bank=requests+aqe:n=2+dba:n=2"]


def _run(tmp_path, method, *extra, name=None):
    out, rep = tmp_path / f"{name or 'o'}.jsonl", tmp_path / f"{name or 'o'}.json"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--method", method, "--report", str(rep),
                                 *extra)) == 0
    return read_rows(out), json.loads(rep.read_text())


@pytest.mark.parametrize("method", OPTIONS)
def test_each_option_keeps_the_abi_and_reports_what_it_used(method, tmp_path):
    rows, report = _run(tmp_path, method)
    check_abi(rows, requests_of(corpus() / "requests.jsonl"), load_index(built_index()).ids)
    assert report["method_label"] == method
    if "gap-centre" in method:                                     # this kit's transductive variant
        assert report["text_mean"] == "40 request texts" and report["image_mean"].startswith(("stored", "computed"))
    elif "gap" in method:                                          # the shift: no statistic from the requests
        assert report["text_mean"].endswith("fixed captions (engine.retrieval.gap)") and report["gap_norm"] > 0
    if any(h in method for h in ("softmax", "qbnorm", "csls")):
        assert report["bank"] == "40 request queries"
    if "dba" in method:
        assert report["dba"] == "computed at query time"          # the reference index stores none
    assert rows != read_rows(full_run())                           # the option changed the answers


@pytest.mark.abi
def test_bank_statistics_do_not_depend_on_batching_resume_or_streaming(tmp_path):
    method = "slerp+gap+qbnorm:bank=requests"
    whole, _ = _run(tmp_path, method, name="whole")
    one, _ = _run(tmp_path, method, "--batch-size", "1", name="one")
    # batch 1 vs 256: the same queries and statistics; only matmul rounding (ulps) differs, which may
    # swap near-ties of the random tiny CLIP
    _same_lists(whole, one, atol=1e-4, swaps=0.01)
    killed = tmp_path / "killed.jsonl"
    r = killed_run(*run_args(corpus() / "requests.jsonl", killed, "--method", method, "--batch-size", "1"),
                   after=5)
    assert r.returncode == -9 and len(read_rows(killed)) == 5
    assert cir_run.main(run_args(corpus() / "requests.jsonl", killed, "--method", method, "--batch-size", "1")) == 0
    assert killed.read_bytes() == (tmp_path / "one.jsonl").read_bytes()   # the bank still holds every request


def test_streamed_bank_statistics_match_their_reference_twin(tmp_path, monkeypatch):
    for method in ("slerp+csls:bank=requests", "slerp+dual-softmax:bank=requests", "slerp+dba"):
        fast, _ = _run(tmp_path, method, name=f"fast-{method}")   # one output per method: never a resume
        ref, _ = _run(tmp_path, method, "--bank-chunk", "0", name=f"ref-{method}")   # off switch: one [M, N] matrix
        _same_lists(fast, ref, atol=1e-5, swaps=0.01)


def _same_lists(a, b, atol, swaps):
    """Same queries, scores within atol position by position, ids equal but for a few near-tie swaps."""
    assert [r["query_id"] for r in a] == [r["query_id"] for r in b]
    diff = total = 0
    for x, y in zip(a, b):
        np.testing.assert_allclose([h["score"] for h in x["results"]], [h["score"] for h in y["results"]],
                                   rtol=0, atol=atol)
        diff += sum(h["image_id"] != g["image_id"] for h, g in zip(x["results"], y["results"]))
        total += len(x["results"])
    assert diff <= swaps * total, (diff, total)


def test_a_method_set_at_build_time_is_recorded_and_used(tmp_path, capsys):
    d = tmp_path / "index"
    shutil.copytree(built_index(), d)
    emb_before = np.asarray(load_index(d).emb).copy()
    args = build_args(d, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu",
                      "--method", "slerp+gap+csls:k=5:bank=requests")
    assert cir_build.main(args) == 0
    assert "recomputing the extras only" in capsys.readouterr().err
    idx = load_index(d)
    assert idx.meta["method"]["hubness"] == "csls" and idx.meta["method"]["csls_k"] == 5 and idx.meta["method"]["gap"]
    assert np.array_equal(np.asarray(idx.emb), emb_before) and idx.meta["timing"]["reused_embeddings"]
    assert cir_build.main(args) == 0 and "is up to date" in capsys.readouterr().err
    out, rep = tmp_path / "o.jsonl", tmp_path / "r.json"
    run = run_args(corpus() / "requests.jsonl", out, "--report", str(rep))
    run[run.index("--index-dir") + 1] = str(d)
    assert cir_run.main(run) == 0
    assert json.loads(rep.read_text())["method_label"] == "slerp+gap+csls:k=5:bank=requests"
    assert len(list(d.glob("embeddings-*.npy"))) == 1
