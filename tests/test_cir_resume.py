"""A resumed retrieval output must have been written with the same method, index and CLIP."""
from __future__ import annotations

import pytest
from cir_helpers import corpus, read_rows, run_args

from evaluator.cir import run as cir_run


def test_resume_refuses_another_method_and_fresh_starts_over(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    q = corpus() / "requests.jsonl"
    assert cir_run.main(run_args(q, out, "--method", "slerp")) == 0
    first = out.read_bytes()
    assert (tmp_path / "r.jsonl.run.json").is_file()
    capsys.readouterr()
    assert cir_run.main(run_args(q, out, "--method", "text-only")) == 2
    err = capsys.readouterr().err
    assert "cannot be resumed" in err and "another method" in err and "--fresh" in err
    assert out.read_bytes() == first                                       # untouched
    assert cir_run.main(run_args(q, out, "--method", "text-only", "--fresh")) == 0
    assert read_rows(out) != [] and out.read_bytes() != first
    capsys.readouterr()
    assert cir_run.main(run_args(q, out, "--method", "text-only")) == 0     # same method: resumes, all kept
    assert "rows kept" in capsys.readouterr().err


def test_an_output_without_its_record_is_not_resumed(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    q = corpus() / "requests.jsonl"
    assert cir_run.main(run_args(q, out)) == 0
    (tmp_path / "r.jsonl.run.json").unlink()
    capsys.readouterr()
    assert cir_run.main(run_args(q, out)) == 2
    assert "no record" in capsys.readouterr().err


@pytest.mark.abi
def test_retrieval_commands_speak_one_error_line(tmp_path):
    from cir_helpers import build_args, script

    r = script("build.sh", *build_args(tmp_path / "idx"), env={"ENGINE_DECODER": "foo"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("scripts/build.sh: error: ENGINE_DECODER")
    r = script("run.sh", "--index-dir", str(tmp_path / "none"), "--queries", str(corpus() / "requests.jsonl"),
               "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("scripts/run.sh: error: ")


def test_resume_is_bound_to_the_requests(tmp_path, capsys):
    """Same query ids with new modifications: refused (naming --fresh), the stale output intact;
    the same requests (even re-spaced, with blank lines) resume; --fresh answers the new ones."""
    import json

    q = corpus() / "requests.jsonl"
    out = tmp_path / "r.jsonl"
    reqs = [json.loads(line) for line in q.read_text().splitlines() if line.strip()]
    assert cir_run.main(run_args(q, out, "--method", "text-only")) == 0
    first = out.read_bytes()
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps({**r, "modification": f"{r['modification']} at night"}) + "\n"
                              for r in reqs))
    capsys.readouterr()
    assert cir_run.main(run_args(changed, out, "--method", "text-only")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("scripts/run.sh: error: ") and "other requests" in err[-1] and "--fresh" in err[-1]
    assert out.read_bytes() == first                                       # untouched
    respaced = tmp_path / "respaced.jsonl"                                 # the same requests, other bytes
    respaced.write_text("\n".join(json.dumps(r, indent=None, separators=(", ", ": ")) + "\n" for r in reqs))
    assert cir_run.main(run_args(respaced, out, "--method", "text-only")) == 0
    assert f"{len(reqs)} rows kept" in capsys.readouterr().err and out.read_bytes() == first
    assert cir_run.main(run_args(changed, out, "--method", "text-only", "--fresh")) == 0
    anew = read_rows(out)
    assert [r["query_id"] for r in anew] == [r["query_id"] for r in reqs] and out.read_bytes() != first
    capsys.readouterr()
    assert cir_run.main(run_args(changed, out, "--method", "text-only")) == 0     # now bound to the new ones
    assert f"{len(reqs)} rows kept" in capsys.readouterr().err
