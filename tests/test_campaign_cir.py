"""Evidence campaign of the cir-retrieval workload: a real min campaign (generated corpus, tiny
random CLIP, scripts/build.sh + scripts/run.sh) and fake runners for the gate (CPU, no weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cir_helpers import check_abi, read_rows, requests_of

from engine.retrieval.index import commit
from engine.retrieval.jsonl import read_records
from evaluator.cir.score import load_label_files, load_results, score
from evaluator.evidence import campaign, sha256_manifest

GALLERY = [100_000 + i if i % 2 == 0 else f"dev-{i}" for i in range(60)]  # int and str ids, as CIRCO/CIRR

# A stand-in for scripts/run.sh: a random ranking of the gallery per request (the reference left
# out), descending scores, one violation of the gate at run `bad_at` (request 1). Run number n
# comes from a counter file; behaviour from the JSON config in FAKE_CIR_CONFIG.
FAKE_RUN_SH = '''#!{python}
import argparse, json, os, random, sys, time
from pathlib import Path

p = argparse.ArgumentParser()
for opt in ("--index-dir", "--queries", "--output", "--report"):
    p.add_argument(opt)
a = p.parse_args()
cfg = json.loads(Path(os.environ["FAKE_CIR_CONFIG"]).read_text())
state = Path(cfg["state"])
n = int(state.read_text()) + 1 if state.exists() else 1
state.write_text(str(n))
# Sleep until process start + sleep, so interpreter start-up jitter does not reach the wall time.
start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
time.sleep(max(0.0, start + cfg.get("sleep", 0.01) - time.clock_gettime(time.CLOCK_BOOTTIME)))
meta = json.loads((Path(a.index_dir) / "meta.json").read_text())
ids = json.loads((Path(a.index_dir) / meta["files"]["ids"]).read_text())
reqs = [json.loads(line) for line in Path(a.queries).read_text().splitlines() if line.strip()]
bad = cfg.get("bad") if n == cfg.get("bad_at") else None
if bad == "exit":
    print("fake run.sh: simulated crash", file=sys.stderr)
    sys.exit(3)
rows = []
for q, r in enumerate(reqs):
    pool = [i for i in ids if str(i) != str(r["reference_image_id"])]
    random.Random(q * 1000 + (n if cfg.get("vary") else 0)).shuffle(pool)
    res = [{{"image_id": i, "score": 1.0 - 0.01 * k}} for k, i in enumerate(pool[:50])]
    if bad and q == 1:
        if bad == "51-ids":
            res.append({{"image_id": pool[50], "score": 0.0}})
        elif bad == "reference":
            res[3]["image_id"] = r["reference_image_id"]
        elif bad == "nan":
            res[2]["score"] = float("nan")
        elif bad == "increasing":
            res[4]["score"] = 2.0
        elif bad == "unknown":
            res[0]["image_id"] = "not-in-index"
        elif bad == "duplicate":
            res[1]["image_id"] = res[0]["image_id"]
    rows.append({{"query_id": r["query_id"], "results": res}})
if bad == "missing":
    rows.pop()
if bad == "order":
    rows[0], rows[1] = rows[1], rows[0]
with open(a.output, "w") as f:
    f.write("".join(json.dumps(row) + "\\n" for row in rows))
if a.report and not cfg.get("no_report"):
    Path(a.report).write_text(json.dumps({{"queries": len(reqs), "answered": len(rows), "resumed": 0,
        "device": "cpu", "precision": "fp32", "gallery": len(ids), "setup_s": 0.004, "query_s": 0.001,
        "queries_per_s": len(rows) / 0.001}}))
os._exit(0)  # skip interpreter shutdown: less exit jitter
'''


@pytest.fixture(scope="module")
def fake_inputs(tmp_path_factory) -> dict[str, Path]:
    """A committed index over GALLERY, 10 requests, their labels, a CLIP folder, and a clean source
    tree whose scripts/run.sh is the fake runner."""
    root = tmp_path_factory.mktemp("cir-fake")
    (root / "index").mkdir()
    emb = np.eye(8, dtype=np.float16)[np.arange(len(GALLERY)) % 8]  # [N, D] unit rows; the fake runner never reads them
    commit(root / "index", emb, GALLERY, {"model": {"arch": "fake-clip", "layout": "open_clip",
                                                    "digest": "ab" * 32}, "device": "cpu"})
    reqs, labels = [], []
    for q in range(10):
        ref = GALLERY[(7 * q) % len(GALLERY)]
        positives = [g for g in GALLERY[q:q + 12] if g != ref]
        qid = q if q % 2 == 0 else f"cirr-{q}"
        reqs.append({"query_id": qid, "reference_image_id": ref, "modification": f"make it {q}"})
        labels.append({"query_id": qid, "source": "circo" if q % 2 == 0 else "cirr",
                       "positives": positives if q % 2 == 0 else positives[:1]})
    (root / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    (root / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labels))
    (root / "clip").mkdir()
    (root / "clip" / "open_clip_pytorch_model.bin").write_bytes(b"\x00" * 64)
    src = root / "src"
    (src / "scripts").mkdir(parents=True)
    run = src / "scripts" / "run.sh"
    run.write_text(FAKE_RUN_SH.format(python=sys.executable))
    run.chmod(0o755)
    git = ["git", "-C", str(src), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fake"], check=True)
    return {"root": root, "src": src}


@pytest.fixture
def configure(tmp_path, monkeypatch):
    """configure(**cfg) writes the fake runner's config for this test."""
    cfg = tmp_path / "fake.json"
    monkeypatch.setenv("FAKE_CIR_CONFIG", str(cfg))

    def write(**kw) -> None:
        cfg.write_text(json.dumps({"state": str(tmp_path / "fake.state"), **kw}))

    write()
    return write


