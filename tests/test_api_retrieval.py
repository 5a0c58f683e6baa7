"""engine.retrieval's Python API on the generated corpus and the tiny random CLIP: open_index(...)
.search and .search_many give exactly the rows scripts/run.sh writes (ids, their types, scores),
the example below runs as shown, and importing the package loads neither torch nor numpy."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cir_helpers import (
    REPO,
    built_index,
    clip_dirs,
    corpus,
    full_run,
    read_rows,
    requests_of,
    run_args,
    script,
)
from conftest import readme_python_block

import engine.retrieval

# The README's second example, run as is in a folder holding cir/index and cir/corpus.
EXAMPLE = readme_python_block(1)


@pytest.fixture(scope="module")
def index():
    return engine.retrieval.open_index(built_index(), clip_dirs()["open_clip"], device="cpu")


@pytest.mark.abi
def test_search_and_search_many_give_the_rows_run_sh_writes(index, tmp_path):
    """search_many answers a requests list as scripts/run.sh answers the file (the same batches);
    search is a call of one request, as run.sh --batch-size 1 makes each. (Inside a larger batch
    CPU BLAS rounds differently, by ~1e-7: same ids, scores within 1e-6.)"""
    reqs = requests_of(corpus() / "requests.jsonl")
    rows = read_rows(full_run())                          # scripts/run.sh, the index's method (slerp), k 50
    assert [r["query_id"] for r in rows] == [r["query_id"] for r in reqs]
    many = index.search_many(reqs)
    assert many == [row["results"] for row in rows]       # ids (int or str, as indexed) and scores, exactly
    one_by_one = tmp_path / "one-by-one.jsonl"
    r = script("run.sh", "--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
               "--output", str(one_by_one), "--batch-size", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    for q, row, alone in zip(reqs, rows, read_rows(one_by_one)):
        hits = index.search(q["reference_image_id"], q["modification"], q.get("shared_concept"))
        assert hits == alone["results"], q["query_id"]    # exactly
        assert [h["image_id"] for h in hits] == [h["image_id"] for h in row["results"]], q["query_id"]
        assert [h["score"] for h in hits] == pytest.approx([h["score"] for h in row["results"]], abs=1e-6)
    q = reqs[0]
    assert index.search(q["reference_image_id"], q["modification"], q.get("shared_concept"), k=5) == \
        read_rows(one_by_one)[0]["results"][:5]
    assert len(many[0]) == 50 and all(set(h) == {"image_id", "score"} for h in many[0])


def test_search_many_is_one_call_as_run_sh_makes_it(index, tmp_path):
    """A method whose answers depend on the call's other requests (a requests bank): search_many
    answers the list as run.sh answers the file."""
    from evaluator.cir import run as cir_run

    method = "slerp+qbnorm:bank=requests"
    out = tmp_path / "rows.jsonl"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--method", method)) == 0
    reqs = requests_of(corpus() / "requests.jsonl")
    assert index.search_many(reqs, method=method) == [row["results"] for row in read_rows(out)]


def test_one_pipeline_serves_call_after_call(index):
    """Per-call state (the re-inspection budget, a requests bank) starts afresh each call."""
    r = requests_of(corpus() / "requests.jsonl")[1]
    method = "slerp+reinspect:n=5:crops=1"
    first = index.search(r["reference_image_id"], r["modification"], method=method)
    assert index.search(r["reference_image_id"], r["modification"], method=method) == first
    assert len(first) == 50


def test_the_query_pipeline_hands_its_topk_setting_to_the_kernel(index, monkeypatch):
    """KERNELS_TOPK is read by engine.settings and passed to kernels.topk (which reads no setting),
    with the switch's name and the index's compiled-kernel folder."""
    from kernels import topk as topk_mod

    r = requests_of(corpus() / "requests.jsonl")[0]
    want = index.search(r["reference_image_id"], r["modification"])
    calls, real = [], topk_mod.topk
    monkeypatch.setattr(topk_mod, "topk", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    for value in ("torch", "auto"):
        monkeypatch.setenv("KERNELS_TOPK", value)
        assert index.search(r["reference_image_id"], r["modification"]) == want
        assert calls and {(c["backend"], c["backend_from"], c["stored"].name) for c in calls} == \
            {(value, "KERNELS_TOPK", "kernels")}
        calls.clear()


def test_requests_as_the_jsonl_holds_them_and_bad_ones(index, capsys):
    r = requests_of(corpus() / "requests.jsonl")[3]
    want = index.search(r["reference_image_id"], r["modification"], r.get("shared_concept"))
    synonyms = {"pairid": 9, "reference": r["reference_image_id"], "relative_caption": r["modification"]}
    if r.get("shared_concept"):
        synonyms["shared_concept"] = r["shared_concept"]
    assert index.search_many([synonyms]) == [want]
    assert index.search_many([{"reference_image_id": r["reference_image_id"], "modification": r["modification"],
                               "shared_concept": r.get("shared_concept")}]) == [want]   # no query_id: its position
    text_only = index.search(None, r["modification"])
    assert text_only == index.search("no-such-image", r["modification"])
    assert "reference image 'no-such-image' is not in the index" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"requests\[1\]: query_id 1 also at requests\[0\]"):
        index.search_many([{"query_id": 1, "modification": "a"}, {"query_id": 1, "modification": "b"}])
    with pytest.raises(ValueError, match=r"requests\[0\]: expected a dict"):
        index.search_many(["make it red"])
    with pytest.raises(TypeError, match="modification must be a str"):
        index.search(0, None)
    with pytest.raises(ValueError, match="k must be an int"):
        index.search(0, "x", k=0)


def test_open_index_says_what_is_wrong(tmp_path, monkeypatch):
    from engine.clip.load import ClipLoadError
    from engine.retrieval.index import IndexLoadError

    with pytest.raises(IndexLoadError, match="meta.json is missing"):
        engine.retrieval.open_index(tmp_path)
    with pytest.raises(ClipLoadError, match="allow_model_mismatch=True"):
        engine.retrieval.open_index(built_index(), clip_dirs()["hf"], device="cpu")
    meta = json.loads((built_index() / "meta.json").read_text())
    (tmp_path / "index").mkdir()
    for p in built_index().iterdir():
        if p.is_file():
            (tmp_path / "index" / p.name).write_bytes(p.read_bytes())
    meta["model"]["dir"] = str(tmp_path / "gone")
    (tmp_path / "index" / "meta.json").write_text(json.dumps(meta))
    monkeypatch.delenv("CLIP_MODEL_DIR", raising=False)
    with pytest.raises(ClipLoadError, match=r"no CLIP model folder given.*gone, is missing"):
        engine.retrieval.open_index(tmp_path / "index")


def test_the_example_runs_with_the_clip_the_index_records(tmp_path, monkeypatch, capsys):
    (tmp_path / "cir").mkdir()
    (tmp_path / "cir" / "index").symlink_to(built_index())
    (tmp_path / "cir" / "corpus").symlink_to(corpus())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLIP_MODEL_DIR", raising=False)
    monkeypatch.setenv("CLIP_DEVICE", "cpu")
    ns: dict = {}
    exec(compile(EXAMPLE, "EXAMPLE", "exec"), ns)
    assert ns["rows"] == [row["results"] for row in read_rows(full_run())]   # scripts/run.sh's rows, exactly
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 6 and lines[-1] == "40 requests answered, 50 results each"
    assert all(line.split()[0] != "100000" for line in lines[:5])     # the reference is left out
    assert f"using {clip_dirs()['open_clip']}, the one the index records" in err


def test_importing_the_package_loads_neither_torch_nor_numpy():
    code = ("import sys\nimport engine.retrieval\nassert callable(engine.retrieval.open_index)\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
