"""Evidence campaign end to end with a fake contest runner (CPU, no model, fast)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evaluator.evidence import campaign, sha256_manifest
from evaluator.evidence.runs import Workload

REPO = Path(__file__).resolve().parent.parent
ROWS = 24

# A stand-in for scripts/run: copies the reference answers (or wrong ones), sleeps, writes
# a timing report. Run number n comes from a counter file; behaviour from a JSON config.
FAKE_RUNNER = '''#!{python}
import json, os, struct, sys, time
from pathlib import Path

t0 = time.perf_counter()
cfg = json.loads(Path(os.environ["FAKE_RUNNER_CONFIG"]).read_text())
state = Path(cfg["state"])
n = int(state.read_text()) + 1 if state.exists() else 1
state.write_text(str(n))
manifest, image_root, output = sys.argv[1:4]
sleeps = cfg.get("sleeps", [0.01])
# Sleep until process start + sleep, so interpreter start-up jitter does not reach the wall time.
start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
time.sleep(max(0.0, start + sleeps[(n - 1) % len(sleeps)] - time.clock_gettime(time.CLOCK_BOOTTIME)))
if n == cfg.get("fail_at"):
    print("fake runner: simulated crash", file=sys.stderr)
    sys.exit(3)
if n == cfg.get("touch_artifact_at"):
    (Path(os.environ["ENGINE_ARTIFACT"]) / "weights.bin").write_bytes(b"changed")
ref = Path(cfg["reference"]).read_bytes()
if n == cfg.get("wrong_at"):
    vals = struct.unpack("<%di" % (len(ref) // 4), ref)
    ref = struct.pack("<%di" % len(vals), *[(v + 1) % 1000 for v in vals])
Path(output).write_bytes(ref)
total = time.perf_counter() - t0
stages = {{"imports": 0.1 * total, "artifact_load": 0.2 * total, "decode": 0.3 * total,
          "inference": 0.3 * total, "write": 0.05 * total, "total": total}}
timeline = []
for b in range(4):
    timeline.append({{"stage": "decode", "batch": b, "start": 0.3 * total + 0.07 * b * total,
                     "end": 0.3 * total + 0.07 * (b + 1) * total}})
    timeline.append({{"stage": "inference", "batch": b, "start": 0.37 * total + 0.07 * b * total,
                     "end": 0.37 * total + 0.07 * (b + 1) * total}})
Path(os.environ["CONTEST_REPORT"]).write_text(json.dumps({{
    "stages": stages, "timeline": timeline, "images": len(ref) // 4,
    "images_per_s": len(ref) / 4 / total, "backend": "fake", "decoder": "none",
    "precision": "fp32", "batch_size": 8, "device": cfg.get("device", "cpu")}}))
os._exit(0)  # skip interpreter shutdown: less exit jitter
'''


def make_prepared(root: Path, rows: int = ROWS) -> Path:
    """A dir shaped like `python -m evaluator.demo prepare` output: cohort/, artifact/, reference.i32."""
    (root / "cohort" / "images").mkdir(parents=True)
    lines = []
    for i in range(rows):
        name = f"img_{i:04d}.JPEG"
        (root / "cohort" / "images" / name).write_bytes(b"\xff\xd8fake jpeg %d" % i)
        lines.append(f"req{i:04d}\t{name}")
    (root / "cohort" / "manifest.tsv").write_text("\n".join(lines) + "\n")
    (root / "artifact").mkdir()
    (root / "artifact" / "weights.bin").write_bytes(b"\x00" * 256)
    (root / "artifact" / "manifest.json").write_text(json.dumps({
        "spec": {"model": "eva02_tiny_test", "precision": "fp32"},
        "checkpoint": {"path": str(root / "absent.safetensors"), "sha256": "ab" * 32, "bytes": 10},
        "build": {"argv": ["/x/engine/build.py", "--model", "eva02_tiny_test", "--out", "artifact"]},
        "backend": "eager", "batch_size": 8, "device": "cpu"}))
    np.random.default_rng(0).integers(0, 1000, rows).astype("<i4").tofile(root / "reference.i32")
    return root


def make_source_repo(root: Path) -> Path:
    """A clean git tree whose scripts/run is the fake runner."""
    (root / "scripts").mkdir(parents=True)
    run = root / "scripts" / "run"
    run.write_text(FAKE_RUNNER.format(python=sys.executable))
    run.chmod(0o755)
    git = ["git", "-C", str(root), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fake"], check=True)
    return root


def write_config(path: Path, prepared: Path, **cfg) -> Path:
    path.write_text(json.dumps({"state": str(path.with_suffix(".state")),
                                "reference": str(prepared / "reference.i32"), **cfg}))
    return path


def max_args(prepared: Path, source: Path, out: Path, runs: int = 5, *extra: str) -> list[str]:
    return ["run", "--workload", "eva02-imagenet1k", "--profile", "max", "--runs", str(runs), "--out", str(out),
            "--manifest", str(prepared / "cohort" / "manifest.tsv"),
            "--image-root", str(prepared / "cohort" / "images"),
            "--reference", str(prepared / "reference.i32"), "--artifact", str(prepared / "artifact"),
            "--dataset-split", "test-split", "--dataset-version", "v1", "--source-dir", str(source), *extra]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """(prepared dir, source repo, config path); set FAKE_RUNNER_CONFIG, then call configure(**cfg)."""
    prepared = make_prepared(tmp_path / "prepared")
    source = make_source_repo(tmp_path / "src")
    cfg = tmp_path / "fake.json"
    monkeypatch.setenv("FAKE_RUNNER_CONFIG", str(cfg))

    def configure(**kw) -> None:
        write_config(cfg, prepared, **kw)

    configure()
    return prepared, source, configure


@pytest.fixture(scope="module")
def passing(tmp_path_factory):
    """One passing 5-run max campaign, shared by the read-only tests below."""
    tmp = tmp_path_factory.mktemp("passing")
    prepared = make_prepared(tmp / "prepared")
    source = make_source_repo(tmp / "src")
    bench = tmp / "bench.json"
    bench.write_text(json.dumps({"machine_info": {}, "commit_info": {"id": "abc", "dirty": False},
                                 "benchmarks": [{"name": "test_topk", "fullname": "tests/x.py::test_topk",
                                                 "stats": {"median": 0.0012}}]}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_RUNNER_CONFIG", str(write_config(tmp / "fake.json", prepared, sleeps=[0.6])))
        rc = campaign.main(max_args(prepared, source, tmp / "out", 5, "--attach", str(bench)))
    return rc, tmp / "out"


def test_passing_campaign_is_promoted_and_verifies(passing, capsys):
    rc, out = passing
    doc = json.loads((out / "disclosure.json").read_text())
    assert rc == 0
    assert doc["promotion"] == {"status": "promoted", "promoted": True, "reasons": []}
    assert doc["result_role"] == "canonical" and doc["quality"]["shown_as_quality"] is True
    assert (doc["mode"], doc["phase"], doc["scenario"]) == ("inference", "full", "offline")
    assert doc["notice"].startswith("independent preview; not an official MLPerf result; not endorsed by MLCommons")
    assert set(doc["role_rules"]) >= {"score-bearing", "performance-bearing", "systems-only", "deferred", "rejected"}
    assert doc["model"]["name"] == "eva02_tiny_test" and doc["model"]["checkpoint_sha256"] == "ab" * 32
    assert doc["model"]["build_command"] == "/x/engine/build.py --model eva02_tiny_test --out artifact"
    assert doc["model"]["artifact_manifest_sha256"] == sha256_manifest.sha256_file(out / "inputs" / "artifact_manifest.json")
    assert doc["dataset"]["split"] == "test-split" and doc["dataset"]["version"] == "v1"
    assert doc["dataset"]["coverage"] == {"what": "manifest rows answered by the reference (reference.i32)",
                                          "answered": ROWS, "rows": ROWS, "complete": True}
    assert set(doc["scheduling"]) >= {"decoder", "pipeline_depth", "reader_threads", "cuda_graphs", "thread_budget"}
    assert doc["evidence"]["sha256"] == json.loads((out / sha256_manifest.MANIFEST_NAME).read_text())["evidence_sha256"]
    assert doc["bundle"]["bundled"] is True and doc["bundle"]["path"] == "inputs/artifact"
    assert doc["device"] == {"requested": "cpu", "executed": "cpu", "backend": "fake"}
    assert doc["source"]["git_sha"] and doc["source"]["dirty"] is False
    assert len(doc["system"]["fingerprint_sha256"]) == 64
    assert doc["attachments"][0]["benchmarks"] == [{"name": "tests/x.py::test_topk", "median_s": 0.0012}]
    assert (out / "report.html").is_file() and (out / "inputs" / "manifest.tsv").is_file()
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0
    listed = {e["path"] for e in json.loads((out / sha256_manifest.MANIFEST_NAME).read_text())["files"]}
    assert {"disclosure.json", "report.html", "runs/run-05/predictions.i32", "runs/run-05/timing.json",
            "inputs/artifact_manifest.json", "inputs/reference.i32", "attachments/01-bench.json",
            "inputs/artifact/manifest.json", "inputs/artifact/weights.bin"} <= listed
    assert "signature" not in capsys.readouterr().out.lower()
    for path in out.rglob("*"):  # it is a digest, never called a signature
        if path.is_file() and path.suffix in (".json", ".html"):
            assert "signature" not in path.read_text().lower(), path


@pytest.mark.abi
def test_cli_entry_point_verifies(passing):
    proc = subprocess.run([sys.executable, "-m", "evaluator.campaign", "verify",
                           str(passing[1] / sha256_manifest.MANIFEST_NAME)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout and "signature" not in (proc.stdout + proc.stderr).lower()


def test_bad_attachment_is_refused_before_any_run(env, tmp_path, capsys):
    prepared, source, _ = env
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a benchmark"}))
    assert campaign.main([*max_args(prepared, source, tmp_path / "out"), "--attach", str(bad)]) == 1
    assert "no 'benchmarks' list" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_statistics_recomputed_by_hand_match(passing):
    doc = json.loads((passing[1] / "disclosure.json").read_text())
    walls = [r["wall_s"] for r in doc["runs"]]
    pm = doc["primary_metric"]
    assert pm["values"] == walls and pm["n"] == 5
    assert pm["median"] == pytest.approx(statistics.median(walls))
    assert pm["stdev"] == pytest.approx(statistics.stdev(walls))
    assert pm["cv"] == pytest.approx(statistics.stdev(walls) / statistics.mean(walls))
    assert (pm["min"], pm["max"]) == (min(walls), max(walls))
    assert pm["range"] == pytest.approx(max(walls) - min(walls))
    q = doc["quality"]
    assert q["matches"] == [ROWS] * 5 and q["aggregate"] == 1.0 and q["gate_passed"] is True
    assert q["thresholds"] == [ROWS] * 5 and q["label"] == "quality result"  # ceil(0.99 * 24) = 24


def test_tampered_byte_in_campaign_folder_fails_verify(passing, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(passing[1], copy)
    target = copy / "runs" / "run-02" / "predictions.i32"
    data = bytearray(target.read_bytes())
    data[0] ^= 1
    target.write_bytes(bytes(data))
    assert campaign.main(["verify", str(copy / sha256_manifest.MANIFEST_NAME)]) == 1
    assert "runs/run-02/predictions.i32: changed" in capsys.readouterr().err


def test_failed_run_invalidates_attempt(env, tmp_path):
    prepared, source, configure = env
    configure(sleeps=[0.01, 0.01, 0.9], fail_at=3)
    assert campaign.main(max_args(prepared, source, tmp_path / "out")) == 1
    doc = json.loads((tmp_path / "out" / "disclosure.json").read_text())
    assert doc["attempt"]["valid"] is False and doc["attempt"]["runs_started"] == 3
    assert doc["attempt"]["reason"].startswith("run 3 failed: exit status 3")
    assert [r["index"] for r in doc["runs"]] == [1, 2]
    assert len(doc["primary_metric"]["values"]) == 2 and max(doc["primary_metric"]["values"]) < 0.9
    assert "median" not in doc["primary_metric"] and "cv" not in doc["primary_metric"]
    assert doc["failed_runs"][0]["index"] == 3 and "exit status 3" in doc["failed_runs"][0]["reason"]
    assert "wall_s" not in doc["failed_runs"][0]
    assert not (tmp_path / "out" / "runs" / "run-04").exists()  # stopped: never replaced or retried
    assert any(r.startswith("attempt invalidated: run 3 failed") for r in doc["promotion"]["reasons"])
    assert doc["promotion"]["promoted"] is False
    assert campaign.main(["verify", str(tmp_path / "out" / sha256_manifest.MANIFEST_NAME)]) == 0


def test_wrong_answers_fail_the_gate(env, tmp_path):
    prepared, source, configure = env
    configure(wrong_at=2)
    assert campaign.main(max_args(prepared, source, tmp_path / "out")) == 1
    doc = json.loads((tmp_path / "out" / "disclosure.json").read_text())
    assert doc["failed_runs"][0]["reason"].startswith("gate failed: agreement 0/24 < threshold 24")
    assert doc["quality"]["gate_passed"] is False and doc["quality"]["values"] == [1.0]
    assert "aggregate" not in doc["quality"]  # an invalid attempt has none


def test_timed_out_run_invalidates_attempt(env, tmp_path):
    prepared, source, configure = env
    configure(sleeps=[10])
    assert campaign.main(max_args(prepared, source, tmp_path / "out", 5, "--timeout-s", "0.5")) == 1
    doc = json.loads((tmp_path / "out" / "disclosure.json").read_text())
    assert doc["failed_runs"][0]["timed_out"] is True and "timed out after 0.5 s" in doc["failed_runs"][0]["reason"]
    assert doc["primary_metric"]["values"] == []


def test_high_cv_fails_promotion(env, tmp_path):
    prepared, source, configure = env
    configure(sleeps=[0.02, 0.3])
    assert campaign.main(max_args(prepared, source, tmp_path / "out")) == 0  # valid attempt, not promoted
    doc = json.loads((tmp_path / "out" / "disclosure.json").read_text())
    assert doc["primary_metric"]["cv"] > 0.05
    assert doc["promotion"]["status"] == "not-promoted"
    assert any(r.startswith("timing CV ") and r.endswith("> 0.05") for r in doc["promotion"]["reasons"])
    assert doc["quality"]["shown_as_quality"] is False
    assert campaign.main([*max_args(prepared, source, tmp_path / "out2"), "--require-promotion"]) == 1


def test_min_profile_is_never_promoted_nor_quality(env, tmp_path):
    prepared, source, configure = env
    out = source / "evidence"  # inside the source tree: the campaign's own output is not "dirty"
    args = ["run", "--workload", "eva02-imagenet1k", "--profile", "min", "--runs", "5", "--out", str(out),
            "--prepared", str(prepared), "--source-dir", str(source)]
    assert campaign.main(args) == 0
    doc = json.loads((out / "disclosure.json").read_text())
    assert doc["result_role"] == "functional"
    assert doc["promotion"]["status"] == "not-promotable: min profile"
    assert doc["promotion"]["promoted"] is False
    assert "not-promotable: min profile" in doc["promotion"]["reasons"]
    assert doc["quality"]["shown_as_quality"] is False and doc["quality"]["label"] == "functional check"
    assert doc["workload"]["roles"] == ["functional"]
    assert doc["dataset"]["mode"] == "generated" and doc["source"]["dirty"] is False
    assert doc["dataset"]["gate_rows"].startswith("the rows the kit's reference path answers")
    html = (out / "report.html").read_text()
    assert "agreement (functional check)" in html and "quality result" not in html
    assert ">promoted<" not in html


def test_min_reuses_the_prepared_demo_and_says_so(env, tmp_path, monkeypatch, capsys):
    """`python -m evaluator.demo` leaves demo/ (cohort, artifact, reference.i32 written last): a min
    campaign started beside it reuses it instead of building the same again, and says so; a --count
    it does not have, or a demo stopped before its reference, is generated afresh."""
    import os

    from evaluator.evidence.workloads import eva02

    prepared, source, _ = env
    demo = tmp_path / "work" / "demo"
    shutil.copytree(prepared, demo)
    (demo / "cohort" / "cohort.json").write_text(json.dumps({"seed": 0, "count": ROWS}))
    t = (demo / "reference.i32").stat().st_mtime
    for p in (demo / "cohort" / "manifest.tsv", demo / "artifact" / "manifest.json"):
        os.utime(p, (t - 10, t - 10))
    monkeypatch.chdir(tmp_path / "work")
    generated = []

    def prepare_min(*args):
        generated.append(args)
        raise RuntimeError("generating")

    monkeypatch.setattr(eva02, "prepare_min", prepare_min)
    base = ["run", "--workload", "eva02-imagenet1k", "--profile", "min", "--runs", "2", "--source-dir", str(source)]
    assert campaign.main([*base, "--out", str(tmp_path / "o1")]) == 0
    err = capsys.readouterr().err
    assert f"campaign: reusing the prepared demo in {demo.resolve()} ({ROWS} generated images, seed 0" in err
    doc = json.loads((tmp_path / "o1" / "disclosure.json").read_text())
    assert doc["dataset"]["split"] == f"generated:seed=0,count={ROWS} (the prepared demo reused)"
    assert doc["dataset"]["rows"] == ROWS and not generated
    assert campaign.main([*base, "--out", str(tmp_path / "o2"), "--count", "8"]) == 1   # another count
    assert len(generated) == 1 and generated[0][2:] == (8, 0)
    os.utime(demo / "cohort" / "manifest.tsv", (t + 10, t + 10))       # the demo stopped after a new cohort
    assert campaign.main([*base, "--out", str(tmp_path / "o3")]) == 1
    assert len(generated) == 2 and generated[1][2:] == (64, 0)
    assert "reusing the prepared demo" not in capsys.readouterr().err


def test_dirty_tree_and_custom_runner_block_promotion(env, tmp_path):
    prepared, source, configure = env
    (source / "untracked.txt").write_text("x")
    runner = f"{sys.executable} {source / 'scripts' / 'run'}"
    assert campaign.main([*max_args(prepared, source, tmp_path / "out"), "--runner", runner]) == 0
    reasons = json.loads((tmp_path / "out" / "disclosure.json").read_text())["promotion"]["reasons"]
    assert "source tree dirty (git status --porcelain is not empty)" in reasons
    assert "runner is not the contest ABI entry point scripts/run" in reasons


def test_artifact_changed_during_campaign_blocks_promotion(env, tmp_path):
    prepared, source, configure = env
    configure(touch_artifact_at=2)
    campaign.main(max_args(prepared, source, tmp_path / "out"))
    reasons = json.loads((tmp_path / "out" / "disclosure.json").read_text())["promotion"]["reasons"]
    assert "digest changed during the campaign: artifact_tree" in reasons


def test_executed_device_differs_from_requested(env, tmp_path):
    prepared, source, configure = env
    configure(device="cuda:0")
    campaign.main(max_args(prepared, source, tmp_path / "out", 2))
    reasons = json.loads((tmp_path / "out" / "disclosure.json").read_text())["promotion"]["reasons"]
    assert "executed device cuda:0 differs from requested cpu" in reasons
    assert "2 runs requested; promotion needs 5 fresh processes" in reasons


def test_deferred_workload_fails_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(campaign.WORKLOADS, "later-thing", Workload(
        "later-thing", ("deferred",), "scripts/later", "none", "none", rule="joins when its ABI exists",
        runnable=False))
    rc = campaign.main(["run", "--workload", "later-thing", "--profile", "min", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "workload later-thing is deferred: joins when its ABI exists" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("profile, missing", [("max", "--manifest, --image-root, --reference, --artifact"),
                                              ("pro", "--config-note")])
def test_profile_requires_its_options(env, tmp_path, capsys, profile, missing):
    prepared, source, _ = env
    args = max_args(prepared, source, tmp_path / "o")
    args[args.index("--profile") + 1] = profile
    if profile == "max":
        args = args[:args.index("--manifest")] + ["--source-dir", str(source)]
    assert campaign.main(args) == 2
    assert missing in capsys.readouterr().err


def test_pro_profile_records_config_note(env, tmp_path):
    prepared, source, _ = env
    args = max_args(prepared, source, tmp_path / "o", 2, "--config-note", "fp8 weights, batch 64")
    args[args.index("--profile") + 1] = "pro"
    campaign.main(args)
    doc = json.loads((tmp_path / "o" / "disclosure.json").read_text())
    assert doc["result_role"] == "research" and doc["config_note"] == "fp8 weights, batch 64"


@pytest.mark.slow
def test_real_eva02_min_campaign(tmp_path):
    """The real path: `python -m evaluator.demo prepare` input, `scripts/run` processes (tiny CPU model).
    Two runs: what a third to fifth would add (the count, the aggregate over five) is checked with
    the fake runner above."""
    out = tmp_path / "out"
    rc = campaign.main(["run", "--workload", "eva02-imagenet1k", "--profile", "min", "--runs", "2",
                        "--count", "8", "--out", str(out), "--timeout-s", "600"])
    doc = json.loads((out / "disclosure.json").read_text())
    assert rc == 0, doc["failed_runs"]
    assert doc["result_role"] == "functional" and doc["quality"]["shown_as_quality"] is False
    assert len(doc["runs"]) == 2 and all(r["timing_report"]["stages"] is not None for r in doc["runs"])
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0


def test_the_result_line_rounds_seconds():
    doc = {"workload": {"id": "eva02-imagenet1k"}, "profile": "min", "promotion": {"status": "not-promotable"},
           "primary_metric": {"median": 4.512356109999928, "n": 5, "values": [4.512356109999928, 4.6]},
           "attempt": {"valid": True, "reason": None}}
    line = campaign.summary_line(doc)
    assert "median 4.51 s over 5 valid runs" in line and "4.5123" not in line
    doc["attempt"] = {"valid": False, "reason": "run 2 failed"}
    assert campaign.summary_line(doc).endswith("wall s of the runs that completed: 4.51, 4.60")