def max_args(fake: dict[str, Path], out: Path, runs: int = 5, *extra: str) -> list[str]:
    root = fake["root"]
    return ["run", "--workload", "cir-retrieval", "--profile", "max", "--runs", str(runs), "--out", str(out),
            "--index-dir", str(root / "index"), "--queries", str(root / "requests.jsonl"),
            "--labels", str(root / "labels.jsonl"), "--clip-dir", str(root / "clip"),
            "--dataset-split", "fake-val", "--dataset-version", "v1", "--source-dir", str(fake["src"]), *extra]


def load(out: Path) -> dict:
    return json.loads((out / "disclosure.json").read_text())


# ---------------------------------------------------------------- the real min campaign


MIN_RUNS = 3   # fresh run.sh processes of the real min campaign, each checked; five-run attempts: the fake runners below


@pytest.fixture(scope="module")
def min_campaign(tmp_path_factory):
    """MIN_RUNS fresh scripts/run.sh processes over a generated corpus (60 images, 20 requests) and the
    tiny random CLIP, the index built once by scripts/build.sh (~35 s on two cores)."""
    out = tmp_path_factory.mktemp("cir-min") / "out"
    rc = campaign.main(["run", "--workload", "cir-retrieval", "--profile", "min", "--runs", str(MIN_RUNS),
                        "--count", "60", "--requests", "20", "--out", str(out), "--timeout-s", "300"])
    return rc, out


@pytest.mark.slow
def test_min_campaign_runs_verifies_and_is_functional_only(min_campaign):
    rc, out = min_campaign
    doc = load(out)
    assert rc == 0, doc["failed_runs"]
    assert doc["workload"]["id"] == "cir-retrieval" and doc["workload"]["roles"] == ["functional"]
    assert doc["result_role"] == "functional" and doc["promotion"]["status"] == "not-promotable: min profile"
    assert doc["attempt"]["valid"] is True and doc["primary_metric"]["n"] == MIN_RUNS
    assert doc["dataset"]["rows"] == 20 and doc["dataset"]["gallery_images"] == 60
    assert doc["dataset"]["split"] == "generated:seed=0,images=60,requests=20"
    assert doc["dataset"]["preparation"]["index_build_s"] > 0
    assert doc["dataset"]["generated_markers"] and doc["dataset"]["generated_markers"][0].endswith("GENERATED.json")
    assert doc["digests"]["before"] == doc["digests"]["after"]
    assert doc["model"]["layout"] == "open_clip" and len(doc["model"]["model_digest"]) == 64
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0
    listed = {e["path"] for e in json.loads((out / sha256_manifest.MANIFEST_NAME).read_text())["files"]}
    assert {"disclosure.json", "report.html", "inputs/queries.jsonl", "inputs/labels-01.jsonl",
            "inputs/index_meta.json", "inputs/index_build.log", f"runs/run-{MIN_RUNS:02d}/results.jsonl",
            f"runs/run-{MIN_RUNS:02d}/report.json", f"runs/run-{MIN_RUNS:02d}/score.json"} <= listed


@pytest.mark.slow
def test_min_quality_is_reported_per_run_never_as_quality(min_campaign):
    rc, out = min_campaign
    doc = load(out)
    q = doc["quality"]
    assert q["metric"] == "raw" and q["shown_as_quality"] is False and q["gate_passed"] is True
    assert q["label"] == "functional check" and q["reward_rule"]["name"] == "piecewise-linear"
    assert len(q["values"]) == MIN_RUNS and len(set(q["values"])) == 1  # deterministic on CPU
    assert q["identical_across_runs"] is True and q["note"] is None
    # The campaign's number is the scorer's, on the run's own output and the copied labels.
    labels = load_label_files([out / "inputs" / "labels-01.jsonl"])
    for run in doc["runs"]:
        report = score(load_results(out / run["files"]["results"]), labels)
        assert (run["quality"]["raw"], run["quality"]["reward"]) == (report["raw"], report["reward"])
        assert run["quality"]["label"] == "functional check"
        assert json.loads((out / run["files"]["score"]).read_text())["label"].startswith("functional check")
    html = (out / "report.html").read_text()
    assert "raw (functional check)" in html and "reward (functional check)" in html
    assert "quality result" not in html
    assert ">promoted<" not in html


@pytest.mark.slow
def test_min_runs_are_fresh_processes_with_valid_output(min_campaign):
    rc, out = min_campaign
    doc = load(out)
    requests = requests_of(out / "inputs" / "queries.jsonl")
    gallery = [r.image_id for r in read_records(out / "inputs" / "records.jsonl", lambda msg: None)]
    outputs = {run["files"]["results"] for run in doc["runs"]}
    assert len(outputs) == MIN_RUNS  # one fresh output path per run
    for run in doc["runs"]:
        check_abi(read_rows(out / run["files"]["results"]), requests, gallery)  # the tests' own checker
        report = json.loads((out / run["files"]["timing"]).read_text())
        assert report["resumed"] == 0 and report["answered"] == 20
        stages = run["timing_report"]["stages"]
        assert set(stages) == {"setup", "query", "total"} and stages["total"] < run["wall_s"]
    html = (out / "report.html").read_text()
    assert "<title>setup: " in html and "<title>query: " in html  # the run's own stages are drawn


# ---------------------------------------------------------------- fake runners: gate, roles, promotion


@pytest.mark.parametrize("bad, words", [
    ("51-ids", "query 'cirr-1': 51 results (at most 50)"),
    ("reference", "query 'cirr-1': the reference image 'dev-7' is in its results (rank 4)"),
    ("nan", "query 'cirr-1': score nan at rank 3 is not finite"),
    ("increasing", "query 'cirr-1': scores increase at rank 5"),
    ("unknown", "query 'cirr-1': image id 'not-in-index' is not in the index"),
    ("duplicate", "appears more than once"),
    ("order", "results.jsonl line 1: query 'cirr-1' where request order expects '0'"),
    ("missing", "9 rows for 10 requests"),
    ("exit", "exit status 3: fake run.sh: simulated crash"),
])
def test_gate_violation_invalidates_the_attempt(fake_inputs, configure, tmp_path, bad, words):
    configure(bad=bad, bad_at=2)
    out = tmp_path / "out"
    assert campaign.main(max_args(fake_inputs, out, 4)) == 1
    doc = load(out)
    assert doc["attempt"] == doc["attempt"] | {"valid": False, "runs_requested": 4, "runs_started": 2}
    (failed,) = doc["failed_runs"]
    assert failed["index"] == 2 and words in failed["reason"], failed["reason"]
    assert failed["reason"].startswith("exit status" if bad == "exit" else "gate failed: ")
    assert [r["index"] for r in doc["runs"]] == [1] and len(doc["primary_metric"]["values"]) == 1
    assert not (out / "runs" / "run-03").exists()  # stopped: never replaced or retried
    assert doc["quality"]["gate_passed"] is False and doc["promotion"]["promoted"] is False
    assert any(r.startswith("attempt invalidated: run 2 failed: ") for r in doc["promotion"]["reasons"])
    assert words in (out / "report.html").read_text().replace("&#x27;", "'")
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0


def test_max_campaign_is_score_and_performance_bearing(fake_inputs, configure, tmp_path):
    configure(sleep=0.6)
    out = tmp_path / "out"
    assert campaign.main(max_args(fake_inputs, out)) == 0
    doc = load(out)
    assert doc["promotion"] == {"status": "promoted", "promoted": True, "reasons": []}
    assert doc["workload"]["roles"] == ["score-bearing", "performance-bearing"]
    assert doc["result_role"] == "canonical" and doc["quality"]["shown_as_quality"] is True
    assert doc["configuration"]["runner"] == [str(fake_inputs["src"] / "scripts" / "run.sh")]
    assert doc["model"]["name"] == "fake-clip" and doc["device"]["executed"] == "cpu"
    assert set(doc["digests"]["before"]) == {"queries", "labels_01", "index_meta", "index_tree", "clip"}
    assert doc["dataset"]["mode"] == "real" and doc["dataset"]["rows"] == 10
    assert 0 < doc["quality"]["aggregate"] < 1 and doc["quality"]["identical_across_runs"] is True
    assert doc["dataset"]["coverage"]["complete"] is True and doc["dataset"]["split"] == "fake-val"
    assert doc["model"]["build_command"].startswith("scripts/build.sh --corpus ")
    html = (out / "report.html").read_text()
    assert "raw (quality result)" in html and ">promoted<" in html
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0


def test_quality_that_differs_across_runs_is_noted(fake_inputs, configure, tmp_path):
    configure(vary=True)
    out = tmp_path / "out"
    assert campaign.main(max_args(fake_inputs, out, 3)) == 0  # valid: every output passes the gate
    q = load(out)["quality"]
    assert q["identical_across_runs"] is False and len(set(q["values"])) > 1
    assert q["note"].startswith("raw quality differs across runs") and q["aggregate"] == sorted(q["values"])[1]


def test_run_without_a_report_is_valid_and_shows_wall_times_only(fake_inputs, configure, tmp_path):
    configure(no_report=True)
    out = tmp_path / "out"
    runner = f"{sys.executable} {fake_inputs['src'] / 'scripts' / 'run.sh'}"
    assert campaign.main(max_args(fake_inputs, out, 2, "--runner", runner)) == 0
    doc = load(out)
    assert [r["timing_report"]["stages"] for r in doc["runs"]] == [None, None]
    assert "runner is not the contest ABI entry point scripts/run.sh" in doc["promotion"]["reasons"]
    html = (out / "report.html").read_text()
    assert "No stage breakdown in the timing reports." in html and html.count("<svg") == 1


def test_cir_options_are_checked_before_anything_runs(fake_inputs, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["run", "--workload", "cir-retrieval", "--out", str(out), "--source-dir", str(fake_inputs["src"])]
    assert campaign.main([*base, "--profile", "max"]) == 2
    assert "profile max requires --index-dir, --queries, --labels, --clip-dir" in capsys.readouterr().err
    args = max_args(fake_inputs, out)
    args[args.index("--labels") + 1] = str(tmp_path / "nope.jsonl")
    assert campaign.main(args) == 2
    assert f"--labels {tmp_path / 'nope.jsonl'}: not a file" in capsys.readouterr().err
    assert campaign.main([*max_args(fake_inputs, out), "--manifest", str(tmp_path / "m.tsv")]) == 2
    assert "--manifest: not an input of workload cir-retrieval" in capsys.readouterr().err
    assert campaign.main([*base, "--profile", "min", "--prepared", str(tmp_path)]) == 2
    assert "--prepared is not used by cir-retrieval" in capsys.readouterr().err
    assert not out.exists()
